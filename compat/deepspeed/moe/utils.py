"""``deepspeed.moe.utils``: the optimizer-group helpers (runtime.deepspeed_api.moe)."""

from runtime.deepspeed_api.moe import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
