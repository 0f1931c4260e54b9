"""ZeRO stages 0 and 1: every rank keeps the full gradient buffer.

Each parameter's `.grad` is a view into one flat gradient buffer per group (in the working dtype), so
autograd accumulates micro-steps in place and nothing is copied. On the micro-step that ends an
accumulation window, a bucket's collective is launched from the post-accumulate-grad hook of its last
parameter while backward keeps running (DDP-style overlap):

- stage 0 (data parallel): all-reduce the bucket; every rank then steps the full fp32 master copy.
- stage 1 (optimizer state sharded): reduce-scatter the bucket in place, so rank r's piece holds the
  summed gradient it needs; rank r steps only its master shard and the updated weights are all-gathered.

With one rank there is nothing to communicate: no hooks are registered and stages 0, 1 and 2 all run
this code (the shard is the whole buffer), which keeps the single-GPU step as lean as plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runtime.comm import Comm
from runtime.zero.common import HookedStage, InFlight, StageOptions, gather_working
from runtime.zero.flat import FlatGroup


class GradientViewsReplaced(RuntimeError):
    """A parameter's .grad no longer points into the engine's gradient buffer."""


class ReplicatedGradStage(HookedStage):
    """Stages 0 and 1 (and any stage at world size 1)."""

    def __init__(self, stage: int, groups: Sequence[FlatGroup], comm: Comm, options: StageOptions) -> None:
        super().__init__(groups, comm, options)
        self.stage = stage
        # an engine without an optimizer keeps no gradient buffer (its backward is refused)
        trained = self.groups if options.trains else []
        self.grads = [torch.zeros_like(group.working) for group in trained]
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for group, grad in zip(trained, self.grads, strict=True):
            for param, slot in zip(group.params, group.layout.slots, strict=True):
                view = grad.narrow(0, slot.offset, slot.numel).view(param.shape)
                param.grad = view
                self._views.append((param, view))
        self._reducing = False
        self._communicates = comm.world_size > 1 and options.trains
        if self._communicates and self.overlap_comm:
            self._register_hooks()

    @property
    def grads_are_sharded(self) -> bool:
        return self.stage >= 1 and self.comm.world_size > 1

    def begin_backward(self, *, boundary: bool) -> None:
        self.check_owned("backward")
        self._restore_cleared_views()
        self._reducing = boundary and self._communicates
        if self._reducing:
            self.tracker.reset()

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._reducing:
            self.tracker.mark(param)

    def end_backward(self, *, boundary: bool) -> None:
        if self._reducing:
            self.tracker.flush()
            self._finish_all()
        self._reducing = False

    def _launch(self, group: FlatGroup, bucket_index: int) -> None:
        bucket = group.layout.buckets[bucket_index]
        data = group.bucket_view(self.grads[group.index], bucket)
        wire = self._prepare_for_reduce(data, group)
        if self.stage == 0:
            pending = self.comm.all_reduce(wire, async_op=True)
            after = None if wire is data else (lambda: data.copy_(wire))
        else:
            out = wire.narrow(0, self.comm.rank * bucket.piece_numel, bucket.piece_numel)
            pending = self.comm.reduce_scatter(out, wire, async_op=True)
            mine = group.piece(self.grads[group.index], bucket)
            after = None if wire is data else (lambda: mine.copy_(out))
        self._track(InFlight(pending, wire, after))

    def grad_pieces(self) -> list[list[torch.Tensor]]:
        """This rank's reduced gradients per group, in shard order."""
        self.check_owned("step")
        self.check_grad_views()
        if self.stage == 0 or self.comm.world_size == 1:
            return [[grad] for grad in self.grads]
        return [
            [group.piece(grad, bucket) for bucket in group.layout.buckets]
            for group, grad in zip(self.groups, self.grads, strict=True)
        ]

    def _restore_cleared_views(self) -> None:
        """A `.grad` set to None outside the engine before a backward (`model.zero_grad()`, which Lightning
        calls after `initialize`) means "cleared": the parameter gets its zeroed view back, so the backward
        accumulates into the engine's buffer instead of a tensor of autograd's own. Cleared between a
        backward and the step, the gradients it held are gone: `check_grad_views` refuses that step."""
        for param, view in self._views:
            if param.grad is None:
                view.zero_()
                param.grad = view

    def check_grad_views(self) -> None:
        for param, view in self._views:
            if param.grad is not view:
                raise GradientViewsReplaced(
                    f"a parameter's .grad (shape {tuple(param.shape)}) was replaced or set to None "
                    "outside the engine (model.zero_grad() or a torch optimizer's zero_grad on the "
                    "model's parameters?); "
                    "the engine accumulates gradients in its own buffers: call engine.zero_grad() instead"
                )

    def write_back(self) -> None:
        if self.stage == 0 or self.comm.world_size == 1:
            for group in self.groups:
                group.copy_master_to_working()
        else:
            gather_working(self.groups, self.comm)

    def _free_grads(self) -> None:
        self.grads = [grad.new_empty(0) for grad in self.grads]
        self._views = []  # the parameters' .grad are the new engine's now

    def zero_grad(self) -> None:
        for grad in self.grads:
            grad.zero_()

    def grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads)

    def buffer_bytes(self) -> int:
        return 0
