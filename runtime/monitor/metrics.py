"""The training metrics the engine hands to the monitors at every accumulation boundary.

Owns the event names (DeepSpeed's where DeepSpeed has one) and when values are read. Events of a step all
carry the number of samples trained so far (``engine.global_samples`` after the step) as their step:

    Train/Samples/train_loss        mean of rank 0's micro-step losses in the step
    Train/Samples/lr                learning rate of the first param group
    Train/Samples/loss_scale        fp16 only
    Train/Samples/grad_norm         global gradient norm before clipping
    Train/Samples/samples_per_sec   train_batch_size / wall time of the step (whole job)
    Train/Samples/tflops_per_gpu    model FLOPs per sample x samples/s / GPUs, when FLOPs are known
    Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}
                                    wall_clock_breakdown only; summed over the step's micro-steps
    Train/Samples/elapsed_time_ms_{optimizer_step,write_back}
                                    parts of step: the optimizer (on the host under offload, with the
                                    copies back it overlaps) and the updated weights' way back to the
                                    model (offload copies, all-gathers)
    Train/Samples/memory_{allocated,reserved,peak}_gib   CUDA only
    Train/Samples/host_rss_gib

Model FLOPs per sample come from ``engine.monitor.set_flops_per_sample(flops)``, or from a model (or its
``config``) with a ``flops_per_token(seq_len)`` method, such as runtime.models.GPT, times the sequence length
of the first input (a 2-D tensor of token ids). They count the model's work only (6N + attention), not
the recomputation of activation checkpointing, so TFLOP/s compare with published MFU figures.

Only rank 0 writes. Loss and gradient norm stay device tensors until the monitors are flushed (every
``steps_per_print`` steps, at ``engine.destroy()`` and at interpreter exit), so monitoring adds no device
sync to ordinary steps. Every rank knows whether monitors are on: the engine then computes the gradient
norm on every step, which for sharded gradients is a collective that all ranks must join.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runtime.memory import GIB, memory_stats
from runtime.monitor.writers import Event, EventWriter, open_writers

if TYPE_CHECKING:  # annotations only: the engine imports this package
    from runtime.config import Config
    from runtime.engine import Engine

__all__ = ["PREFIX", "TrainingMonitor"]

PREFIX = "Train/Samples/"
_TIMERS = (
    "forward",
    "backward",
    "backward_inner",
    "backward_allreduce",
    "step",
    "optimizer_step",
    "write_back",
)


def _flops_per_token_of(model: nn.Module | None) -> Callable[[int], float] | None:
    for holder in (model, getattr(model, "config", None)):
        fn = getattr(holder, "flops_per_token", None)
        if callable(fn):
            return fn
    return None


class TrainingMonitor:
    """Collects one step's metrics on rank 0 and writes them to the configured monitors."""

    def __init__(
        self,
        writers: Sequence[EventWriter],
        *,
        configured: bool,
        world_size: int,
        device: torch.device,
        flush_every: int = 10,
        model: nn.Module | None = None,
    ) -> None:
        self.writers = list(writers)
        self.configured = configured  # the same on every rank
        self.world_size = world_size
        self.device = device
        self.flush_every = max(1, flush_every)
        self.flops_per_sample: float | None = None
        self.last_step_seconds: float | None = None
        self._flops_per_token = _flops_per_token_of(model)
        self._losses: list[torch.Tensor] = []
        self._pending: list[tuple[str, float | torch.Tensor, int]] = []
        self._pending_steps = 0
        self._last_time: float | None = None
        self._created = time.perf_counter()
        if self.writers:
            # flush what is buffered when the script ends without engine.destroy()
            self._exit_hook = _weak_flush(self)
            atexit.register(self._exit_hook)

    @classmethod
    def from_config(
        cls, config: Config, *, rank: int, world_size: int, device: torch.device, model: nn.Module | None
    ) -> TrainingMonitor:
        configured = config.csv_monitor.enabled or config.tensorboard.enabled or config.wandb.enabled
        return cls(
            open_writers(config, rank=rank),
            configured=configured,
            world_size=world_size,
            device=device,
            flush_every=config.steps_per_print or 10,
            model=model,
        )

    @property
    def enabled(self) -> bool:
        """True on the rank that writes (rank 0 with a monitor configured)."""
        return bool(self.writers)

    @property
    def wants_norm(self) -> bool:
        return self.configured

    def set_flops_per_sample(self, flops: float) -> None:
        """Model FLOPs (forward + backward) of one sample, for TFLOP/s."""
        if not flops > 0:
            raise ValueError(f"flops per sample must be positive, got {flops!r}")
        self.flops_per_sample = float(flops)

    # -- called by the engine ------------------------------------------------------------------------
    def observe_inputs(self, inputs: tuple[Any, ...]) -> None:
        if self._last_time is None:
            self._last_time = time.perf_counter()  # the first step's time starts at its first forward
        if self.flops_per_sample is None and self._flops_per_token is not None and inputs:
            first = inputs[0]
            if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
                seq_len = int(first.shape[1])
                self.flops_per_sample = float(self._flops_per_token(seq_len)) * seq_len

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.writers:
            self._losses.append(loss.detach())

    def after_step(self, engine: Engine) -> None:
        now = time.perf_counter()
        elapsed = max(now - (self._last_time if self._last_time is not None else self._created), 1e-9)
        self._last_time = now
        self.last_step_seconds = elapsed
        timings = engine._timers.take_step_ms() if engine._timers.enabled else {}
        if not self.writers:
            self._losses.clear()
            return
        step = engine.global_samples
        events: list[tuple[str, float | torch.Tensor, int]] = []
        if self._losses:
            losses, self._losses = self._losses, []
            events.append((PREFIX + "train_loss", torch.stack([t.float() for t in losses]).mean(), step))
        lrs = engine.get_lr()
        if lrs:
            events.append((PREFIX + "lr", float(lrs[0]), step))
        if engine.loss_scaler is not None:
            events.append((PREFIX + "loss_scale", float(engine.loss_scale), step))
        norm = engine._grad_norm  # a device tensor: read at flush time, not now
        if norm is not None:
            events.append((PREFIX + "grad_norm", norm.detach(), step))
        rate = engine.train_batch_size() / elapsed
        events.append((PREFIX + "samples_per_sec", rate, step))
        if self.flops_per_sample is not None:
            tflops = self.flops_per_sample * rate / self.world_size / 1e12
            events.append((PREFIX + "tflops_per_gpu", tflops, step))
        for name in _TIMERS:
            if name in timings:
                events.append((PREFIX + f"elapsed_time_ms_{name}", timings[name], step))
        memory = memory_stats(self.device)
        if memory.device is not None:
            events.append((PREFIX + "memory_allocated_gib", memory.device.allocated / GIB, step))
            events.append((PREFIX + "memory_reserved_gib", memory.device.reserved / GIB, step))
            events.append((PREFIX + "memory_peak_gib", memory.device.peak_allocated / GIB, step))
        events.append((PREFIX + "host_rss_gib", memory.host_rss / GIB, step))
        self._pending.extend(events)
        self._pending_steps += 1
        if self._pending_steps >= self.flush_every:
            self.flush()

    # -- output ---------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the buffered events (reads the buffered device values: one sync)."""
        pending, self._pending, self._pending_steps = self._pending, [], 0
        if not pending or not self.writers:
            return
        events: list[Event] = [
            (name, float(value) if isinstance(value, torch.Tensor) else value, step)
            for name, value, step in pending
        ]
        for writer in self.writers:
            writer.write(events)
            writer.flush()

    def close(self) -> None:
        """Flush and close the monitors (engine.destroy() calls it)."""
        if not self.writers:
            return
        self.flush()
        for writer in self.writers:
            writer.close()
        self.writers = []
        atexit.unregister(self._exit_hook)


def _weak_flush(monitor: TrainingMonitor) -> Callable[[], None]:
    ref = weakref.ref(monitor)

    def flush() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return flush
