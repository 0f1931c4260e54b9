"""Adam optimizers users import, under DeepSpeed's names: ``CPUAdam`` (``DeepSpeedCPUAdam``), ``FusedAdam``.

``CPUAdam`` is a ``torch.optim.Optimizer`` for parameters in CPU memory with DeepSpeedCPUAdam's constructor;
each update is ``runtime.ops.adam_step.adam_step_``, torch's fused CPU kernel run at memory bandwidth, and
its ``step`` also takes separately landed gradients and low-precision output buffers so the offload path
updates and converts in one pass. ``FusedAdam`` is DeepSpeed's GPU optimizer name mapped onto torch's
fused Adam. Why there is no kernel of our own, and how the step keeps its memory traffic at 28 B/param,
is in ``runtime.ops.adam_step``.

Threads: the step runs on torch's intra-op pool (``torch.get_num_threads()`` threads). Give each process
its own cores (``OMP_NUM_THREADS`` plus ``taskset``/``numactl`` binding); ``runtime.ops.adam_step`` says
why and by how much.

The functional core is re-exported here (``AdamHyperparams``, ``adam_step_``, ``default_chunk_elems``,
``scratch_elems``) because callers imported it from this module before it had one of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

# The private helpers are shared so that CPUAdam checks operands and picks the kernel exactly as
# adam_step_ does: the same inputs are refused with the same messages on both paths.
from runtime.ops.adam_step import (
    _KERNEL_DTYPES,
    AdamHyperparams,
    _check_flat,
    _check_grad_scale,
    _kernel,
    _resolve_chunk,
    _step_tensor,
    adam_step_,
    default_chunk_elems,
    scratch_elems,
)

__all__ = [
    "AdamHyperparams",
    "CPUAdam",
    "DeepSpeedCPUAdam",
    "FusedAdam",
    "adam_step_",
    "default_chunk_elems",
    "scratch_elems",
]


def _param_grad(p: torch.Tensor) -> torch.Tensor | None:
    if p.grad is None:
        return None
    if p.grad.is_sparse:
        raise ValueError("CPUAdam: sparse gradients are not supported")
    return p.grad if p.grad.is_contiguous() else p.grad.contiguous()


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for parameters in CPU memory, on torch's fused CPU kernel: one pass over memory a step.

    Constructor arguments are DeepSpeedCPUAdam's. ``adamw_mode`` (default True) selects decoupled weight
    decay; False is Adam with L2 weight decay. ``bias_correction`` and ``adamw_mode`` may differ per param
    group. ``fp32_optimizer_states`` keeps m and v in fp32 for bf16/fp16 parameters (the update is then
    computed in fp32 and rounded once into the parameter); False keeps them in the parameter dtype.
    ``amsgrad=True`` is refused. ``chunk_elems`` (ours, keyword-only) sets the chunk of the staged path,
    see ``adam_step_``.

    ``step()`` reads ``p.grad`` like any torch optimizer; ``step(grads=..., out=..., grad_scale=...)``
    takes the gradients as separate tensors (e.g. the flat bf16 buffer that landed from the GPU) and
    writes the updated weights to low-precision buffers in the same pass. The state
    (``step`` as a float32 tensor, ``exp_avg``, ``exp_avg_sq``) uses torch.optim.Adam's keys, so state
    dicts move between the two.

    Threads and binding: see the module docstring; the step uses ``torch.get_num_threads()`` threads.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        chunk_elems: int | None = None,
    ) -> None:
        if chunk_elems is not None and chunk_elems < 0:
            raise ValueError(f"CPUAdam: chunk_elems must be >= 0 (0 = whole tensor), got {chunk_elems}")
        self.fp32_optimizer_states = fp32_optimizer_states
        self.chunk_elems = chunk_elems
        self._scratch: torch.Tensor | None = None
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
            adamw_mode=adamw_mode,
        )
        super().__init__(model_params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        if group["amsgrad"]:
            raise ValueError(
                f"CPUAdam: amsgrad=True (param group {index}) is not supported; DeepSpeedCPUAdam would "
                "ignore it silently. For AMSGrad on CPU use "
                "torch.optim.AdamW(params, amsgrad=True, fused=True)."
            )
        AdamHyperparams.from_group(group)  # range checks, with the offending value in the message
        for i, p in enumerate(group["params"]):
            where = f"CPUAdam: param {i} of group {index}"
            if p.device.type != "cpu":
                raise ValueError(
                    f"{where} is on {p.device}; CPUAdam steps parameters in CPU memory (use FusedAdam or "
                    "torch.optim.AdamW(fused=True) for GPU parameters)"
                )
            if p.dtype not in _KERNEL_DTYPES:
                raise ValueError(f"{where} has dtype {p.dtype}; CPUAdam takes float32, bfloat16 or float16")
            if not p.is_contiguous():
                raise ValueError(f"{where} is not contiguous; call .contiguous() on it before building")

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    def _scratch_for(self, need: int, dtype: torch.dtype) -> torch.Tensor:
        # Kept across steps: a fresh multi-MiB buffer each call would be a new mmap and new page faults.
        if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=dtype)
        return self._scratch

    def _advance(self, p: torch.Tensor) -> dict[str, Any]:
        """p's state, created on first use, with its step count already advanced for this update."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(p.shape, dtype=self._state_dtype(p))
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=self._state_dtype(p))
        elif not isinstance(state["step"], torch.Tensor):  # an int step, as DeepSpeed stores it
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        state["step"] += 1
        return state

    def _update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        out: torch.Tensor | None,
        grad_scale: float | torch.Tensor | None,
    ) -> None:
        state = self._advance(p)
        m = state["exp_avg"]
        chunk = _resolve_chunk(self.chunk_elems, p.numel())
        need = scratch_elems(p.numel(), chunk, p.dtype != m.dtype, grad.dtype != m.dtype)
        adam_step_(
            p,
            grad,
            m,
            state["exp_avg_sq"],
            int(state["step"].item()),
            AdamHyperparams.from_group(group),
            out=out,
            grad_scale=grad_scale,
            chunk_elems=chunk,
            scratch=self._scratch_for(need, m.dtype) if need else None,
        )

    def _update_many(
        self,
        items: list[tuple[torch.Tensor, torch.Tensor]],
        group: dict[str, Any],
        grad_scale: float | torch.Tensor | None,
    ) -> None:
        """Parameters that need no conversion, in one kernel call: per-call overhead (~30 us in Python)
        would otherwise dominate models with hundreds of small tensors."""
        hp = AdamHyperparams.from_group(group)
        kernel, kwargs = _kernel(hp, grad_scale)
        states = [self._advance(p) for p, _ in items]
        kernel(
            [p for p, _ in items],
            [g for _, g in items],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [_step_tensor(s["step"], hp) for s in states],
            **kwargs,
        )

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grads: Sequence[torch.Tensor | None] | None = None,
        out: Sequence[torch.Tensor | None] | None = None,
        grad_scale: float | torch.Tensor | None = None,
        on_param_done: Callable[[int], None] | None = None,
    ) -> Any:
        """Update the parameters; returns the closure's loss if a closure is given.

        Plain ``step()`` reads ``p.grad`` like any torch optimizer. The offload path passes the rest:

        - ``grads[i]`` is the gradient of the i-th parameter in param-group order (with flat buffers,
          one parameter per buffer), fp32, bf16 or fp16 with the parameter's number of elements; ``None``
          skips that parameter. ``p.grad`` is then neither read nor changed.
        - ``out[i]`` (bf16, fp16 or fp32, e.g. pinned memory for the copy to the GPU) receives the i-th
          updated parameter in the same pass.
        - gradients are divided by ``grad_scale`` (loss scale / clip factor) inside the kernel; fp32
          grads are left holding the divided values.
        - ``on_param_done(i)`` runs right after parameter i and ``out[i]`` are final, while the next
          parameter is not yet touched: the place to start that buffer's non-blocking copy to the GPU so
          it overlaps the rest of the step.

        Every operand is checked before anything is updated. Going through ``step`` (not a second
        method) keeps optimizer hooks and LR schedulers working.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [(group, p) for group in self.param_groups for p in group["params"]]
        if grads is None:
            grads = [_param_grad(p) for _, p in params]
        elif len(grads) != len(params):
            raise ValueError(f"CPUAdam.step: got {len(grads)} grads for {len(params)} parameters")
        if out is not None and len(out) != len(params):
            raise ValueError(f"CPUAdam.step: got {len(out)} outputs for {len(params)} parameters")
        _check_grad_scale("CPUAdam.step", grad_scale)
        outs = out if out is not None else [None] * len(params)
        for i, ((_, p), grad, o) in enumerate(zip(params, grads, outs, strict=True)):
            if grad is None and o is not None:
                raise ValueError(f"CPUAdam.step: out[{i}] was given but parameter {i} has no gradient")
            if grad is not None:
                _check_flat("CPUAdam.step", f"grads[{i}]", grad, p.numel(), _KERNEL_DTYPES)
            if o is not None:
                _check_flat("CPUAdam.step", f"out[{i}]", o, p.numel(), _KERNEL_DTYPES)
        if out is None and on_param_done is None:
            # The plain path: batch what needs no conversion, per group; the rest one by one.
            start = 0
            for group in self.param_groups:
                batch = []
                for p, grad in zip(group["params"], grads[start : start + len(group["params"])], strict=True):
                    if grad is None:
                        continue
                    if grad.dtype == p.dtype == self._state_dtype(p):
                        batch.append((p, grad))
                    else:
                        self._update(p, grad, group, None, grad_scale)
                if batch:
                    self._update_many(batch, group, grad_scale)
                start += len(group["params"])
            return loss
        for i, ((group, p), grad, o) in enumerate(zip(params, grads, outs, strict=True)):
            if grad is not None:
                self._update(p, grad, group, o, grad_scale)
                if on_param_done is not None:
                    on_param_done(i)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict, DeepSpeedCPUAdam's, or torch.optim.Adam/AdamW's (same state keys)."""
        super().load_state_dict(state_dict)
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            # A torch Adam/AdamW group says which mode it ran in; DeepSpeed's has neither key.
            group.setdefault("adamw_mode", saved.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", True)
            if group["amsgrad"]:
                raise ValueError(
                    "CPUAdam.load_state_dict: the saved optimizer used amsgrad=True, not supported"
                )
        # torch casts loaded state to the parameter dtype, which would round fp32 m and v of bf16
        # parameters to bf16: take them from the saved tensors instead.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            saved_state = state_dict["state"].get(saved_id, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved_state:
                    value = saved_state[key].to(dtype=self._state_dtype(p), device="cpu", copy=True)
                    self.state[p][key] = value.contiguous()


DeepSpeedCPUAdam = CPUAdam


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's ``FusedAdam`` signature on torch's fused Adam (one kernel for all tensors, CUDA or CPU).

    ``adam_w_mode`` (default True) selects decoupled weight decay. ``bias_correction=False`` has no torch
    kernel and is refused; ``set_grad_none`` is accepted for compatibility (``zero_grad`` sets grads to
    None by default anyway).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        if not bias_correction:
            raise ValueError(
                "FusedAdam: bias_correction=False is not supported by torch's fused kernel; "
                "use CPUAdam (CPU parameters) or keep bias correction on"
            )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            fused=True,
            decoupled_weight_decay=adam_w_mode,
        )
