"""The small, non-sharded part of a checkpoint: counters, loss scaler, LR schedule, RNG, data position,
optimizer hyperparameters and scalar state, module buffers and frozen parameters, and the client's state.

Rank 0 writes it with torch.save into the engine state file; every rank reads it back with
``torch.load(weights_only=True)``, which unpickles only tensors and plain containers and numbers. So
everything stored here must be such a value: `check_loadable` walks it at save time and names the
first key that is not (a client_state holding an arbitrary object fails the save, not the resume).

For DeepSpeed's tools the file also holds the client's keys at its top level, as DeepSpeed's model-states
file does, and `deepspeed_descriptor` is what each rank's `*_optim_states.pt` holds (stage, partition count).
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from runtime.checkpoint.manifest import CheckpointError, CheckpointMismatch, shard_file_name

_log = logging.getLogger("runtime.checkpoint")

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def check_loadable(value: Any, where: str) -> None:
    """Raise when `value` would not load under torch.load(weights_only=True)."""
    if isinstance(value, (*_PLAIN, torch.Tensor)):
        return
    if isinstance(value, (dict, OrderedDict)):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, type(None), tuple)):
                raise CheckpointError(f"{where}: key {key!r} of type {type(key).__name__} cannot be saved")
            check_loadable(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple, set)):
        for i, item in enumerate(value):
            check_loadable(item, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints store only "
        "tensors, numbers, strings, None and lists/tuples/dicts of them (they load with "
        "torch.load(weights_only=True), so loading can never run code)"
    )


# -- RNG --------------------------------------------------------------------------------------------------
class RngStreams(Protocol):
    """The named random streams an engine keeps besides the generators (`engine.rng_tracker`:
    runtime.parallel.rng's model-parallel tracker); a checkpoint saves and restores them."""

    def get_states(self) -> dict[str, torch.Tensor]: ...

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None: ...


def capture_rng(device: torch.device, streams_of: RngStreams) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    streams = streams_of.get_states()  # the model-parallel random streams, when seeded
    if streams:
        state["streams"] = streams
    try:
        import numpy as np

        legacy = np.random.get_state(legacy=True)
        assert isinstance(legacy, tuple)  # the global generator is MT19937: its legacy 5-tuple
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = (
            kind,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    except ImportError:  # numpy is optional
        pass
    return state


def restore_rng(state: Mapping[str, Any], device: torch.device, streams_of: RngStreams) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if "streams" in state:
        streams_of.set_states(dict(state["streams"]))
    if "numpy" in state:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
        except ImportError:
            pass


# -- module extras ----------------------------------------------------------------------------------------
def module_keys(engine: Any) -> list[tuple[str, str | None]]:
    """(state-dict key, managed parameter name or None for an extra), in state-dict order."""
    managed = {
        id(p): name for g in engine.groups for p, name in zip(g.params, param_names(engine, g), strict=True)
    }
    return [(key, managed.get(id(value))) for key, value in engine.module.state_dict(keep_vars=True).items()]


def spec_index(group: Any) -> int:
    """The user's param group a flat group came from (stage 3 splits one into a flat group per unit)."""
    return int(getattr(group, "spec_index", group.index))


def param_names(engine: Any, group: Any) -> list[str]:
    """The names of a flat group's parameters (from the group, else looked up in the module)."""
    if getattr(group, "param_names", None):
        return list(group.param_names)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [names[id(p)] for p in group.params]


def module_extras(engine: Any) -> dict[str, Any]:
    """State-dict entries the flat groups do not hold: buffers, frozen parameters, extra state.
    (keep_vars: the trained parameters are not touched, ZeRO-3 keeps them sharded.)"""
    full = engine.module.state_dict(keep_vars=True)
    # the keys exclude_frozen_parameters leaves out
    left_out: frozenset[str] = getattr(engine, "checkpoint_excluded_keys", frozenset())
    extras = {key: full[key] for key, name in module_keys(engine) if name is None and key not in left_out}
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in extras.items()}


def check_module_extras(
    engine: Any, extras: Mapping[str, Any], *, strict: bool, in_groups: frozenset[str] = frozenset()
) -> list[str]:
    """The extras to load; raises on a mismatch (strict: missing or unexpected keys; always: shapes).
    `in_groups`: extras this engine keeps in its flat groups (a frozen parameter that a ZeRO-3 inference
    engine shards, saved whole by a training engine); the caller loads those into the groups."""
    wanted = {key for key, name in module_keys(engine) if name is None}
    missing = sorted(wanted - set(extras))
    unexpected = sorted(set(extras) - wanted - in_groups)
    if strict and (missing or unexpected):
        raise CheckpointMismatch(
            "module buffers/frozen parameters differ from the checkpoint: "
            + "; ".join(
                part
                for part in (
                    f"missing in the checkpoint: {', '.join(missing)}" if missing else "",
                    f"not in the model: {', '.join(unexpected)}" if unexpected else "",
                )
                if part
            )
        )
    current = engine.module.state_dict(keep_vars=True)
    for key in sorted(wanted & set(extras)):
        value, have = extras[key], current[key]
        if isinstance(have, torch.Tensor) and isinstance(value, torch.Tensor) and have.shape != value.shape:
            raise CheckpointMismatch(
                f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(have.shape)} in the model"
            )
    return sorted(wanted & set(extras))


def restore_module_extras(engine: Any, extras: Mapping[str, Any], keys: list[str]) -> None:
    engine.module.load_state_dict({k: extras[k] for k in keys}, strict=False)


# -- the whole engine state -------------------------------------------------------------------------------
def capture(
    engine: Any, *, client_state: Mapping[str, Any], rng_states: list[Any], optimizer_scalars: list[Any]
) -> dict[str, Any]:
    """Everything rank 0 writes into the engine state file."""
    optimizer = engine.optimizer
    loader: Any = getattr(engine, "training_dataloader", None)  # any loader; ours can resume (state_dict)
    state = {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "lr_scheduler": _scheduler_state(engine.lr_scheduler),
        "optimizer_param_groups": _optimizer_groups(engine) if optimizer is not None else None,
        "optimizer_scalars": optimizer_scalars,
        "data_position": loader.state_dict() if hasattr(loader, "load_state_dict") else None,
        "rng": rng_states,
        "module_extras": module_extras(engine),
        "client_state": dict(client_state),
        "ds_config": engine.config.to_dict(),
        "dp_world_size": engine.comm.world_size,
    }
    for key, value in state.items():
        check_loadable(value, "client_state" if key == "client_state" else f"engine state {key!r}")
    # DeepSpeed's model-states file holds the client's keys at its top level, and tools read them there
    # (Lightning's convert_zero_checkpoint_to_fp32_state_dict keeps every key that is not DeepSpeed's).
    # The same objects: pickle's memo writes each value once, so this costs references, not a copy. A
    # client key named like one of ours stays only under "client_state" (ours is not overwritten).
    state.update({k: v for k, v in client_state.items() if isinstance(k, str) and k not in state})
    return state


def deepspeed_optim_name(rank: int) -> str:
    """DeepSpeed's name for rank `rank`'s optimizer file; ours holds only `deepspeed_descriptor`."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def deepspeed_descriptor(engine: Any, rank: int) -> dict[str, Any]:
    """What a DeepSpeed tool reads first from rank `rank`'s `*_optim_states.pt`: the ZeRO stage and
    partition count (Lightning's convert_zero_checkpoint_to_fp32_state_dict reads
    ["optimizer_state_dict"]["zero_stage"]). Our optimizer state itself is in that rank's
    `.safetensors` shard, which the manifest lists and checksums; this file holds no tensors."""
    return {
        "optimizer_state_dict": {
            "zero_stage": engine.zero_stage,
            "partition_count": engine.comm.world_size,
            "dslaunch_shard": shard_file_name(rank),
        },
        "dp_world_size": engine.comm.world_size,
        "ds_config": engine.config.to_dict(),
    }


def _optimizer_groups(engine: Any) -> list[dict[str, Any]]:
    """Each optimizer param group's hyperparameters, with the user param group it belongs to."""
    spec_of = {group.index: spec_index(group) for group in engine.groups}
    return [
        {"spec": spec_of.get(i, i), "options": {k: v for k, v in g.items() if k != "params"}}
        for i, g in enumerate(engine.optimizer.param_groups)
    ]


def optimizer_group_options(engine: Any, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The saved hyperparameters (lr, betas, weight decay, ...) for each current optimizer param group,
    matched by user param group, so a checkpoint whose stage grouped the optimizer differently (stage 3:
    a group per gather unit) still maps; raises when a group has no saved counterpart."""
    by_spec: dict[int, dict[str, Any]] = {}
    for entry in saved:
        by_spec.setdefault(int(entry["spec"]), dict(entry["options"]))
    spec_of = {group.index: spec_index(group) for group in engine.groups}
    out = []
    for i in range(len(engine.optimizer.param_groups)):
        spec = spec_of.get(i, i)
        if spec not in by_spec:
            raise CheckpointMismatch(
                f"the checkpoint's optimizer has param groups {sorted(by_spec)}; this one also has "
                f"group {spec}"
            )
        out.append(by_spec[spec])
    return out


def regroup_scheduler_state(
    engine: Any, scheduler_state: dict[str, Any], saved_groups: Any
) -> dict[str, Any]:
    """An LR scheduler's state with its per-param-group lists (base_lrs, _last_lr, our schedules' min/max
    lrs: every top-level list as long as the saved optimizer's group list) re-indexed for this
    optimizer's groups, matched by user param group. Unchanged when the grouping is the same."""
    if not saved_groups or engine.optimizer is None:
        return scheduler_state
    saved_specs = [int(entry["spec"]) for entry in saved_groups]
    spec_of = {group.index: spec_index(group) for group in engine.groups}
    current = [spec_of.get(i, i) for i in range(len(engine.optimizer.param_groups))]
    if saved_specs == current:
        return scheduler_state
    first: dict[int, int] = {}
    for i, spec in enumerate(saved_specs):
        first.setdefault(spec, i)
    missing = sorted(set(current) - set(first))
    if missing:
        raise CheckpointMismatch(f"the checkpoint's LR scheduler has no param group {missing[0]}")
    pick = [first[spec] for spec in current]
    return {
        key: type(value)(value[j] for j in pick)
        if isinstance(value, (list, tuple)) and len(value) == len(saved_specs)
        else value
        for key, value in scheduler_state.items()
    }


def _scheduler_state(scheduler: Any) -> Any:
    if scheduler is None or not hasattr(scheduler, "state_dict"):
        return None
    return scheduler.state_dict()


def restore(
    engine: Any,
    state: Mapping[str, Any],
    *,
    saved_world: int,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> None:
    """Put the engine's non-sharded state back (the shards are loaded separately)."""
    if load_module_only:
        return
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.skipped_steps = int(state["skipped_steps"])
    engine.micro_steps = int(state["micro_steps"])
    _restore_scaler(engine, state.get("loss_scaler"))
    if load_optimizer_states and engine.optimizer is not None and state.get("optimizer_param_groups"):
        options = optimizer_group_options(engine, state["optimizer_param_groups"])
        for group, saved in zip(engine.optimizer.param_groups, options, strict=True):
            group.update(saved)
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        saved_scheduler = state.get("lr_scheduler")
        if saved_scheduler is None:
            _log.warning("the checkpoint has no LR scheduler state; the scheduler starts from its beginning")
        else:
            saved_groups = state.get("optimizer_param_groups")
            scheduler = engine.lr_scheduler
            scheduler.load_state_dict(regroup_scheduler_state(engine, dict(saved_scheduler), saved_groups))
            if not load_optimizer_states and hasattr(scheduler, "get_last_lr"):
                # the next step runs with the schedule's current lr, not the fresh optimizer's
                for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                    group["lr"] = lr
                if hasattr(scheduler, "after_lr_update"):
                    scheduler.after_lr_update()
    loader: Any = getattr(engine, "training_dataloader", None)  # any loader; ours can resume (state_dict)
    position = state.get("data_position")
    if position is not None and hasattr(loader, "load_state_dict"):
        loader.load_state_dict(dict(position))
    rngs = state.get("rng") or []
    if saved_world == engine.comm.world_size and engine.comm.rank < len(rngs):
        restore_rng(rngs[engine.comm.rank], engine.device, engine.rng_tracker)
    elif rngs and engine.comm.rank == 0:  # none saved (a DeepSpeed checkpoint): nothing to warn about
        _log.warning(
            "RNG states were saved by %d ranks and are not restored on %d ranks (each rank keeps its own)",
            saved_world,
            engine.comm.world_size,
        )


def _restore_scaler(engine: Any, saved: Any) -> None:
    scaler = engine.loss_scaler
    if scaler is None or saved is None:
        if (scaler is None) != (saved is None) and engine.comm.rank == 0:
            _log.warning(
                "the checkpoint %s an fp16 loss scaler and this run %s; the scale starts fresh",
                "has" if saved is not None else "has no",
                "uses one" if scaler is not None else "does not",
            )
        return
    if "hysteresis_left" in saved and not getattr(scaler, "dynamic", False):
        scaler.load_state_dict({"scale": saved["scale"]})
        return
    if getattr(scaler, "dynamic", False) and "hysteresis_left" not in saved:
        scaler.scale = float(saved["scale"])
        return
    scaler.load_state_dict(dict(saved))
