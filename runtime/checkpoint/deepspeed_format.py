"""Resume from a checkpoint folder written by DeepSpeed (ZeRO 1, 2 or 3; fp32, bf16 or fp16 runs).

`engine.load_checkpoint(dir)` detects DeepSpeed's files (`portable.is_deepspeed_tag`: `*_optim_states.pt`,
`*_model_states.pt`, no manifest of ours) and reads them through the same plan as our own checkpoints:
`open_deepspeed` describes DeepSpeed's per-rank tensors as a `Manifest` (each optimizer file a "shard" whose
flat ranges come from `deepspeed_layout`), so `reshard.plan_copies` cuts them for any world size and ZeRO
stage, and `DeepSpeedReader.fill` copies from DeepSpeed's (memory-mapped) tensors instead of our
safetensors files.

What converts: DeepSpeed keeps fp32 master weights and fp32 Adam moments in every precision, and those are
what load: a bf16 (or fp32) DeepSpeed run continues as an fp32 (or bf16) run here, the working weights cast
from the masters. The global step and sample counts, client_state, the LR schedule (DeepSpeed's
`last_batch_iteration` becomes the torch scheduler's `last_epoch`), each param group's lr, betas, eps and
weight decay, and the optimizer's step count carry over; buffers come from the module state. DeepSpeed
saves no RNG state and no data-loader position, so those start fresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.checkpoint.manifest import (
    CheckpointCorrupted,
    CheckpointError,
    CheckpointIncomplete,
    CheckpointMismatch,
    CheckpointNotFound,
    FileEntry,
    GroupEntry,
    Manifest,
    ModuleKey,
    ParamEntry,
)
from runtime.checkpoint.portable import DeepSpeedTag, RecoveryError, is_deepspeed_tag
from runtime.checkpoint.reshard import Copy

__all__ = ["DeepSpeedCheckpoint", "as_checkpoint_error", "is_deepspeed_tag", "open_deepspeed"]

# the keys DeepSpeed writes into the model state file; every other top-level key is the client_state
_DEEPSPEED_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
        "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
        "ds_version", "checkpoint_parallel_dimensions", "mp_rank", "csr_tensor_module_names",
    }
)  # fmt: skip
_HYPER = ("lr", "betas", "eps", "weight_decay")
_DAMAGED_HINT = (
    "a DeepSpeed checkpoint needs its tag's model states file and every rank's *_optim_states.pt, whole: "
    "copy the folder again, or load another tag (engine.load_checkpoint(dir, tag=...))"
)


def as_checkpoint_error(error: RecoveryError) -> CheckpointError:
    """The runtime's error class for a `portable` reading error (same message)."""
    message = str(error)
    if error.kind == "not_found":
        return CheckpointNotFound(message)
    if error.kind == "incomplete":
        return CheckpointIncomplete(message)
    if error.kind == "refused":
        return CheckpointMismatch(message)
    return CheckpointCorrupted(
        message, hint=_DAMAGED_HINT if "DeepSpeed" in message or ".pt" in message else None
    )


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    tag: DeepSpeedTag
    manifest: Manifest

    def reader(self) -> DeepSpeedReader:
        return DeepSpeedReader(self.tag, {f.name: f.rank for f in self.manifest.files})

    def engine_state(self, engine: Any) -> dict[str, Any]:
        """Our engine-state dict (runtime.checkpoint.engine_state's keys) from DeepSpeed's files."""
        ms = self.tag.model_states
        module = ms.get("module") or {}
        extras = {name: module[name] for name in ms.get("buffer_names") or [] if name in module}
        try:
            extras.update(self.tag.frozen_params())
        except RecoveryError as error:
            raise as_checkpoint_error(error) from None
        gas = engine.gradient_accumulation_steps() if hasattr(engine, "gradient_accumulation_steps") else 1
        groups = self.tag.rank_state(0)["param_groups"]
        states = self.tag.rank_state(0)["states"]
        on_device = bool(
            engine.optimizer is not None
            and any(g.get("fused") or g.get("capturable") for g in engine.optimizer.param_groups)
        )
        scalars = []
        for g, state in enumerate(states):
            step = state.get("step", groups[g].get("step") if g < len(groups) else None)
            if torch.is_tensor(step):
                step = step.item()
            entry = {}
            if step is not None:
                entry["step"] = {"value": torch.tensor(float(step)), "on_param_device": on_device}
            scalars.append(entry)
        return {
            "global_steps": int(ms.get("global_steps") or 0),
            "global_samples": int(ms.get("global_samples") or 0),
            "skipped_steps": int(ms.get("skipped_steps") or 0),
            "micro_steps": int(ms.get("global_steps") or 0) * int(gas),
            "loss_scaler": self._loss_scaler(),
            "lr_scheduler": scheduler_state(engine.lr_scheduler, ms.get("lr_scheduler")),
            "optimizer_param_groups": [
                {
                    "spec": i,
                    "options": {k: tuple(v) if k == "betas" else v for k, v in g.items() if k in _HYPER},
                }
                for i, g in enumerate(groups)
            ],
            "optimizer_scalars": scalars,
            "data_position": None,
            "rng": [],
            "module_extras": extras,
            "client_state": {k: v for k, v in ms.items() if k not in _DEEPSPEED_KEYS},
            "ds_config": ms.get("ds_config"),
            "dp_world_size": self.tag.world,
        }

    def _loss_scaler(self) -> dict[str, float] | None:
        if not ((self.tag.model_states.get("ds_config") or {}).get("fp16") or {}).get("enabled"):
            return None
        raw = self.tag.rank_state(0)
        scaler = raw.get("loss_scaler")
        state = getattr(scaler, "state", None)
        return (
            {"scale": float(state["cur_scale"])} if isinstance(state, dict) and "cur_scale" in state else None
        )


def scheduler_state(scheduler: Any, saved: Any) -> Any:
    """DeepSpeed's own schedules save only `last_batch_iteration`; ours are torch schedulers counting
    `last_epoch` = last_batch_iteration + 1. A client's torch scheduler was saved by its own state_dict."""
    if scheduler is None or not isinstance(saved, dict) or set(saved) != {"last_batch_iteration"}:
        return saved
    iteration = int(saved["last_batch_iteration"])
    state = dict(scheduler.state_dict())
    state["last_epoch"] = iteration + 1
    state["_step_count"] = iteration + 2
    if hasattr(scheduler, "lrs_at"):
        state["_last_lr"] = list(scheduler.lrs_at(iteration))
    return state


class DeepSpeedReader:
    """`ShardReader`'s interface over DeepSpeed's per-rank tensors."""

    def __init__(self, tag: DeepSpeedTag, ranks: dict[str, int]) -> None:
        self.tag = tag
        self.ranks = ranks
        self.bytes_read = 0

    def fill(self, dst: torch.Tensor, copies: Sequence[Copy], key: str) -> None:
        for c in copies:
            rank = self.ranks[c.file]
            try:
                src = self.tag.tensor(rank, c.group, key)
            except RecoveryError as error:
                raise as_checkpoint_error(error) from None
            except KeyError:
                raise CheckpointCorrupted(
                    f"{self.tag.optim_files[rank]}: no optimizer state {key!r} for param group {c.group}",
                    hint=_DAMAGED_HINT,
                ) from None
            if c.src_offset + c.numel > src.numel():
                raise CheckpointCorrupted(
                    f"{self.tag.optim_files[rank]}: holds {src.numel()} elements of {key!r} for param group "
                    f"{c.group}, the layout needs {c.src_offset + c.numel}",
                    hint=_DAMAGED_HINT,
                )
            dst.narrow(0, c.dst_offset, c.numel).copy_(src.narrow(0, c.src_offset, c.numel))
            self.bytes_read += c.numel * dst.element_size()

    def close(self) -> None:
        """Nothing to close: the files are memory-mapped by torch.load."""


def open_deepspeed(tag_dir: Path) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed tag folder; a missing or damaged file is a `CheckpointCorrupted` naming it."""
    try:
        tag = DeepSpeedTag(tag_dir)
        stage = tag.zero_stage
        keys = tag.state_keys()
    except RecoveryError as error:
        raise as_checkpoint_error(error) from None
    groups = tuple(
        GroupEntry(g, fg.numel, tuple(ParamEntry(p.name, p.shape, p.offset) for p in fg.params))
        for g, fg in enumerate(tag.groups)
    )
    files = tuple(
        FileEntry(path.name, "shard", r, 0, 0, tuple(fg.ranges[r] for fg in tag.groups))
        for r, path in enumerate(tag.optim_files)
    )
    trained = {p.name for fg in tag.groups for p in fg.params}
    module = tag.model_states.get("module") or {}
    module_keys = tuple(ModuleKey(k, k if k in trained else None) for k in module)
    config = tag.model_states.get("ds_config") or {}
    dtype = "bfloat16" if (config.get("bf16") or {}).get("enabled") else "float32"
    if (config.get("fp16") or {}).get("enabled"):
        dtype = "float16"
    manifest = Manifest(
        tag=tag_dir.name,
        world_size=tag.world,
        zero_stage=stage,
        param_dtype=dtype,
        master_dtype="float32",
        groups=groups,
        files=files,
        module_keys=module_keys,
        optimizer_class=None,
        optimizer_state_keys=tuple(keys),
        state_dtypes={k: "float32" for k in keys},
    )
    return DeepSpeedCheckpoint(tag, manifest)
