"""``deepspeed.utils.groups``: DeepSpeed's process-group registry. dslaunch has one data-parallel group
(the world); expert, sequence and model-parallel groups do not exist and are refused by name."""

from runtime.dist_api import (
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
