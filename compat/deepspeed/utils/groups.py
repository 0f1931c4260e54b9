"""``deepspeed.utils.groups``: DeepSpeed's process-group registry. The data-parallel group is the world,
or the data axis of the engine's mpu (``initialize(mpu=...)``, AutoTP's grid, a pipeline's grid) while
that engine lives; the model-parallel size is the mpu's. Expert and sequence groups do not exist here and
are refused by name."""

from runtime.deepspeed_api.collectives import (
    _get_data_parallel_group,
    _get_data_parallel_rank,
    _get_data_parallel_world_size,
    _get_expert_parallel_group,
    _get_model_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
)

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_model_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]
