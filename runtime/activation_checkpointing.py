"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``), on torch.utils.checkpoint.

``checkpoint(function, *args)`` runs ``function`` without keeping its intermediate activations; backward
recomputes them. It is torch's non-reentrant checkpoint (``use_reentrant=False``, ``preserve_rng_state``):
the recomputation replays the CPU and device RNG state of the forward, so dropout draws the same masks and
the gradients equal those of a run without checkpointing, and parameters used inside receive their
gradients (and the ZeRO gradient hooks fire) exactly as without it.

A stack of checkpointed blocks keeps only each block's *inputs* for backward. What this module adds to
torch is where those inputs are kept, set by ``configure()`` or by the config's
``"activation_checkpointing"`` section (``runtime.initialize`` applies it unless ``configure()`` was
called first):

- ``partition_activations``: with model parallelism the ranks of a model-parallel group hold identical
  copies of a block's input; each keeps 1/mp of it and the pieces are all-gathered before recomputation.
  With pure data parallelism (no ``mpu``, or a model-parallel group of one rank) it does nothing: data
  parallel ranks hold different activations, so there is nothing to split.
- ``cpu_checkpointing``: inputs are copied to pinned host memory on a side stream during the forward and
  back for recomputation, each one prefetched while the block after it runs its backward
  (runtime.sequence.host_stash). No effect when the model runs on the CPU. ``hf_checkpointing(model)``
  routes a HF model's gradient-checkpointed layers through ``checkpoint``, so these options apply there.
- ``contiguous_memory_optimization``: inputs are copied into ``number_checkpoints`` preallocated slots of
  one buffer per (size, dtype, device), so a long run's saved inputs do not fragment the allocator. A slot
  is free again once autograd drops the saved input (after backward); more live inputs than slots is an
  error that names the setting.
- ``synchronize_checkpoint_boundary``: synchronize the device before and after each checkpointed forward.
- ``profile``: time every checkpointed forward and every recomputation (``take_profile()``; the engine's
  periodic log shows the times per step).

How it works: torch's checkpoint saves the region's inputs as ordinary saved tensors before it installs its
own saved-tensor hooks for the region, so hooks installed around the call see exactly those inputs and
nothing else (inside the region torch's hooks take precedence).

Model parallelism: ``configure(mpu_)`` names the model-parallel unit (an engine built with
``initialize(mpu=...)`` supplies its own when configure named none). The named random streams of
``get_cuda_rng_tracker()`` (runtime.parallel.rng) are replayed like the default generator: a
recomputation starts from the streams' states at the forward, so dropout inside ``fork()`` draws the
forward's masks too, and the streams continue afterwards from where the whole forward left them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from runtime.activation_inputs import InputSlots, PackedInput
from runtime.comm import Comm
from runtime.config import ActivationCheckpointingConfig, Config, ConfigError
from runtime.parallel.mpu import model_parallel_names
from runtime.parallel.rng import (
    CudaRNGStatesTracker,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    set_default_mpu,
)
from runtime.sequence.host_stash import HostStash

__all__ = [
    "CheckpointSettings",
    "CheckpointStats",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "configured_mpu",
    "get_cuda_rng_tracker",
    "hf_checkpointing",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "release_engine_mpu",
    "reset",
    "settings",
    "take_profile",
    "use_engine_mpu",
]

_log = logging.getLogger("runtime.activation_checkpointing")


# The settings are the config section itself: the same fields, whether they come from a config file or
# from configure(...) arguments.
CheckpointSettings = ActivationCheckpointingConfig


@dataclass
class CheckpointStats:
    """Counters since the last ``take_profile()``. Times only with ``profile``; the bytes of the inputs
    kept for backward (where they ended up, after partitioning) whenever inputs are kept by this module
    (partition_activations, cpu_checkpointing or contiguous_memory_optimization in effect)."""

    forward_calls: int = 0
    forward_seconds: float = 0.0
    recompute_calls: int = 0
    recompute_seconds: float = 0.0
    device_bytes_kept: int = 0
    host_bytes_kept: int = 0


@dataclass
class _State:
    settings: CheckpointSettings = field(default_factory=CheckpointSettings)
    configured: bool = False
    mpu: Any = None
    mpu_from_engine: bool = False  # the mpu is an engine's (use_engine_mpu), not configure()'s
    partition: Comm | None = None  # the model-parallel group's collectives, when partitioning applies
    arena: InputSlots | None = None
    stats: CheckpointStats = field(default_factory=CheckpointStats)
    depth: int = 0  # > 0 while a checkpointed forward or a recomputation runs (nested calls)
    stash: HostStash = field(default_factory=HostStash)  # cpu_checkpointing's host copies
    ran: bool = False  # a checkpointed forward has run in this process (the engine's memory advice reads it)


_state = _State()


# ---------------------------------------------------------------------------------------------------------
# Configuration


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> CheckpointSettings:
    """Set how ``checkpoint`` keeps inputs, like ``deepspeed.checkpointing.configure``.

    Args:
        mpu_: a model-parallel unit (Megatron style: ``get_model_parallel_group()``,
            ``get_model_parallel_world_size()``, ``get_model_parallel_rank()``, or the
            ``get_tensor_model_parallel_*`` names); used by ``partition_activations`` and by
            ``model_parallel_cuda_manual_seed`` (its model-parallel rank).
        deepspeed_config: the config (a dict, a .json/.yaml path, a ``runtime.config.Config`` or its
            ``ActivationCheckpointingConfig``) whose ``activation_checkpointing`` section is the base.
        partition_activations, contiguous_checkpointing, num_checkpoints, checkpoint_in_cpu, synchronize,
            profile: override the section's ``partition_activations``, ``contiguous_memory_optimization``,
            ``number_checkpoints``, ``cpu_checkpointing``, ``synchronize_checkpoint_boundary`` and
            ``profile`` when not None.

    Returns:
        The settings now in force.
    """
    base = _settings_from(deepspeed_config)
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    chosen = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    _check(chosen)
    _state.settings = chosen
    _state.mpu = mpu_
    _state.mpu_from_engine = False
    set_default_mpu(mpu_)
    group = _partition_group(mpu_) if chosen.partition_activations else None
    _state.partition = Comm(group) if group is not None else None
    _state.arena = InputSlots(chosen.number_checkpoints) if chosen.contiguous_memory_optimization else None
    _state.stats = CheckpointStats()
    _state.configured = True
    return chosen


def apply_engine_config(config: Config) -> None:
    """What ``runtime.initialize`` calls: the config's section, unless ``configure()`` already ran."""
    if not _state.configured:
        configure(deepspeed_config=config.activation_checkpointing)


def use_engine_mpu(mpu: Any) -> None:
    """What an engine with model-parallel groups calls (``initialize(mpu=...)``, a pipeline's grid): its mpu
    serves checkpointing, the model-parallel seed and ``deepspeed.utils.groups`` while it lives, unless
    ``configure(mpu_=...)`` named one; the latest engine's wins over an earlier engine's."""
    if mpu is None or (_state.mpu is not None and not _state.mpu_from_engine):
        return
    _state.mpu = mpu
    _state.mpu_from_engine = True
    set_default_mpu(mpu)
    group = _partition_group(mpu) if _state.settings.partition_activations else None
    _state.partition = Comm(group) if group is not None else None


def release_engine_mpu(mpu: Any) -> None:
    """What ``engine.destroy()`` calls: the engine's mpu stops serving, if it is still the one in use (an
    mpu that ``configure(mpu_=...)`` named stays)."""
    if mpu is None or _state.mpu is not mpu or not _state.mpu_from_engine:
        return
    _state.mpu = None
    _state.mpu_from_engine = False
    set_default_mpu(None)
    _state.partition = None


def configured_mpu() -> Any:
    """The model-parallel unit checkpointing uses (None: pure data parallelism)."""
    return _state.mpu


def is_configured() -> bool:
    """True once ``configure()`` (or ``runtime.initialize``) has set the checkpointing options."""
    return _state.configured


def has_run() -> bool:
    """True once a checkpointed forward has run in this process."""
    return _state.ran


def settings() -> CheckpointSettings:
    """The settings ``checkpoint`` uses now (the defaults until configured)."""
    return _state.settings


def reset() -> None:
    """Release the contiguous buffers (DeepSpeed's ``reset``); the configuration stays.

    Call it after forward passes whose graphs were dropped without backward (evaluation under grad mode)
    if you want the slots' memory back at once; inputs still saved keep their old buffer alive.
    """
    if _state.arena is not None:
        _state.arena = InputSlots(_state.settings.number_checkpoints)


def take_profile() -> CheckpointStats:
    """Profile counters since the last call (all zero unless ``profile`` is on); resets them."""
    stats, _state.stats = _state.stats, CheckpointStats()
    return stats


def _settings_from(source: Any) -> CheckpointSettings:
    if source is None:
        return CheckpointSettings()
    if isinstance(source, ActivationCheckpointingConfig):
        return source
    if isinstance(source, Config):
        return source.activation_checkpointing
    from runtime.config.reader import ReadContext, SectionReader, read_config_file
    from runtime.config.sections import read_activation_checkpointing

    data = read_config_file(source) if not isinstance(source, Mapping) else source
    ctx = ReadContext()
    section = read_activation_checkpointing(
        SectionReader(data.get("activation_checkpointing"), "activation_checkpointing", ctx)
    )
    ctx.raise_pending()
    return section


def _check(chosen: CheckpointSettings) -> None:
    if chosen.number_checkpoints is not None and (
        isinstance(chosen.number_checkpoints, bool)
        or not isinstance(chosen.number_checkpoints, int)
        or chosen.number_checkpoints < 1
    ):
        raise ConfigError(
            "activation_checkpointing.number_checkpoints",
            f"expected a positive integer, got {chosen.number_checkpoints!r}",
        )
    if chosen.contiguous_memory_optimization and chosen.number_checkpoints is None:
        raise ConfigError(
            "activation_checkpointing.contiguous_memory_optimization",
            "needs number_checkpoints (how many checkpointed inputs are alive at once, usually the number "
            "of checkpointed blocks); set it too",
        )


def _partition_group(mpu: Any) -> Any:
    """The model-parallel group to split inputs over, or None when there is none to split over."""
    if mpu is None:
        return None
    group_name, size_name, _ = names = model_parallel_names(mpu)
    for name in names:
        if not callable(getattr(mpu, name, None)):
            raise TypeError(
                f"configure(mpu_=...): the mpu object ({type(mpu).__name__}) has no {name}(); pass a "
                "Megatron-style model-parallel unit, or None for pure data parallelism"
            )
    return getattr(mpu, group_name)() if getattr(mpu, size_name)() > 1 else None


# ---------------------------------------------------------------------------------------------------------
# Where inputs are kept


def _pack(tensor: torch.Tensor) -> Any:
    if isinstance(tensor, nn.Parameter) or not tensor.is_floating_point() or tensor.numel() == 0:
        # weights and index tensors are not activations, and an empty tensor (some torch versions save
        # one as a placeholder) holds nothing: keep them as they are, out of the contiguous slots
        return tensor
    chosen, comm = _state.settings, _state.partition
    packed = PackedInput(tensor.shape, tensor.device, tensor.numel())
    data = tensor.detach().reshape(-1)
    if comm is not None:
        world, rank = comm.world_size, comm.rank
        chunk = -(-data.numel() // world)
        if chunk * world != data.numel():
            data = torch.nn.functional.pad(data, (0, chunk * world - data.numel()))
        data = data.narrow(0, rank * chunk, chunk).clone()  # a copy, so the full input can be freed
        packed.comm = comm
    if chosen.cpu_checkpointing and data.device.type != "cpu":
        # to pinned host memory on the stash's own stream, prefetched back one block ahead in backward;
        # not into the contiguous slots, which guard the device allocator, not the host's
        packed.stashed = _state.stash.put(data)
        _state.stats.host_bytes_kept += data.numel() * data.element_size()
        return packed
    if _state.arena is not None:
        data = _state.arena.store(data, packed)
    _state.stats.device_bytes_kept += data.numel() * data.element_size()
    if data.data_ptr() == tensor.data_ptr() and packed.comm is None:
        return tensor  # nothing to change: keep the tensor itself (no copy)
    packed.data = data
    return packed


def _unpack(packed: Any) -> torch.Tensor:
    if not isinstance(packed, PackedInput):
        return packed
    if packed.stashed is not None:
        data = _state.stash.take(packed.stashed)
    else:
        assert packed.data is not None  # a packed input is either stashed on the host or kept here
        data = packed.data.to(packed.device, non_blocking=True)
    comm = packed.comm
    if comm is not None:
        full = torch.empty(data.numel() * comm.world_size, dtype=data.dtype, device=data.device)
        comm.all_gather(full, data)
        data = full.narrow(0, 0, packed.numel)
    return data.view(packed.shape)


def _keeps_inputs_differently() -> bool:
    chosen = _state.settings
    return chosen.cpu_checkpointing or chosen.contiguous_memory_optimization or _state.partition is not None


# ---------------------------------------------------------------------------------------------------------
# The checkpoint call


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class _Recomputation:
    """The context torch enters around a recomputation: marks it as running (nested checkpoints then skip
    the input hooks) and times it when profiling. Reusable: retain_graph can recompute a region twice."""

    def __init__(self, timed: bool, device: torch.device | None, streams: dict[str, torch.Tensor]) -> None:
        self.timed = timed
        self.device = device
        self.start = 0.0
        self.streams = streams  # the tracker's states when the forward ran
        self.after: list[dict[str, torch.Tensor]] = []  # the states to return to (a stack: reusable)

    def __enter__(self) -> None:
        _state.depth += 1
        self.start = time.perf_counter()
        if self.streams:
            tracker = get_cuda_rng_tracker()
            self.after.append(tracker.get_states())
            tracker.set_states(self.streams)

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1
        if self.streams:
            get_cuda_rng_tracker().set_states(self.after.pop())
        if self.timed:
            # torch stops a recomputation early (by raising) once it has what backward needs: time it too
            _sync(self.device)
            _state.stats.recompute_calls += 1
            _state.stats.recompute_seconds += time.perf_counter() - self.start


def _first_device(args: tuple[Any, ...]) -> torch.device | None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return None


# Dynamo skips this frame only (not what it calls): in a compiled model the graph breaks here cleanly and
# the checkpointed block's own compiled forward still runs (runtime.compile), instead of dynamo tracing
# this function's bookkeeping (timers, the RNG tracker) and leaving the block eager.
@torch.compiler.disable(recursive=False)
def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` and recompute its activations in backward instead of keeping them.

    Same results as calling ``function`` directly, dropout included (the RNG state and the tracker's
    streams are replayed). Call modules through ``module.__call__`` (pass the module itself as
    ``function``) so that hooks such as ZeRO-3's parameter gathering also run during the recomputation.
    """
    chosen = _state.settings
    device = _first_device(args)
    outer = _state.depth == 0
    _state.ran = True
    streams = get_cuda_rng_tracker().get_states()  # the model-parallel streams, replayed like the RNG

    def contexts() -> tuple[Any, Any]:
        return contextlib.nullcontext(), _Recomputation(chosen.profile and outer, device, streams)

    sync = chosen.synchronize_checkpoint_boundary or chosen.profile
    if sync:
        _sync(device)
    start = time.perf_counter()
    hooks = (
        torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        if outer and torch.is_grad_enabled() and _keeps_inputs_differently()
        else contextlib.nullcontext()
    )
    _state.depth += 1
    try:
        with hooks:
            out = torch_checkpoint.checkpoint(
                function,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=contexts,
                **kwargs,
            )
    finally:
        _state.depth -= 1
    if sync:
        _sync(device)
    if chosen.profile and outer:
        _state.stats.forward_calls += 1
        _state.stats.forward_seconds += time.perf_counter() - start
    return out


def hf_checkpointing(model: nn.Module) -> nn.Module:
    """Turn on a Hugging Face model's gradient checkpointing with ``checkpoint`` (this module's, so the
    ``activation_checkpointing`` options, ``cpu_checkpointing`` included, apply) instead of torch's."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # type: ignore[operator]  # a HF model's method, which nn.Module's attribute type does not know
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint  # HF's attribute
    return model
