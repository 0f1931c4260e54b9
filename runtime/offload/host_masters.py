"""Optimizer offload (ZeRO-Offload) executed: fp32 master shards and optimizer state in host memory.

`HostMasters` runs an `OffloadPlan` (plan.py): it makes no choice and reads no setting beyond the sizes
in `OffloadSettings`. It owns the wiring (host memory, copies, landing buffers, the split update, the
publisher of updated spans) and the order of a step:

1. Gradients land on the host span by span (io/landing.py): during backward when the plan streams, else
   after the ZeRO stage has reduced them. With the device step only the CPU's tails land.
2. The norm, the fp16 overflow check and the clipping factor come from the gradients still on the device
   (`runtime.precision.grad_math.scale_from_device_grads`); the host reads one number.
3. Each span is updated in landing order, its head by the GPU and its tail by the CPU (step/), and
   published (io/targets.py): with more ranks, each bucket's all-gather starts when its pieces are back.

When the step's gradient factor is known before backward, `prepare_step` lets step 3 start during the
boundary backward (step/streamed.py); when only the non-finite verdict is pending (a checked step
without clipping) and the plan allows it, it starts too, into a second copy of the state that the
verdict keeps or drops (step/speculative.py). A boundary backward that fails after the first span was
updated leaves the masters partly updated, and the next one says so instead of updating twice. The
delayed parameter update (step/delayed.py, opt-in) runs step k's host update while the device computes
step k+1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from runtime.comm import Comm
from runtime.config.offload import OffloadSettings
from runtime.host_memory import HostMemory
from runtime.offload.io.copies import CopyEngine, Ticket
from runtime.offload.io.landing import GradLanding
from runtime.offload.io.spans import Span
from runtime.offload.io.targets import Publisher, WorkingTarget
from runtime.offload.plan import OffloadPlan, UpdateChoice
from runtime.offload.step import host_adam
from runtime.offload.step.delayed import DelayedUpdate, Update, check_after_steps
from runtime.offload.step.device_step import DeviceStep
from runtime.offload.step.host_step import HostStep
from runtime.offload.step.speculative import Shadow, undo_working
from runtime.offload.step.split_update import HeadTail, SplitUpdate
from runtime.offload.step.streamed import StreamedStep
from runtime.precision.grad_math import GradMath, GradResult, scale_from_device_grads
from runtime.zero import StageGroups
from runtime.zero.flat import FlatGroup

_log = logging.getLogger("runtime.offload")


class HostMasters:
    """The offload placement, for every ZeRO stage: where the updated weights go is the stage's
    `WorkingTarget` (io/targets.py); what lands, where each span is updated and whether gradients stream
    is the `plan`'s."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        zero: StageGroups,
        comm: Comm,
        device: torch.device,
        *,
        plan: OffloadPlan,
        settings: OffloadSettings,
        target: WorkingTarget,
    ) -> None:
        self.groups = list(groups)
        self.zero = zero
        self.comm = comm
        self.device = device
        self.target = target
        self.plan = plan
        self.chunk_elems = settings.transfer_chunk_elems
        self.memory = HostMemory(device, pin=plan.pin)
        self.copies = CopyEngine(device)
        grad_dtype = zero.grad_pieces()[0][0].dtype  # also the working weights' dtype
        master_dtype = self.groups[0].master.dtype if self.groups else torch.float32
        self._landing_note = plan.landing.reason if grad_dtype != master_dtype else None  # a real choice
        landed = plan.landing.dtype
        self.update: UpdateChoice = plan.update  # whether the optimizer allows the device: known at `bind`
        self._move_masters_to_host(landed, pin_all=self.update.on_device)
        self._host = HostStep(
            self.groups,
            self.copies,
            self.chunk_elems,
            writes_out=landed != master_dtype,
            weights_on_host=target.on_host,
        )
        self._working_dtype = grad_dtype
        self.spans: list[Span] = list(plan.spans)
        self.publisher = Publisher(self.groups, target, self.copies)
        # each span's head, which the GPU updates, and its tail, which the CPU updates
        device_step = None
        if self.update.on_device:
            chunk, slots = settings.device_chunk_elems, settings.device_slots
            device_step = DeviceStep(device, master_dtype, chunk_elems=chunk, slots=slots)
        self._split = SplitUpdate(self.groups, self.spans, self._host, device_step, self.update.host_share)
        self._written: list[HeadTail] = []  # the streamed step's, per span
        self._adam: host_adam.HostAdam | None = None
        self._adam_for: torch.optim.Optimizer | None = None
        self._steps = 0  # host updates started
        self._delayed: DelayedUpdate | None = None  # set by delay_updates
        self._streamed: StreamedStep | None = None  # the streamed step of the backward in progress
        self._shadow: Shadow | None = None  # a speculative step's second copy of the state, once made
        self._speculate = plan.speculate  # taken back where the CPU takes over the step (unless forced)
        self._speculate_forced = settings.speculate is True
        self.grads = self._landing()

    def _landing(self) -> GradLanding:
        return GradLanding(
            self.groups,
            self.zero,
            self.spans,
            self.plan.order,
            self.copies,
            self.memory,
            self.plan.landing.dtype,
            stream=self.plan.stream,
            chunk_elems=self.chunk_elems,
            parts=self._split.tails,
        )

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The engine built `optimizer` over the host masters: the device step needs one it can run."""
        if self._split.on_device and not host_adam.supports(optimizer):
            why = "the optimizer is not Adam or AdamW (or uses options the fused kernel lacks)"
            if getattr(optimizer, "runs_own_update", False):  # runtime.precision.MasterAdam
                why = "bf16 master weights: their Adam (stochastic rounding, bf16 moments) is its own step"
            self._use_host_step(why)
        if optimizer is not None:
            # the device step's downloads run past engine.step(): reading or replacing the state through
            # torch's own API (optimizer.state_dict(), load_state_dict) waits for them first
            optimizer.register_state_dict_pre_hook(lambda _optimizer: self._host_state_current())
            optimizer.register_load_state_dict_pre_hook(lambda _optimizer, _state: self._host_state_current())
        if self.comm.rank == 0 and self.copies.is_async:
            _log.info("offload: %s", self.update.reason)
            if not self._split.on_device and self._landing_note is not None:
                _log.info("offload: %s", self._landing_note)
        if self.comm.rank == 0 and self.plan.stream and self.plan.speculation:
            _log.info("offload: %s", self.plan.speculation)

    def _use_host_step(self, why: str) -> None:
        """From now on the host runs the step: gradients land in host buffers again. Between steps."""
        if not self._split.to_host():
            return
        self.update = UpdateChoice(False, f"the CPU runs the Adam step: {why}")
        self._speculate = self._speculate_forced  # plan.plan_speculation: not for the CPU's step
        self.grads.close()
        self.grads = self._landing()

    def _host_state_current(self) -> None:
        """Wait until the host copies of master and moments are current (no collective: any rank may)."""
        self._split.host_ready()

    @property
    def update_on_device(self) -> bool:
        return self._split.on_device

    def _move_masters_to_host(self, landed: torch.dtype, *, pin_all: bool) -> None:
        for group in self.groups:
            master = group.master.detach()
            # pinned where a copy engine reads it: with fp32 landing the weights are copied back from the
            # master itself, and the device step streams it both ways
            pinned = pin_all or master.dtype == landed
            host = self.memory.empty(master.numel(), master.dtype, pinned=pinned)
            host.copy_(master)
            group.master = nn.Parameter(host, requires_grad=True)
            group.master_is_alias = False

    # -- landing gradients ------------------------------------------------------------------------------
    def prepare_step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> None:
        """Start a streamed step when this boundary backward allows one (see the module docstring)."""
        if self._streamed is not None:
            if self._streamed.updated:
                raise RuntimeError(
                    "engine.backward ran at the gradient accumulation boundary again before engine.step(): "
                    "the offloaded optimizer had already started updating the weights from the earlier "
                    "backward (which may have failed part-way), so they are partly updated. Reload the last "
                    "checkpoint, and call engine.step() after every boundary backward"
                )
            self._streamed.adam.cancel_step()  # that backward failed before any gradient landed
            self._streamed = None
        factor = math.factor_before_backward
        speculative = factor is None and self._speculate  # the verdict keeps or drops the update
        if speculative:
            factor = math.factor_before_verdict
        if factor is None or not self.grads.stream or per_tensor or self._delayed_now():
            return
        if not host_adam.supports(optimizer):
            return
        adam = self._host_adam(optimizer)
        adam.shadow = None
        self._split.begin(adam, factor, self.memory)  # (the device step pins moments a load left pageable)
        if speculative:
            adam.shadow = self._shadow_for(adam)
        grad_scale = host_adam.grad_scale(factor)

        self._written = [(None, None)] * len(self.spans)

        def update(index: int) -> None:
            piece = self.publisher.piece(self.spans[index])
            ready = (self.grads.finals[index], self.grads.tickets[index])
            written = self._split.update(adam, grad_scale, self.grads, None, ready, index, piece)
            self._written[index] = written
            self.publisher.note_upload(written)

        # the device step only queues work: the caller's cores need room for autograd's thread only
        # where the CPU updates part of the spans
        spare = self.copies.is_async and self._split.host_works
        self._streamed = StreamedStep(adam, factor, update, spare_core=spare)
        self.grads.on_landed = self._streamed.landed

    def run_backward(self, backward: Callable[[], None]) -> None:
        """Run autograd; during a streamed step, with this thread updating spans as they land."""
        if self._streamed is None:
            backward()
        else:
            self._streamed.run_backward(backward)

    def begin_backward(self, *, boundary: bool) -> None:
        self.grads.begin(boundary=boundary)

    def end_backward(self, *, boundary: bool) -> None:
        self.grads.end(boundary=boundary)

    # -- the step ---------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, math: GradMath, *, per_tensor: bool) -> GradResult:
        pieces = self.zero.grad_pieces()
        if self._streamed is not None:
            return self._finish_streamed(pieces, math)
        if self._split.on_device and (per_tensor or not host_adam.supports(optimizer)):
            self._use_host_step("the optimizer changed to one the device step cannot run")
        if not any(self.grads.landed):  # no boundary backward went through begin/end_backward
            self.grads.prepare()
        self.grads.land_all()
        result, coef = scale_from_device_grads(pieces, math)
        self._install_in_flight()  # DPU: the update the last step started becomes the working weights
        if not result.overflow:
            # device weights may still be read by kernels queued before this point
            self.copies.fence_uploads()
            fast = not per_tensor and host_adam.supports(optimizer)
            delayed = self._delayed if self._delayed_now() else None
            if delayed is not None and fast:
                self._start_delayed(self._adam_update(optimizer, coef))
            elif delayed is not None and delayed.takes(optimizer, per_tensor):
                self._start_delayed(self._host.own_update(optimizer, coef, self.spans))
            elif fast:
                adam = self._host_adam(optimizer)
                self._split.begin(adam, coef, self.memory)
                # the device's parts: after everything queued since backward, the norm's kernels too
                mark = self.copies.mark() if self._split.on_device else None
                ready = [(mark, ticket) for ticket in self.grads.tickets]
                self._run_adam(adam, coef, None, ready, self.publisher.piece, publish=True)
            else:
                self._generic_step(optimizer, coef, per_tensor=per_tensor)
            self._steps += 1
        self._gradients_read()
        return result

    def _gradients_read(self) -> None:
        """The stage may zero its gradient buffers next: not before the copies (or the device step) have
        read them."""
        self.copies.downloads_done()
        self._split.device_wait()
        self.grads.done()

    def _finish_streamed(self, pieces: Sequence[Sequence[torch.Tensor]], math: GradMath) -> GradResult:
        self.grads.land_all()  # spans end_backward did not land (it always does, through the engine)
        result, coef = scale_from_device_grads(pieces, math)
        streamed = self._streamed
        assert streamed is not None
        if coef != streamed.factor:
            raise RuntimeError(
                f"offload: the step's gradient factor {coef} differs from {streamed.factor}, the one the "
                "update started with during backward (the gradient arithmetic changed in between)"
            )
        streamed.drain()
        assert streamed.updated == len(self.spans), (streamed.updated, len(self.spans))
        self._streamed = None
        self.grads.on_landed = None
        if streamed.adam.shadow is not None and result.overflow:  # speculative.py: dropped
            self._drop_speculative(streamed.adam)
            self._gradients_read()
            return result
        if streamed.adam.shadow is not None:
            streamed.adam.commit_shadow()
        for span, written in zip(self.spans, self._written, strict=True):
            self.publisher.publish(span, written)
        self._steps += 1
        self._gradients_read()
        return result

    def _shadow_for(self, adam: host_adam.HostAdam) -> Shadow:
        if self._shadow is None:  # made at the first speculative step: unchecked runs never pay for it
            groups = range(len(self.groups))

            def empty_like(t: torch.Tensor) -> torch.Tensor:  # pinned where a copy engine reads or writes it
                streams = self._split.on_device and self.copies.is_async
                return self.memory.empty(t.numel(), t.dtype, pinned=streams or self.memory.is_pinned(t))

            self._shadow = Shadow([adam.written(group) for group in groups], empty_like)
        return self._shadow

    def _drop_speculative(self, adam: host_adam.HostAdam) -> None:
        """A non-finite verdict after a speculative update: the state is as it was, the step counts go
        back, and the working weights are written again from the masters, after the update's writes."""
        adam.cancel_step()
        self._split.device_wait()
        self.copies.fence_uploads()
        masters = [group.master.data for group in self.groups]
        undo_working(self.spans, masters, self.publisher, self.copies, self.chunk_elems)
        self.write_back()  # the engine writes back applied steps only

    def _delayed_now(self) -> bool:
        return self._delayed is not None and self._delayed.due(self._steps)

    def _host_adam(self, optimizer: torch.optim.Optimizer) -> host_adam.HostAdam:
        if self._adam is None or self._adam_for is not optimizer:
            # pinned only for the device step, which streams them: the CPU step never copies them, and
            # the largest models need that host memory unpinned
            pinned = self._split.on_device and self.copies.is_async
            self._adam = host_adam.HostAdam(
                optimizer,
                [g.master for g in self.groups],
                zeros=lambda numel, dtype: self.memory.zeros(numel, dtype, pinned=pinned),
            )
            self._adam_for = optimizer
        return self._adam

    def _run_adam(
        self,
        adam: host_adam.HostAdam,
        coef: float,
        landing: list[torch.Tensor] | None,
        ready: Sequence[HeadTail],
        dst_of: Callable[[Span], torch.Tensor],
        *,
        publish: bool,
    ) -> Ticket:
        """Update every span in landing order from `landing` (None: this step's landing buffers) once
        `ready` (per span: its landing, its gradients final on the device) is done, each span's uploads
        started as its chunks are done; returns the last upload's ticket. Runs on the worker thread
        under DPU, where the host updates every span."""
        grad_scale = host_adam.grad_scale(coef)
        last: Ticket = None
        for index, span in enumerate(self.spans):
            dst = dst_of(span)
            written = self._split.update(adam, grad_scale, self.grads, landing, ready[index], index, dst)
            last = written[1] or last
            if publish:
                self.publisher.note_upload(written)
                self.publisher.publish(span, written)
        return last

    # -- delayed parameter update ---------------------------------------------------------------------
    def delay_updates(self, after_steps: int) -> None:
        """Turn on the delayed parameter update once `after_steps` steps have run (delayed.py)."""
        if self._streamed is not None:
            raise RuntimeError(
                "enable_delayed_update was called between engine.backward at the accumulation boundary and "
                "engine.step(); call it before the boundary backward or after the step"
            )
        self.flush()
        self._use_host_step("the delayed parameter update runs it on a host thread")
        if self._delayed is None:
            self._delayed = DelayedUpdate(
                after_steps, self.grads.buffers, self.groups, self.memory, self._working_dtype
            )
        else:
            self._delayed.after_steps = check_after_steps(after_steps)

    def _adam_update(self, optimizer: torch.optim.Optimizer, coef: float) -> Update:
        """The one-pass Adam step of every span, as the delayed update runs it on its worker."""
        adam = self._host_adam(optimizer)
        adam.begin_step()  # here, not on the worker: the scheduler changes the lr as soon as we return

        def update(
            landing: list[torch.Tensor], tickets: list[Ticket], dst_of: Callable[[Span], torch.Tensor]
        ) -> Ticket:
            ready = [(None, ticket) for ticket in tickets]  # the host updates every span whole
            return self._run_adam(adam, coef, landing, ready, dst_of, publish=False)

        return update

    def _start_delayed(self, update: Update) -> None:
        assert self._delayed is not None
        # the next backward lands in the other buffers while this update reads (and writes) these
        self.grads.buffers = self._delayed.start(update, self.grads.buffers, self.grads.tickets)

    def _install_in_flight(self) -> None:
        """DPU: the update the last step started becomes the working weights (step/delayed.py)."""
        if self._delayed is not None:
            self._delayed.install(self.copies, self.spans, self.publisher)

    def flush(self) -> None:
        """Finish everything in flight: the masters, the optimizer state and the working weights agree."""
        self._install_in_flight()
        if self._streamed is not None:  # between a boundary backward and its step
            self._streamed.drain()
        self._split.host_ready()
        self.write_back()

    def _generic_step(self, optimizer: torch.optim.Optimizer, coef: float, *, per_tensor: bool) -> None:
        self._host.generic(
            optimizer,
            coef,
            per_tensor=per_tensor,
            landing=self.grads.buffers,
            tickets=self.grads.tickets,
            spans=self.spans,
            dst_of=self.publisher.piece,
            uploaded=self.publisher.uploaded,
        )

    def write_back(self) -> None:
        self.publisher.wait_uploads()
        self._split.device_wait()
        self.publisher.wait_published()

    # -- bookkeeping ------------------------------------------------------------------------------------
    def host_bytes(self, optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
        state = 0
        if optimizer is not None:  # this placement's groups only (partial offload keeps others on the device)
            for group in self.groups:
                for param in optimizer.param_groups[group.index]["params"]:
                    values = optimizer.state.get(param, {}).values()
                    state += sum(t.numel() * t.element_size() for t in values if torch.is_tensor(t))
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups)
        masters += self.target.host_bytes()  # offloaded working-weight shards (offload_param)
        buffers = self.grads.host_bytes()
        if self._delayed is not None:
            buffers += self._delayed.host_bytes()
        buffers += self._host.host_bytes()
        if self._shadow is not None:
            buffers += self._shadow.host_bytes()
        return masters + state, buffers

    def device_buffer_bytes(self) -> int:
        return self._split.staging_bytes()

    def close(self) -> None:
        self.flush()
        if self._delayed is not None:
            self._delayed.close()
        self.grads.close()
        self.copies.downloads_done()
        if self.copies.is_async:
            torch.cuda.synchronize(self.device)
        self.memory.close()
