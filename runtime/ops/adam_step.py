"""The functional Adam/AdamW step on flat CPU buffers: what ``CPUAdam`` and the offload engine both call.

Owns ``adam_step_`` (one update of p, m, v in place, optionally writing a low-precision copy of the new
weights), its settings ``AdamHyperparams``, and the chunk/scratch sizing the offload engine uses to keep
its own buffers (``default_chunk_elems``, ``scratch_elems``). The optimizer classes users import live in
``runtime.ops.adam``; they share this module's operand checks and kernel selection (the ``_``-prefixed
helpers), so both paths refuse the same inputs with the same messages and run the same kernel.

The arithmetic is torch's, not ours: the fused CPU kernels ``torch._fused_adamw_`` / ``torch._fused_adam_``
make a single vectorized, multi-threaded pass that reads p, g, m, v and writes p, m, v. That matches
DeepSpeed's C++ CPUAdam (same speed at 50M-200M params on 2 cores) and reached 4.4 G params/s on a
16-core host, about 125 GB/s at 28 B/param, which is the host's copy bandwidth (research/cpu_adam_bench.md,
perf_anchors.md §4, §6). At 15-20 flop per param the step is bound by memory traffic, so what this module
adds is the avoidance of traffic the kernel itself does not cause:

- gradients that land from the GPU in bf16/fp16 are widened one chunk at a time into a small fp32 scratch
  that stays in cache; widening the whole gradient into a fresh 4 B/param temporary each step costs an
  extra write and read of 4 B/param plus its page faults, 1.1-1.6x slower on the 2-core dev box;
- the low-precision weights that go back to the GPU are written per chunk straight after the kernel
  updated that chunk, while it is still cached, rather than in a second pass over all of p;
- the gradient scale (loss scale divided by the clipping factor) is applied inside the kernel.

With fp32 p/m/v, a bf16 gradient in and bf16 weights out, that is 2 + 12 + 12 + 2 = 28 B per param, the
same as a plain fp32 step (scripts/bench/cpu_adam.py measures it).

Threads: every kernel and copy here runs on torch's intra-op pool, ``torch.get_num_threads()`` threads.
Give each process its own cores (``OMP_NUM_THREADS`` = its core count, plus ``taskset``/``numactl`` binding,
one NUMA node per process when possible): ranks whose thread teams share cores slow each other down
several times over, and binding alone was worth 1.3x in DeepSpeed's own offload runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AdamHyperparams", "adam_step_", "default_chunk_elems", "scratch_elems"]

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
