"""Adam/AdamW on CPU at memory bandwidth, for fp32 master weights and the CPU-offload path.

Owns ``CPUAdam`` (alias ``DeepSpeedCPUAdam``, DeepSpeed's constructor signature), the functional core
``adam_step_`` that the offload engine calls on its flat buffers, and ``FusedAdam`` (DeepSpeed's GPU
optimizer name, mapped onto torch's fused Adam).

Why no kernel of our own: torch's fused CPU Adam/AdamW kernel (``torch._fused_adamw_``,
``torch._fused_adam_``) already reads p, g, m, v once and writes p, m, v once, vectorized and spread over
torch's intra-op threads. It runs as fast as DeepSpeed's C++ CPUAdam (2 cores: same speed at 50M-200M
params) and on a 16-core host reached 4.4 G params/s, about 125 GB/s counted at 28 B/param, the machine's
copy bandwidth (research/cpu_adam_bench.md, perf_anchors.md §4, §6). An Adam step costs 15-20 flop per
param, so memory traffic sets the step time; the only thing left to win is traffic outside the kernel.

The offload step therefore avoids extra passes over DRAM:

- bf16/fp16 gradients (what lands from the GPU) are converted chunk by chunk into a small fp32 scratch
  that stays in cache, instead of into a full-size fp32 temporary (a new 4 B/param buffer every step:
  one more write and read of 4 B/param plus its page faults; 1.1-1.6x slower on the 2-core dev box);
- the low-precision copy of the updated weights (what goes back to the GPU) is written per chunk right
  after the kernel updated that chunk, while it is still in cache, instead of re-reading all of p;
- a gradient scale (loss scale divided by the clipping factor) is applied inside the kernel.

Traffic per param with fp32 p/m/v: bf16 grad in, bf16 weights out: 2 + 12 + 12 + 2 = 28 B, the same as a
plain fp32 step (scripts/bench/cpu_adam.py measures it).

Threads: every kernel and copy here runs on torch's intra-op pool, ``torch.get_num_threads()`` threads.
Give each process its own cores (``OMP_NUM_THREADS`` = its core count, plus ``taskset``/``numactl`` binding,
one NUMA node per process when possible): ranks whose thread teams share cores slow each other down
several times over, and binding alone was worth 1.3x in DeepSpeed's own offload runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Chunk boundaries fall on multiples of 64 elements: a whole number of 64-byte cache lines for every
# dtype here, so no two chunks share a line.
_CHUNK_ALIGN = 64
_DEFAULT_CHUNK_ELEMS = 1 << 20
# The copy_ kernels split work across threads only in pieces of at least 32K elements; a chunk of at
# least this much per thread keeps each thread converting the same range the Adam kernel just updated,
# so the data is still in that core's cache.
_MIN_CHUNK_PER_THREAD = 1 << 16


def default_chunk_elems(num_threads: int | None = None) -> int:
    """Elements per chunk of the staged path: 1M (4 MiB of fp32 per buffer), or 64K per thread if larger.

    Per-chunk Python and thread-team overhead is ~10-20 us, so much smaller chunks lose more than the cache
    saves; much larger ones no longer fit in L2 plus a share of L3. The bench sweeps other sizes.
    """
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    return max(_DEFAULT_CHUNK_ELEMS, threads * _MIN_CHUNK_PER_THREAD)


@dataclass(frozen=True)
class AdamHyperparams:
    """One param group's Adam settings. adamw_mode: decoupled weight decay (p *= 1 - lr*wd) instead of
    L2 (g += wd*p). bias_correction=False drops the 1/(1-beta^t) factors, as DeepSpeed allows."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    bias_correction: bool = True

    def __post_init__(self) -> None:
        if not (self.lr >= 0.0 and math.isfinite(self.lr)):
            raise ValueError(f"Adam: lr must be a finite number >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            beta = getattr(self, name)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Adam: {name} must be in [0, 1), got {beta}")
        if not self.eps >= 0.0:
            raise ValueError(f"Adam: eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"Adam: weight_decay must be >= 0, got {self.weight_decay}")

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> AdamHyperparams:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=bool(group["adamw_mode"]),
            bias_correction=bool(group["bias_correction"]),
        )


def _check_flat(who: str, name: str, t: torch.Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{who}: {name} is on {t.device}; CPU Adam needs every tensor in CPU memory")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{who}: {name} has dtype {t.dtype}; expected one of {allowed}")
    if t.numel() != numel:
        raise ValueError(f"{who}: {name} has {t.numel()} elements but the parameter has {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} is not contiguous; the kernel walks memory linearly")


def _check_grad_scale(who: str, grad_scale: float | torch.Tensor | None) -> None:
    # Only plain numbers are checked: a tensor scale is the caller's (reading it may wait on a GPU).
    if isinstance(grad_scale, (int, float)) and not (math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"{who}: grad_scale must be a finite number > 0, got {grad_scale}")


def _kernel(
    hp: AdamHyperparams, grad_scale: float | torch.Tensor | None
) -> tuple[Callable[..., None], dict[str, Any]]:
    """torch's fused CPU kernel for the mode, with its keyword arguments."""
    if isinstance(grad_scale, torch.Tensor):
        grad_scale = grad_scale.to(device="cpu", dtype=torch.float32)  # the CPU kernel reads a float
    elif grad_scale is not None:
        grad_scale = torch.tensor(float(grad_scale), dtype=torch.float32)
    kwargs: dict[str, Any] = dict(
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
    )
    return (torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_), kwargs


def _step_tensor(step: float | torch.Tensor, hp: AdamHyperparams) -> torch.Tensor:
    # The kernel always applies bias correction 1 - beta^step; with step = inf both factors are exactly 1
    # (beta < 1), which is Adam without bias correction and needs no second kernel.
    if not hp.bias_correction:
        return torch.tensor(math.inf, dtype=torch.float32)
    if isinstance(step, torch.Tensor):
        return step
    return torch.tensor(step, dtype=torch.float32)


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hp: AdamHyperparams,
    *,
    out: torch.Tensor | None = None,
    grad_scale: float | torch.Tensor | None = None,
    chunk_elems: int | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW update of ``param``, ``exp_avg``, ``exp_avg_sq`` in place; ``step`` is 1 on the first.

    All tensors are contiguous CPU tensors with the same number of elements (shapes may differ: the
    update is elementwise). ``exp_avg``/``exp_avg_sq`` share one dtype, the state dtype; ``param`` and
    ``grad`` may be fp32, bf16 or fp16 in any mix. ``grad`` is divided by ``grad_scale`` inside the
    kernel. Where ``grad`` already has the state dtype and ``grad_scale`` is given, the kernel stores the
    divided gradient back into ``grad`` (as torch does); low-precision grads are never written.
    ``out`` (any of those dtypes) receives the updated weights, e.g. a pinned bf16 buffer for the copy
    back to the GPU.

    Chunking: when a dtype must be converted or ``out`` is given, the work runs in chunks of
    ``chunk_elems`` (default ``default_chunk_elems()``; 0 means one chunk of the whole tensor) so that
    conversions happen in cache. ``scratch`` is an optional state-dtype buffer of at least
    ``scratch_elems(...)`` elements to reuse across calls; without it one is allocated per call.
    """
    who = "adam_step_"
    n = param.numel()
    _check_flat(who, "param", param, n, _KERNEL_DTYPES)
    _check_flat(who, "grad", grad, n, _KERNEL_DTYPES)
    _check_flat(who, "exp_avg", exp_avg, n, _KERNEL_DTYPES)
    _check_flat(who, "exp_avg_sq", exp_avg_sq, n, (exp_avg.dtype,))
    if out is not None:
        _check_flat(who, "out", out, n, _KERNEL_DTYPES)
    if step < 1:
        raise ValueError(f"{who}: step counts updates from 1, got {step}")
    _check_grad_scale(who, grad_scale)

    kernel, kwargs = _kernel(hp, grad_scale)
    step_t = _step_tensor(float(step), hp)
    p, g, m, v = param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    state_dtype = m.dtype
    stage_param = p.dtype != state_dtype
    stage_grad = g.dtype != state_dtype
    if not (stage_param or stage_grad or out is not None):
        kernel([p], [g], [m], [v], [], [step_t], **kwargs)  # one pass, nothing to convert
        return

    chunk = _resolve_chunk(chunk_elems, n)
    need = scratch_elems(n, chunk, stage_param, stage_grad)
    if scratch is None:
        scratch = torch.empty(need, dtype=state_dtype)
    elif scratch.dtype != state_dtype or scratch.numel() < need or not scratch.is_contiguous():
        raise ValueError(
            f"{who}: scratch must be a contiguous {state_dtype} tensor of >= {need} elements, "
            f"got {scratch.dtype} with {scratch.numel()}"
        )
    scratch = scratch.view(-1)
    g_scr = scratch[:chunk] if stage_grad else None
    p_scr = scratch[chunk * stage_grad : chunk * (stage_grad + 1)] if stage_param else None
    ps = p.split(chunk)
    outs = out.view(-1).split(chunk) if out is not None else (None,) * len(ps)
    for pc, gc, mc, vc, oc in zip(ps, g.split(chunk), m.split(chunk), v.split(chunk), outs, strict=True):
        k = pc.numel()
        pw = p_scr[:k].copy_(pc) if p_scr is not None else pc
        gw = g_scr[:k].copy_(gc) if g_scr is not None else gc
        kernel([pw], [gw], [mc], [vc], [], [step_t], **kwargs)
        if p_scr is not None:
            pc.copy_(pw)
        if oc is not None:
            oc.copy_(pw)  # pw was just written by the kernel: this reads cache, not DRAM


def _resolve_chunk(chunk_elems: int | None, numel: int) -> int:
    if chunk_elems is None:
        chunk_elems = default_chunk_elems()
    if chunk_elems < 0:
        raise ValueError(f"chunk_elems must be >= 0 (0 = whole tensor), got {chunk_elems}")
    if chunk_elems == 0 or chunk_elems >= numel:
        return max(numel, 1)
    return -(-chunk_elems // _CHUNK_ALIGN) * _CHUNK_ALIGN


def scratch_elems(numel: int, chunk: int, stage_param: bool, stage_grad: bool) -> int:
    """State-dtype scratch that ``adam_step_`` needs: one chunk per converted operand."""
    return min(chunk, numel) * (int(stage_param) + int(stage_grad))


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
