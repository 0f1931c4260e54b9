"""One rank, 16-bit weights, masters on the device: the gradients stay autograd's own tensors.

With one rank nothing is reduced, so the flat gradient buffer of `ReplicatedGradStage` only costs: autograd
hands each gradient over as a tensor of its own, which `AccumulateGrad` then adds into the buffer's view
(6 bytes a parameter moved: two read, one written, two bytes each) after the buffer was zeroed (two more),
and a compiled backward returns every gradient at once, so the buffer and the graph's outputs are both
whole at the backward's peak (2 bytes a parameter more than plain PyTorch holds). Here `param.grad` is
whatever autograd made, taken over without a copy, accumulated in place by autograd over micro-steps and
dropped by `zero_grad`, as in a plain PyTorch loop.

`grad_pieces` still tiles each group's master in order, as the optimizer's placement reads it
(runtime/offload/placement.py): each parameter's gradient flattened, and zeros for the layout's padding
and for a parameter that got no gradient. The fused step (precision/fused_master.py) then updates the
master straight from autograd's tensors where one holds at least 16M elements, and from runs of smaller
neighbours joined into one buffer otherwise; torch's step casts the pieces into its fp32 buffer as it did
from the flat one.

The default where it applies: `build_zero_stage` takes it for one rank with 16-bit working weights and
the optimizer on the device (optimizer offload streams gradients out of the flat buffer as they land);
`DSLAUNCH_AUTOGRAD_GRADS=0` keeps the flat buffer there too. Measured on an H100 against the flat buffer,
the fused step launching on runs of 16M elements (precision/fused_master.py `plan_runs`; one launch a
tensor had cost GPT-2 XL's 580 tensors 63 ms a step against 18): GPT-2 XL at 1.047x a compiled plain loop
against 1.040x, its peak 2.9 GiB lower; the 3.2B Llama at ZeRO-2 1.030x against 1.025x and at ZeRO-3
1.021x against 1.006x, its peak 69.9 GiB against 75.9 (BENCHMARKS.md, issue 33).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from runtime.comm import Comm
from runtime.zero.common import HookedStage, StageOptions
from runtime.zero.flat import FlatGroup
from runtime.zero.replicated import GradientViewsReplaced

_ENV = "DSLAUNCH_AUTOGRAD_GRADS"


def autograd_grads_on() -> bool:
    """Whether one rank keeps autograd's gradient tensors where it can: unset or 1 yes (the default), 0
    keeps the flat buffer."""
    text = os.environ.get(_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{_ENV}={text!r}: expected 0 or 1")
    return text != "0"


class AutogradGradStage(HookedStage):
    """Stages 0-3 at one rank whose gradients are autograd's own tensors (module docstring)."""

    grads_are_sharded = False

    def __init__(self, stage: int, groups: Sequence[FlatGroup], comm: Comm, options: StageOptions) -> None:
        if comm.world_size != 1 or not options.trains:
            raise ValueError("AutogradGradStage: one rank of an engine that trains")
        super().__init__(groups, comm, options)
        self.stage = stage
        for group in self.groups:
            for param in group.params:
                param.grad = None  # whatever a loop before the engine left; never the engine's gradient
        # the gradients the last backward left, by parameter: told apart from a .grad cleared before the step
        self._after_backward: list[list[torch.Tensor | None]] | None = None
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _launch(self, group: FlatGroup, bucket: int) -> None:
        raise AssertionError("one rank reduces nothing")

    def _on_grad(self, param: nn.Parameter) -> None:
        raise AssertionError("one rank registers no gradient hooks")

    def begin_backward(self, *, boundary: bool) -> None:
        self.check_owned("backward")

    def end_backward(self, *, boundary: bool) -> None:
        self._after_backward = [[param.grad for param in group.params] for group in self.groups]

    def grad_pieces(self) -> list[list[torch.Tensor]]:
        """Each group's gradients tiling its master: parameters in layout order, zeros between them."""
        self.check_owned("step")
        self._check_not_cleared()
        out = []
        for group in self.groups:
            pieces, offset = [], 0
            for param, slot in zip(group.params, group.layout.slots, strict=True):
                if slot.offset > offset:
                    pieces.append(self._zeros_of(slot.offset - offset, group.working))
                grad = param.grad
                pieces.append(self._zeros_of(slot.numel, group.working) if grad is None else grad.reshape(-1))
                offset = slot.offset + slot.numel
            if group.layout.numel > offset:
                pieces.append(self._zeros_of(group.layout.numel - offset, group.working))
            out.append(pieces)
        return out

    def _zeros_of(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """`numel` zeros in `like`'s dtype and device: read only, so one buffer serves every request."""
        key = (like.dtype, like.device)
        zeros = self._zeros.get(key)
        if zeros is None or zeros.numel() < numel:
            zeros = self._zeros[key] = torch.zeros(numel, dtype=like.dtype, device=like.device)
        return zeros[:numel]

    def _check_not_cleared(self) -> None:
        """A gradient the backward made that is gone before the step was cleared outside the engine (a
        torch optimizer's zero_grad, model.zero_grad()): refused, as the flat buffer's stage refuses it."""
        if self._after_backward is None:
            return
        for group, grads in zip(self.groups, self._after_backward, strict=True):
            for param, grad in zip(group.params, grads, strict=True):
                if grad is not None and param.grad is None:
                    raise GradientViewsReplaced(
                        f"a parameter's .grad (shape {tuple(param.shape)}) was set to None between the "
                        "backward and the step (model.zero_grad() or a torch optimizer's zero_grad on the "
                        "model's parameters?), so the step would lose its gradient; call "
                        "engine.zero_grad() instead, after the step"
                    )

    def write_back(self) -> None:
        for group in self.groups:
            group.copy_master_to_working()

    def zero_grad(self) -> None:
        for group in self.groups:
            for param in group.params:
                param.grad = None
        self._after_backward = None

    def _free_grads(self) -> None:
        self._after_backward = None  # the parameters' .grad are the new engine's now
        self._zeros.clear()

    def grad_bytes(self) -> int:
        """What the gradients take once a backward made them (autograd's tensors, in the working dtype)."""
        return sum(group.param_numel * group.working.element_size() for group in self.groups)

    def buffer_bytes(self) -> int:
        return 0
