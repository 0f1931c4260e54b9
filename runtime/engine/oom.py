"""A training step out of GPU memory, said in the engine's terms.

torch's message names the allocation that failed and the allocator's totals; it does not say which phase
of which step failed, how much of the card the engine's own model states take, or which setting would
help. When the engine's forward, backward or step runs out of memory, `explained_oom` re-raises the error
as a `DeviceMemoryError`:

- the message: the phase and step, what was asked, allocated and reserved against the card's capacity, and
  the split between the engine's model states on the device and the rest (activations and temporaries);
- the hint: the settings that lower the peak, cheapest first: a smaller micro-batch with more
  accumulation (the same global batch), recomputed activations, less optimizer state on the device
  (offload, or a larger offload ratio: by how much each 0.1 frees), a higher ZeRO stage over several
  ranks, and expandable segments where the allocator's cache is fragmented.

`DeviceMemoryError` is a `UserError` (one line and the hint under dslaunch, exit code 2) and still torch's
`OutOfMemoryError` whose message starts "CUDA out of memory.": what HF Trainer's ``auto_find_batch_size``
and Accelerate's ``find_executable_batch_size`` look for before they retry with a smaller batch.
`describe` is the pure part, from `OomFacts`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime import activation_checkpointing
from runtime.engine.memory import memory_breakdown
from runtime.errors import UserError, root_cause

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

__all__ = ["DeviceMemoryError", "OomFacts", "describe", "explained_oom"]

GIB = 1 << 30
FRAGMENTED_BYTES = GIB  # reserved but not allocated beyond this: expandable segments are worth a try
_ASKED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)\b")
_UNITS = {"GiB": GIB, "MiB": 1 << 20, "KiB": 1 << 10, "B": 1}


class DeviceMemoryError(UserError, torch.OutOfMemoryError):
    """Out of GPU memory in the engine's forward, backward or step, with what to change (module docstring)."""


@dataclass(frozen=True)
class OomFacts:
    """What is known when a phase runs out of memory. Bytes; None where the device does not say."""

    phase: str  # "forward", "backward", "step", or a pipeline's "forward and backward"
    step: int  # the optimizer step being made (1-based)
    micro_step: int  # the micro-batch within it (1-based)
    accumulation: int
    micro_batch: int
    world_size: int
    stage: int
    asked: int | None  # what the failed allocation asked for (from torch's message)
    allocated: int | None
    reserved: int | None
    capacity: int | None
    device_states: int  # the engine's model states on the device (weights, gradients, masters, optimizer)
    device_optimizer: int  # of which master weights and optimizer state (what offload moves)
    offload_ratio: float | None  # offload_optimizer.ratio (None: no optimizer offload)
    ratio_was_auto: bool = False
    checkpointing: bool = False  # runtime.activation_checkpointing recomputed blocks in this process


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / GIB:.2f}"


def describe(facts: OomFacts) -> tuple[str, str]:
    """(message, hint) for `facts`: see the module docstring."""
    if facts.phase == "step":
        where = f"the update of step {facts.step}"
    else:
        where = f"the {facts.phase} of step {facts.step}"
        if facts.accumulation > 1 and facts.phase in ("forward", "backward"):  # not a pipeline's schedule
            where += f" (micro-batch {facts.micro_step} of {facts.accumulation})"
    held = f"{_gib(facts.allocated)} GiB allocated and {_gib(facts.reserved)} reserved"
    if facts.capacity is not None:
        held += f" of the card's {_gib(facts.capacity)}"
    asked = f" asked for {_gib(facts.asked)} GiB with" if facts.asked is not None else " ran out with"
    message = f"CUDA out of memory. {where[0].upper()}{where[1:]}{asked} {held}"
    states = f"the engine's model states take {_gib(facts.device_states)} GiB of the device"
    if facts.allocated is not None:
        rest = max(0, facts.allocated - facts.device_states)
        states += f", activations and temporaries the other {_gib(rest)}"
    message += f"; {states}"

    hints: list[str] = []
    if facts.micro_batch > 1:
        # the largest divisor below it: the accumulation grows by a whole factor, the global batch stays
        smaller = max(d for d in range(1, facts.micro_batch) if facts.micro_batch % d == 0)
        more = facts.accumulation * facts.micro_batch // smaller
        hints.append(
            f"train_micro_batch_size_per_gpu {facts.micro_batch} -> {smaller} with "
            f"gradient_accumulation_steps {facts.accumulation} -> {more} keeps the global batch"
        )
    if not facts.checkpointing:
        hints.append(
            "recompute activations in backward (runtime.activation_checkpointing.checkpoint around each "
            "block, or model.gradient_checkpointing_enable() for a HF model)"
        )
    if facts.device_optimizer > 0:
        if facts.offload_ratio is None:
            hints.append(
                'zero_optimization.offload_optimizer {"device": "cpu"} moves the optimizer state '
                f"({_gib(facts.device_optimizer)} GiB here) to host memory"
            )
        elif facts.offload_ratio < 1.0:
            per_tenth = facts.device_optimizer / max(1e-9, 1.0 - facts.offload_ratio) * 0.1
            chose = ' ("auto" chose it)' if facts.ratio_was_auto else ""
            hints.append(
                f"offload_optimizer.ratio {facts.offload_ratio:.2f}{chose}: each 0.1 more on the host frees "
                f"about {_gib(int(per_tenth))} GiB of the device"
            )
    if facts.world_size > 1 and facts.stage < 3:
        hints.append(
            f"zero_optimization.stage {facts.stage} -> {facts.stage + 1} shards more of the model states "
            f"over the {facts.world_size} ranks"
        )
    if facts.allocated is not None and facts.reserved is not None:
        cached = facts.reserved - facts.allocated
        if cached >= FRAGMENTED_BYTES:
            hints.append(
                f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ({_gib(cached)} GiB were reserved but not "
                "allocated: the allocator's cache is fragmented)"
            )
    hint = "lower the peak with, cheapest first: " + "; ".join(hints) if hints else ""
    return message, hint


def _asked(error: BaseException) -> int | None:
    match = _ASKED.search(str(error))
    return round(float(match[1]) * _UNITS[match[2]]) if match else None


def _facts(engine: Engine, phase: str, error: BaseException) -> OomFacts:
    device = engine.device
    allocated = reserved = capacity = None
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        capacity = torch.cuda.get_device_properties(device).total_memory
    held = memory_breakdown(engine)
    # what optimizer offload would move: the masters that are not the working weights, and the state
    tensors: list[torch.Tensor] = [g.master for g in engine.groups if not g.master_is_alias]
    for state in engine.optimizer.state.values() if engine.optimizer is not None else ():
        tensors += [t for t in state.values() if torch.is_tensor(t)]
    device_optimizer = sum(t.numel() * t.element_size() for t in tensors if t.device.type == device.type)
    offload = engine.config.zero_optimization.offload_optimizer
    accumulation = engine.gradient_accumulation_steps()
    return OomFacts(
        phase=phase,
        step=engine.global_steps + 1,
        micro_step=engine.micro_steps % accumulation + 1,
        accumulation=accumulation,
        micro_batch=engine.train_micro_batch_size_per_gpu(),
        world_size=engine.comm.world_size,
        stage=engine.zero_optimization_stage(),
        asked=_asked(error),
        allocated=allocated,
        reserved=reserved,
        capacity=capacity,
        device_states=held.device_model_state_bytes,
        device_optimizer=device_optimizer,
        offload_ratio=offload.ratio if offload.device != "none" else None,
        ratio_was_auto=engine.ratio_was_auto,
        # ours, or HF's gradient checkpointing
        checkpointing=activation_checkpointing.has_run()
        or bool(getattr(engine.module, "is_gradient_checkpointing", False)),
    )


@contextlib.contextmanager
def explained_oom(engine: Engine, phase: str) -> Iterator[None]:
    """Run a phase of `engine`'s step; an out-of-memory error in it comes out as a `DeviceMemoryError`."""
    try:
        yield
    except RuntimeError as error:  # torch's OutOfMemoryError, or a pipeline stage's wrapper around one
        cause, where = root_cause(error)
        if isinstance(cause, DeviceMemoryError) or not isinstance(cause, torch.OutOfMemoryError):
            raise
        try:
            message, hint = describe(_facts(engine, f"{phase} ({where})" if where else phase, cause))
        except Exception:  # the engine half-way through a phase: never hide torch's error behind ours
            raise error from None
        raise DeviceMemoryError(message, hint=hint) from cause
