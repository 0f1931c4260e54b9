"""The names and behaviours DeepSpeed users call that dslaunch's own API does not have, in one package.

`compat/deepspeed/` re-exports these under DeepSpeed's import paths (``deepspeed.comm``,
``deepspeed.accelerator``, ...); it holds names only, and every behaviour behind those names lives here or
in the runtime parts these modules call. dslaunch's own API (`runtime.initialize`, `runtime.zero`,
`runtime.pipe`, `runtime.activation_checkpointing`, ...) is not repeated here: compat names it directly.

Each module is named for its subject in plain words (the package name already says "DeepSpeed's"), and no
module name repeats one elsewhere in `runtime/` or `launcher/`, so a search for a file finds one:

- `accelerator`: ``deepspeed.accelerator``'s device object (``get_accelerator()``) for cuda or cpu.
- `collectives`: ``deepspeed.comm`` (``init_distributed``, ranks, collectives as module functions over
  torch.distributed) and ``deepspeed.utils.groups`` (the data- and model-parallel groups).
- `config_view`: ``DeepSpeedConfig``, the checked config answered by DeepSpeed's attribute names.
- `utils`: the logger, ``log_dist``, ``set_random_seed``, ``RepeatingLoader``,
  ``clone_tensors_for_torch_save`` (``deepspeed.utils``, ``deepspeed.runtime.utils``,
  ``deepspeed.checkpoint.utils``).
- `params`: ``safe_get_full_fp32_param`` and the other whole values of one ZeRO-partitioned parameter.
- `zero_params`: the rest of ``deepspeed.runtime.zero.partition_parameters`` that integrations touch
  (``ZeroParamStatus``, external parameters, the constructor wrapper).
- `moe`: ``split_params_into_different_moe_groups_for_optimizer`` for a runtime without expert layers.
- `alst`: the long-sequence names (``TiledMLP``, ``TiledFusedLogitsLoss``) over `runtime.sequence`; the
  Ulysses classes refused by name.
- `initialize`: ``initialize``'s DeepSpeed-only keywords (``config_params``, ``distributed_port``, ``mpu``).
- `unsupported`: ``UnsupportedFeature``, the one error for a DeepSpeed feature dslaunch lacks, and the
  stand-ins that raise it under DeepSpeed's names.

This ``__init__`` imports none of them: the engine imports `unsupported` and `params` from here, and an
``__init__`` importing every module would drag the config view, the collectives and the sequence parts into
each such import (and import circles with them). Import the module you need.
"""
