"""``deepspeed.moe.utils``: the optimizer-group helpers (runtime.moe_groups)."""

from runtime.moe_groups import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
