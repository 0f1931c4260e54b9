"""The DeepSpeed-style training config as typed, frozen dataclasses: the front door of `runtime/config/`.

Callers import from here (`from runtime.config import Config, ConfigError, load_config`); the modules
behind it each own one part, and import one way (reader <- checks <- offload, sections, parallel, batch,
optim <- zero <- load):

- `reader`: strict reading of a mapping: files (JSON/YAML), key paths, "auto", unknown-key suggestions,
  `ConfigError`. Knows no section names.
- `checks`: the value checks (`Bool`, `Int`, `Choice`, ...) a section hands to the reader.
- `batch`: the batch arithmetic (train_batch_size = micro x accumulation x world size).
- `zero`: `zero_optimization` (`ZeroConfig`, `OffloadConfig`; optimizer offload reads into
  `OffloadSettings`, in `offload`).
- `offload`: `OffloadSettings`, the typed `offload_optimizer` section (its keys, its internal knobs).
- `optim`: the `optimizer` and `scheduler` sections.
- `sections`: the small sections (fp16, bf16, activation_checkpointing, checkpoint, the monitors).
- `parallel`: the model-parallel sections, `pipeline` and `tensor_parallel` (their engines check them
  against the model).
- `load`: the top-level `Config`, `load_config` and `render_config`.
"""

from __future__ import annotations

from runtime.config.batch import BatchSizeError
from runtime.config.load import Config, load_config, render_config
from runtime.config.offload import OffloadSettings
from runtime.config.optim import OptimizerConfig, SchedulerConfig
from runtime.config.reader import ConfigError, read_config_file
from runtime.config.sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CSVMonitorConfig,
    FP16Config,
    TensorBoardConfig,
    WandbConfig,
)
from runtime.config.zero import OffloadConfig, ZeroConfig, model_hidden_size

__all__ = [
    "ActivationCheckpointingConfig",
    "BF16Config",
    "BatchSizeError",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "FP16Config",
    "OffloadConfig",
    "OffloadSettings",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "load_config",
    "model_hidden_size",
    "read_config_file",
    "render_config",
]
