"""What the engine reports every `steps_per_print` steps, and the optional wall-clock breakdown.

Nothing here adds a device sync to ordinary steps: losses are kept as device tensors and read once per
report (on rank 0 only), throughput is host wall time over the report window, and the
forward/backward/step timers synchronize the device only when `wall_clock_breakdown` is on. Each report
ends with this process's memory (device allocated/reserved/peak and host RSS; host RSS only on CPU).
fp16 overflows are summarized per report instead of logged one by one (users mistake a burst of
warm-up overflows for a failure); a long run of consecutive overflows gets a warning early. A bf16/fp32
step skipped for non-finite gradients is never routine: each one gets a warning that names it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from runtime import activation_checkpointing
from runtime.log import ensure_handler
from runtime.log import logger as _log
from runtime.memory import format_memory, memory_stats
from runtime.precision.loss_scaler import ScaleUpdate

_CONSECUTIVE_OVERFLOW_WARNING = 20


class Timers:
    """Accumulated wall time per phase; a no-op unless enabled (timing needs device syncs)."""

    def __init__(self, *, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.step_totals: dict[str, float] = {}  # since the last take_step_ms(), for the monitors
        self._null = contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._timed(name) if self.enabled else self._null

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            self.totals[name] = self.totals.get(name, 0.0) + elapsed
            self.counts[name] = self.counts.get(name, 0) + 1
            self.step_totals[name] = self.step_totals.get(name, 0.0) + elapsed

    def summary_ms(self) -> dict[str, float]:
        """Mean milliseconds per call of each phase since the last summary; resets."""
        out = {k: 1000.0 * v / max(self.counts[k], 1) for k, v in self.totals.items()}
        self.totals.clear()
        self.counts.clear()
        return out

    def take_step_ms(self) -> dict[str, float]:
        """Milliseconds per phase summed since the last call (one optimizer step's micro-steps); resets."""
        out = {k: 1000.0 * v for k, v in self.step_totals.items()}
        self.step_totals.clear()
        return out


class StepLog:
    """Rank 0's periodic report: step, loss, lr, loss scale, grad norm, skipped steps, samples/s.

    The loss is this step's: the mean over every rank and the step's micro-steps (one small all-reduce
    per report), the number a training script that averages over ranks prints for the same step.
    """

    def __init__(self, steps_per_print: int, *, rank: int) -> None:
        self.every = steps_per_print
        self.rank = rank
        self._losses: list[torch.Tensor] = []
        self._time = time.perf_counter()
        self._samples = 0
        self._overflows = 0
        self._consecutive = 0
        if rank == 0 and steps_per_print:
            ensure_handler()

    def start(self, engine: Any) -> None:
        self._time = time.perf_counter()
        self._samples = engine.global_samples

    def record_loss(self, loss: torch.Tensor) -> None:
        if self.every:
            self._losses.append(loss.detach())

    def wants_norm(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def overflow(self, update: ScaleUpdate, step: int) -> None:
        self._overflows += 1
        self._consecutive += 1
        if self.rank == 0 and self._consecutive == _CONSECUTIVE_OVERFLOW_WARNING:
            _log.warning(
                "step %d: %d consecutive fp16 gradient overflows (loss scale now %g); if this continues, "
                "switch to bf16 or lower the learning rate",
                step,
                self._consecutive,
                update.new_scale,
            )

    def nonfinite(
        self,
        step: int,
        norm: float,
        consecutive: int,
        limit: int,
        key: str = "bf16.max_consecutive_nonfinite_steps",
    ) -> None:
        """A bf16/fp32 step was skipped for a non-finite gradient norm (every rank calls this); `key` is the
        config key of `limit`, as this precision's messages name it."""
        self._overflows += 1
        if self.rank != 0:
            return
        stop = f"training stops at {limit}" if limit else "no limit set"
        _log.warning(
            "step %d: the global gradient norm is %s; the step was skipped on every rank (weights, optimizer "
            "state and LR schedule unchanged); %d consecutive skipped step(s), %s "
            "(%s)",
            step,
            norm,
            consecutive,
            stop,
            key,
        )

    def after_step(self, engine: Any) -> None:
        if engine.was_step_applied():
            self._consecutive = 0
        losses, self._losses = self._losses, []  # this step's micro-steps
        if not self.every or engine.global_steps % self.every != 0:
            return
        now = time.perf_counter()
        rate = (engine.global_samples - self._samples) / max(now - self._time, 1e-9)
        self._time, self._samples = now, engine.global_samples
        overflows, self._overflows = self._overflows, 0
        loss = self._mean_over_ranks(losses, engine.comm, engine.device)
        breakdown = engine._timers.summary_ms() if engine._timers.enabled else {}
        if self.rank != 0:
            return
        parts = [f"step={engine.global_steps}"]
        if loss is not None:
            parts.append(f"loss={loss:.4f}")
        parts.append("lr=[" + ", ".join(f"{lr:.3e}" for lr in engine.get_lr()) + "]")
        norm = engine.get_global_grad_norm()
        if norm is not None:
            parts.append(f"grad_norm={norm:.4f}")
        if engine.loss_scaler is not None:
            parts.append(f"loss_scale={engine.loss_scale:g}")
        parts.append(f"skipped={engine.skipped_steps} (+{overflows})")
        parts.append(f"samples/s={rate:.1f}")
        flops = engine.monitor.flops_per_sample
        if flops is not None:
            parts.append(f"tflops/gpu={flops * rate / engine.comm.world_size / 1e12:.2f}")
        parts.extend(f"{name}_ms={ms:.2f}" for name, ms in breakdown.items())
        recompute = activation_checkpointing.take_profile()
        if recompute.forward_calls:
            parts.append(f"ckpt_forward_ms/step={1000 * recompute.forward_seconds / self.every:.2f}")
            parts.append(f"ckpt_recompute_ms/step={1000 * recompute.recompute_seconds / self.every:.2f}")
        parts.append("| memory " + format_memory(memory_stats(engine.device)))
        _log.info(" ".join(parts))

    @staticmethod
    def _mean_over_ranks(losses: list[torch.Tensor], comm: Any, device: torch.device) -> float | None:
        """Every rank's losses of this step, averaged (a collective: every rank calls it)."""
        if comm.world_size == 1:
            return torch.stack([t.float() for t in losses]).mean().item() if losses else None
        total = torch.zeros(2, dtype=torch.float64, device=device)
        if losses:
            total[0] = torch.stack([t.double() for t in losses]).sum()
            total[1] = len(losses)
        comm.all_reduce(total)
        return None if total[1] == 0 else float(total[0] / total[1])
