"""``deepspeed.runtime.zero.stage_1_and_2``: ZeRO-2's memory estimators (runtime.estimator)."""

from runtime.estimator.cli import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
