"""Sharded checkpoints: save in parallel, resume exactly at any world size or ZeRO stage, consolidate.

    runtime.checkpoint.check_save_dir(save_dir)          # before training: a folder that takes files?
    engine.save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True)
    path, client_state = engine.load_checkpoint(load_dir, tag=None, load_optimizer_states=True,
                                                load_lr_scheduler_states=True, load_module_only=False)
    state_dict = runtime.checkpoint.get_fp32_state_dict_from_checkpoint(save_dir)   # no process group
    $ ds_consolidate save_dir model.safetensors [--dtype bf16]

Modules: `manifest` (on-disk layout and errors), `tensorfile` (safetensors-format shard files),
`durable` (atomic fsynced writes, checksums, the fault-injection hook), `reshard` (pure copy planning),
`shards` (the engine's flat groups <-> shard files), `engine_state` (counters, scaler, scheduler, RNG,
buffers, client state), `data_position` (resumable data loader), `commit` (staging folders and the
atomic swap that makes a save the checkpoint), `save` / `load` (the collective procedures), `consolidate`
(one state dict from a sharded checkpoint, streamed).

DeepSpeed's own folders load and consolidate too: `deepspeed_layout` (its partitions as flat ranges, pure),
`portable` (reads both formats with torch alone), `deepspeed_format` (its files as a manifest for `load`),
`fp32_state` (the entry of DeepSpeed's `zero_to_fp32` names); `portable_cli` and `recovery_script` make
the standalone `zero_to_fp32.py` every save writes beside `latest`.
"""

from __future__ import annotations

from typing import Any

from runtime.checkpoint.data_position import ResumableDataLoader, ResumableSampler
from runtime.checkpoint.load import load_checkpoint
from runtime.checkpoint.manifest import (
    CheckpointCorrupted,
    CheckpointError,
    CheckpointIncomplete,
    CheckpointMismatch,
    CheckpointNotFound,
    CheckpointRefused,
    CheckpointWriteError,
    Manifest,
    read_latest,
)
from runtime.checkpoint.save import check_save_dir, save_checkpoint

__all__ = [
    "CheckpointCorrupted",
    "CheckpointError",
    "CheckpointIncomplete",
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CheckpointRefused",
    "CheckpointWriteError",
    "Manifest",
    "ResumableDataLoader",
    "ResumableSampler",
    "check_save_dir",
    "consolidate_checkpoint",
    "get_fp32_state_dict_from_checkpoint",
    "load_checkpoint",
    "load_state_dict_file",
    "read_latest",
    "save_checkpoint",
]


_CONSOLIDATE = ("consolidate_checkpoint", "get_fp32_state_dict_from_checkpoint", "load_state_dict_file")


def __getattr__(name: str) -> Any:
    # imported on first use, so `python -m runtime.checkpoint.consolidate` runs the module only once
    if name in _CONSOLIDATE:
        import importlib

        return getattr(importlib.import_module("runtime.checkpoint.consolidate"), name)
    raise AttributeError(f"module 'runtime.checkpoint' has no attribute {name!r}")
