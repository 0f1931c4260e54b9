"""DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` for a runtime without MoE layers.

Scripts written for DeepSpeed's MoE call it unconditionally on their optimizer groups. It moves expert
parameters (marked ``param.allreduce = False`` by DeepSpeed's MoE layer) into groups of their own. dslaunch
builds no expert layers, so a dense model's groups come back as they are; a parameter marked as an expert
one (a model that brings its own MoE layers) is refused, since its gradients would need an expert-parallel
reduction dslaunch does not do.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from runtime.deepspeed_api.unsupported import unsupported

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: nn.Parameter) -> bool:
    return getattr(param, "allreduce", True) is False


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Any, max_group_size: int | None = 178956971
) -> list[dict[str, Any]]:
    """Param groups (a dict, a list of dicts, or parameters) as a list of dicts with expert parameters
    split out; without expert parameters, the same groups."""
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)) and param_groups and isinstance(param_groups[0], dict):
        groups = list(param_groups)
    else:
        groups = [{"params": list(param_groups)}]
    for group in groups:
        params = list(group["params"])
        group["params"] = params
        if any(is_moe_param(p) for p in params):
            unsupported(
                "Mixture-of-Experts parameter groups (expert parameters marked allreduce=False)",
                "train a dense model; dslaunch has no expert-parallel gradient reduction",
            )
    return groups
