"""``ds_estimate``: how much memory a ZeRO run takes per GPU and per host, and what fits, before running it.

The numbers live apart from their presentation, because the two change for different reasons:

- ``model_states``: the per-stage byte arithmetic (``estimate``, ``estimate_all``, ``model_sizes`` and
  the ``ModelSizes`` / ``StateBytes`` / ``Estimate`` records); it follows what the engine allocates, and
  its docstring has the bytes-per-parameter table and what offload moves to the host.
- ``fit``: whether a GPT trains on a machine (GPU and host memory) with everything a step needs beyond
  the model states (activations, staging, fixed costs), the offload ratios that fit, and the largest size
  of a family (``fit_gpt``, ``largest_gpt``); ``fit_cli`` is its ``ds_estimate --largest`` / ``--gpt``.
- ``longest``: the longest sequence a Llama-shaped model trains with the long-sequence parts
  (``ds_estimate --longest_seq``); ``step_flops``: that step's FLOPs and its time at a rate.
- ``cli``: the text table, DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs*`` names and the
  command line (``ds_estimate``, or ``python -m runtime.estimator``, through ``__main__``).

Everything is re-exported here: ``runtime.estimator`` is the import path callers and the console script
(``runtime.estimator:main`` in pyproject.toml) use.
"""

from runtime.estimator.cli import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    format_table,
    main,
)
from runtime.estimator.model_states import (
    DEFAULT_BUCKET,
    DTYPE_BYTES,
    MASTER_BYTES,
    OPTIMIZER_BYTES,
    Estimate,
    ModelSizes,
    StateBytes,
    estimate,
    estimate_all,
    model_sizes,
)

__all__ = [
    "DEFAULT_BUCKET",
    "DTYPE_BYTES",
    "MASTER_BYTES",
    "OPTIMIZER_BYTES",
    "Estimate",
    "ModelSizes",
    "StateBytes",
    "estimate",
    "estimate_all",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "format_table",
    "main",
    "model_sizes",
]
