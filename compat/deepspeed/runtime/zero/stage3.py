"""``deepspeed.runtime.zero.stage3``: ZeRO-3's memory estimators (runtime.estimator)."""

from runtime.estimator.cli import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]
