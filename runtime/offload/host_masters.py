"""Optimizer offload (ZeRO-Offload): fp32 master shards and optimizer state in host memory.

Where the Adam step runs is update_site.py's choice. On a GPU, by default, the GPU runs it: each span's
master and moments stream up through staging slots, the fused kernel reads the gradients where the ZeRO
stage left them and writes the new working weights in place, and the state streams back (no landing
buffers, 12 host bytes a parameter, all pinned). The spans, their order, the streamed step during
backward and the publishing of updated buckets are the same as for the host step, which this docstring
describes below and which runs everywhere else (a CPU-only machine, other optimizers, offload_param, the
delayed update, `update: "host"`). The settings (settings.py) come from `offload_optimizer`.

The two can share one step (`host_share`, update_site.py): each span's head streams
through the GPU while its tail lands on the host and the CPU updates it (split_update.py routes each
part), so the step is bounded by the slower of the two halves instead of by either whole.

Per step on the host, for this rank's shard of every param group:

1. Gradients land on the host bucket by bucket (landing.py): with one rank while backward goes on, with
   more ranks after the ZeRO stage has reduced them; one copy per bucket into a pinned landing buffer.
2. The norm, the fp16 overflow check and the clipping factor come from the gradients still on the device
   (a few kernels there instead of another pass over host memory); the host reads one number.
3. The host updates span by span in landing order, chunk by chunk (host_step.py), each chunk's copy
   back to the device overlapping the next chunk's update. With more ranks, each bucket's all-gather
   starts when its pieces are back.

Streamed step (streamed.py): when gradients stream (one rank, stages 1 and 2) and the step's gradient
factor does not depend on the gradients (no clipping, no fp16 overflow check), the engine's
`prepare_step` before the boundary backward lets step 3 start during backward: the calling thread
updates each span as soon as it has landed while autograd runs on a helper thread (`run_backward`),
and `step` updates what is left. The step's hyperparameters are read when the boundary backward starts
(after the previous step's scheduler update, as always). A boundary backward that fails after the first
span was updated leaves the masters partly updated: the next boundary backward says so instead of
updating twice.

Host memory for the host step: master 4 + exp_avg 4 + exp_avg_sq 4 + landing 2 = 14 bytes a parameter of
the shard, or 16 with fp32 landing (below); only the landing buffer is pinned (and the master where it
is what gets copied back: fp32 runs and fp32 landing). The device step pins master and moments, 12
bytes a parameter, and has no landing buffer. The device keeps the working weights and the gradient
buffers of the ZeRO stage, no fp32 state. With parameter
offload (stage 3, `offload_param: {device: cpu}`) the working shard is host memory too (+2 bytes, pinned
with CUDA): the Adam kernel writes the updated bf16 weights straight into it (fp32: one host copy from
the master), and the device keeps only the gathered units and the gradient shards.

Optimizers other than Adam/AdamW (or Adam with AMSGrad, ...) take host_step.py's generic path.

Gradients in fp32 (landing.py decides; the default on a GPU when host memory allows): 16-bit gradients
are converted on the device and cross PCIe as fp32 (4 bytes a parameter each way instead of 2); the
host step is then torch's fused kernel alone, with no conversion passes, and the updated fp32 masters
go back to be converted on the device. Host memory: 16 bytes a parameter instead of 14, the master
pinned. Not with parameter offload.

Delayed parameter update (delayed.py, opt-in): step k's host update runs while the device computes
step k+1, which installs it first; every gradient is then computed on weights one update stale.

On a CPU-only machine all of this runs the same way with synchronous copies (copies.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from runtime.comm import Comm, Pending
from runtime.offload import host_adam
from runtime.offload.copies import CopyEngine, Ticket
from runtime.offload.delayed import DelayedUpdate, check_after_steps
from runtime.offload.device_step import DeviceStep
from runtime.offload.host_memory import HostMemory
from runtime.offload.host_step import HostStep
from runtime.offload.landing import GradLanding, agree_on_landing, landing_choice
from runtime.offload.placement import GradMath, scale_from_device_grads
from runtime.offload.settings import OffloadSettings
from runtime.offload.spans import Span, plan_spans
from runtime.offload.split_update import HeadTail, SplitUpdate
from runtime.offload.streamed import StreamedStep
from runtime.offload.targets import WorkingTarget
from runtime.offload.update_site import UpdateChoice, agree_on_update, update_choice
from runtime.precision.mixed import GradResult
from runtime.zero.buckets import bucket_order
from runtime.zero.flat import FlatGroup

_log = logging.getLogger("runtime.offload")


class HostMasters:
    """The offload placement, for every ZeRO stage: where the updated weights go is the stage's
    `WorkingTarget` (targets.py); the spans come from the groups' flat layouts."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        zero: Any,
        comm: Comm,
        device: torch.device,
        *,
        registration: dict[nn.Parameter, int],
        settings: OffloadSettings,
        target: WorkingTarget,
    ) -> None:
        self.groups = list(groups)
        self.zero = zero
        self.comm = comm
        self.device = device
        self.target = target
        self.chunk_elems = settings.transfer_chunk_elems
        pin_memory = settings.pin_memory
        self.memory = HostMemory(device, pin=pin_memory)
        self.copies = CopyEngine(device)
        grad_dtype = zero.grad_pieces()[0][0].dtype  # also the working weights' dtype
        master_dtype = self.groups[0].master.dtype if self.groups else torch.float32
        choice = landing_choice(
            grad_dtype,
            master_dtype,
            setting=settings.grad_transfer,
            on_gpu=self.copies.is_async,
            weights_on_host=target.on_host,
            shard_numel=sum(g.layout.shard_numel for g in self.groups),
        )
        choice = agree_on_landing(choice, grad_dtype, comm, device)
        self._landing_note = choice.reason if grad_dtype != master_dtype else None  # a real choice
        landed = choice.dtype
        # where Adam runs (update_site.py); whether the optimizer allows the device is known at `bind`
        update = update_choice(
            settings,
            device=device,
            weights_on_host=target.on_host,
            pinned=pin_memory,
            shard_numel=sum(g.layout.shard_numel for g in self.groups),
        )
        self.update: UpdateChoice = agree_on_update(update, comm, device)
        self._move_masters_to_host(landed, pin_all=self.update.on_device)
        self._landed_dtype = landed
        self._host = HostStep(
            self.groups,
            self.copies,
            self.chunk_elems,
            writes_out=landed != master_dtype,
            weights_on_host=target.on_host,
        )
        self._working_dtype = grad_dtype
        order = bucket_order(self.groups, registration)
        self.spans: list[Span] = plan_spans([g.layout for g in self.groups], order)
        self._published: list[Pending] = []
        self._last_upload: Ticket = None  # the last upload of a span the host updated
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
        # Gradients can stream during backward only when nothing is left to reduce (one rank, and not the
        # sharded stage 3, whose gradients arrive by reduce-scatter) and a copy does not block the autograd
        # thread (pinned memory on CUDA; on CPU every copy is synchronous).
        sharded = getattr(zero, "units", None) is not None
        stream = comm.world_size == 1 and not sharded and (not self.copies.is_async or self.memory.pin)
        if self.copies.is_async and not self.memory.pin and comm.rank == 0:
            _log.warning(
                "offload_optimizer.pin_memory is false: gradients and weights cross PCIe through pageable "
                "memory, which is slower and does not overlap with backward; set pin_memory: true"
            )
        self._order = order
        self._stream = stream
        self.grads = self._landing()

    def _landing(self) -> GradLanding:
        return GradLanding(
            self.groups,
            self.zero,
            self.spans,
            self._order,
            self.copies,
            self.memory,
            self._landed_dtype,
            stream=self._stream,
            chunk_elems=self.chunk_elems,
            parts=self._split.tails,
        )

    def bind(self, optimizer: torch.optim.Optimizer | None) -> None:
        """The engine built `optimizer` over the host masters: the device step needs one it can run."""
        if self._split.on_device and not host_adam.supports(optimizer):
            self._use_host_step("the optimizer is not Adam or AdamW (or uses options the fused kernel lacks)")
        if optimizer is not None:
            # the device step's downloads run past engine.step(): reading or replacing the state through
            # torch's own API (optimizer.state_dict(), load_state_dict) waits for them first
            optimizer.register_state_dict_pre_hook(lambda _optimizer: self._host_state_current())
            optimizer.register_load_state_dict_pre_hook(lambda _optimizer, _state: self._host_state_current())
        if self.comm.rank == 0 and self.copies.is_async:
            _log.info("offload: %s", self.update.reason)
            if not self._split.on_device and self._landing_note is not None:
                _log.info("offload: %s", self._landing_note)

    def _use_host_step(self, why: str) -> None:
        """From now on the host runs the step: gradients land in host buffers again. Between steps."""
        if not self._split.to_host():
            return
        self.update = UpdateChoice(False, f"the CPU runs the Adam step: {why}")
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
        if factor is None or not self.grads.stream or per_tensor or self._delayed_now():
            return
        if not host_adam.supports(optimizer):
            return
        adam = self._host_adam(optimizer)
        self._split.begin(adam, factor, self.memory)
        grad_scale = _grad_scale(factor)

        self._written = [(None, None)] * len(self.spans)

        def update(index: int) -> None:
            piece = self._working_piece(self.spans[index])
            ready = (self.grads.finals[index], self.grads.tickets[index])
            written = self._split.update(adam, grad_scale, self.grads, None, ready, index, piece)
            self._written[index] = written
            self._note_upload(written)

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
            if fast and self._delayed_now():
                self._start_delayed(optimizer, coef)
            elif fast:
                adam = self._host_adam(optimizer)
                self._split.begin(adam, coef, self.memory)
                # the device's parts: after everything queued since backward, the norm's kernels too
                mark = self.copies.mark() if self._split.on_device else None
                ready = [(mark, ticket) for ticket in self.grads.tickets]
                self._run_adam(adam, coef, None, ready, self._working_piece, publish=True)
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
        for span, written in zip(self.spans, self._written, strict=True):
            self._publish(span, written)
        self._steps += 1
        self._gradients_read()
        return result

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
        grad_scale = _grad_scale(coef)
        last: Ticket = None
        for index, span in enumerate(self.spans):
            dst = dst_of(span)
            written = self._split.update(adam, grad_scale, self.grads, landing, ready[index], index, dst)
            last = written[1] or last
            if publish:
                self._note_upload(written)
                self._publish(span, written)
        return last

    def _note_upload(self, written: HeadTail) -> None:
        """Remember the last upload of the host's updates: the copies' upload stream runs in order, so
        waiting for it covers every earlier one (the device's writes are covered by `device_wait`)."""
        if written[1] is not None:
            self._last_upload = written[1]

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

    def _start_delayed(self, optimizer: torch.optim.Optimizer, coef: float) -> None:
        adam = self._host_adam(optimizer)
        adam.begin_step()  # here, not on the worker: the scheduler changes the lr as soon as we return
        assert self._delayed is not None

        def update(
            landing: list[torch.Tensor], tickets: list[Ticket], dst_of: Callable[[Span], torch.Tensor]
        ):
            ready = [(None, ticket) for ticket in tickets]  # the host updates every span whole
            return self._run_adam(adam, coef, landing, ready, dst_of, publish=False)

        # the next backward lands in the other buffers while this update reads (and writes) these
        self.grads.buffers = self._delayed.start(update, self.grads.buffers, self.grads.tickets)

    def _install_in_flight(self) -> None:
        """Wait for the delayed update (re-raising its error) and make it the working weights."""
        if self._delayed is None or not self._delayed.pending:
            return
        self.copies.device_wait(self._delayed.wait())
        for span in self.spans:
            self._working_piece(span).copy_(self._delayed.staged(span))
            self._publish(span, (None, None))

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
            dst_of=self._working_piece,
            uploaded=self._uploaded,
        )

    def _uploaded(self, span: Span, ticket: Ticket) -> None:
        if ticket is not None:  # an empty span queues no copy: the last one still stands
            self._last_upload = ticket
        self._publish(span, (None, ticket))

    def _working_piece(self, span: Span) -> torch.Tensor:
        return self.target.piece(self.groups[span.group], span.bucket)

    def _publish(self, span: Span, written: HeadTail) -> None:
        """Publish the span's bucket (all-gather it, for stages 1 and 2) once its new weights, written
        when both tickets are done, are in place (None: they are)."""
        for ticket in written:
            self.copies.device_wait(ticket)
        pending = self.target.publish(self.groups[span.group], span.bucket)
        if pending is not None:
            self._published.append(pending)

    def write_back(self) -> None:
        self.copies.device_wait(self._last_upload)
        self._split.device_wait()
        published, self._published = self._published, []
        for pending in published:
            pending.wait()

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


def _grad_scale(factor: float) -> torch.Tensor | None:
    """What the Adam kernel divides the landed gradients by to multiply them by `factor`."""
    return None if factor == 1.0 else torch.tensor(1.0 / factor, dtype=torch.float32)
