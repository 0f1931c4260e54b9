"""`MasterAdam`'s update in one pass over each parameter's bytes: bf16 masters, moments in fp32 or bf16,
the new weights rounded stochastically, all in one loop that inductor compiles (C++ with OpenMP on a CPU
host, Triton on a GPU).

Owns `one_pass_update_` (the arithmetic), `rounding_key` (the noise's seed for one call), `refusal` (a
probe that builds the kernel on a few elements before any real state is touched) and `wanted` (where it
runs by default). `MasterAdam` asks `wanted` and `refusal` (first as the engine makes it: `prepare`, so
the build is part of the setup, not of step 1), then calls `update_for`'s kernel in place of its chunked
step.

Why: the chunked step widens each operand into a fp32 copy, runs torch's fused kernel on the copies,
narrows the moments back and rounds the weights: a dozen operations a chunk, each a trip through torch's
dispatcher and its thread pool. On the 16-core host of issue 32's H100 machine it stepped 17.63B bf16
masters in 14.0 s (1.26 G parameters/s, 18 GB/s of the host's ~125): the host step was half of every
optimizer step, and what held that run to 25% MFU. One compiled loop reads g, p, m, v once and writes
p, m, v once, 14 bytes a parameter with bf16 moments. On that host it steps 5.1G parameters a second with
stochastic rounding and 9.9G without (the host's bandwidth), 2.5x and 4.1x the chunked step, and took that
run to 35.3% MFU (BENCHMARKS.md, issue 32). The rounding costs half: inductor's C++ backend reinterprets
each weight's bits (fp32 to int32 and back) element by element; the hash itself is nearly free.

The noise: 16 uniform bits for each element, a bijective integer hash of (element index xor key), where
the key is drawn per (seed, step, parameter, piece) by `rounding_key`. For a fixed element, a uniformly
drawn key makes its noise exactly uniform, so each rounding is unbiased; the noise is a function of those
numbers alone, so a run resumed from a checkpoint rounds exactly as the unbroken one. The hash is in int32
(wrapping multiplies, which vectorize; int64 ones do not on AVX2), so a call covers at most 2^30 elements
and longer parameters go in pieces.

The arithmetic is torch's fused CPU Adam's, in fp32 and in its order, with the per-step numbers derived in
double as it derives them; the moments are rounded to nearest into their dtype, as the chunked step does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from runtime.precision.fused_master import fused_setting

_log = logging.getLogger(__name__)
PIECE = 1 << 30  # elements a call: the int32 element index and hash never overflow into the sign's use
# By default a CPU host compiles the kernel only for a parameter this large: building it costs seconds to
# tens of seconds once a process (inductor's C++ compiler on a cold cache), which a step of 16M elements
# repays within some hundreds of steps and the multi-billion-element offloaded shards in a few.
CPU_MIN_ELEMENTS = 1 << 24
_GOLDEN = -1640531535  # 0x9E3779B1 as int32: Knuth's multiplicative hash constant
_MIX = -2048144789  # 0x85EBCA6B as int32: murmur3's finalizer constant
_LOW_BITS = -(1 << 16)  # int32 mask 0xFFFF0000: the bits a bf16 keeps of an fp32
_PROBE = 1 << 20


def hyper_numbers(settings: dict[str, float], step: int, decoupled: bool) -> list[float]:
    """The kernel's `hyper`: the per-step numbers derived from Adam's settings in double precision and
    then rounded once to fp32, as torch's fused CPU kernel derives them (so ties between two bf16 numbers
    round the same way in both steps)."""
    lr, beta1, beta2 = settings["lr"], settings["beta1"], settings["beta2"]
    weight_decay = settings["weight_decay"]
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    decay = 1.0 - lr * weight_decay if decoupled else weight_decay
    return [decay, 1.0 - beta1, beta2, 1.0 - beta2, -lr / bias1, math.sqrt(bias2), settings["eps"]]


def one_pass_update_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: torch.Tensor,
    key: torch.Tensor,
    decoupled: bool,
    rounding: bool,
) -> None:
    """One Adam(W) update of the 1-D `master` (bf16 or fp32) from `grad`, moments in place in their own
    dtype. `hyper` holds `hyper_numbers` as an fp32 tensor and `key` is a 0-d int32 tensor: as tensors, a
    new lr or step never rebuilds the kernel. With `rounding` the new bf16 weight is rounded
    stochastically, else to nearest. The arithmetic is in fp32, in the order of torch's fused CPU kernel."""
    decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bias2_sqrt, eps = hyper.unbind()
    p = master.float()
    g = grad.float()
    if decoupled:
        p = p * decay
    else:
        g = g + p * decay  # decay is the L2 weight_decay here
    m = exp_avg.float()
    m = m + (g - m) * one_minus_beta1
    v = exp_avg_sq.float() * beta2 + one_minus_beta2 * g * g
    p = p + neg_step_size * m / (v.sqrt() / bias2_sqrt + eps)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if not rounding:
        master.copy_(p)
        return
    h = (torch.arange(master.numel(), dtype=torch.int32, device=master.device) ^ key) * _GOLDEN
    h = (h ^ ((h >> 15) & 0x1FFFF)) * _MIX  # the mask makes the shift logical
    bits = (p.view(torch.int32) + ((h >> 16) & 0xFFFF)) & _LOW_BITS
    master.copy_(bits.view(torch.float32))  # exact: the dropped bits are zero


def rounding_key(seed: int, step: int, index: int, piece: int) -> int:
    """The int32 key of one call's noise, a function of the run's seed, the step count, the parameter's
    position in the optimizer and the piece of it."""
    mixed = (((seed * 1_000_003 + step) * 1_000_033 + index) * 65_537 + piece) * 0x9E3779B97F4A7C15
    word = (mixed >> 29) & 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


_compiled: dict[tuple[str, bool, bool], Callable[..., None]] = {}
_refusals: dict[tuple[str, torch.dtype, torch.dtype, torch.dtype, bool, bool], str | None] = {}


def update_for(device: torch.device, decoupled: bool, rounding: bool) -> Callable[..., None]:
    """`one_pass_update_` for one mode, compiled by inductor for `device`'s type: its arguments are
    (master, grad, exp_avg, exp_avg_sq, hyper, key). One compiled function a mode, each with dynamic sizes,
    so that the dtype mixes a run uses stay within dynamo's recompile limit."""
    cache_key = (device.type, decoupled, rounding)
    if cache_key not in _compiled:

        def update(
            master: torch.Tensor,
            grad: torch.Tensor,
            exp_avg: torch.Tensor,
            exp_avg_sq: torch.Tensor,
            hyper: torch.Tensor,
            key: torch.Tensor,
        ) -> None:
            one_pass_update_(master, grad, exp_avg, exp_avg_sq, hyper, key, decoupled, rounding)

        _compiled[cache_key] = torch.compile(update, backend="inductor", dynamic=True, fullgraph=True)
    return _compiled[cache_key]


def wanted(device: torch.device, numel: int) -> bool:
    """Whether a parameter of `numel` elements on `device` takes the one-pass step: as the
    `DSLAUNCH_FUSED_MASTER_STEP` switch says ("0" never, "1" always), else on a GPU with Triton and, on a
    CPU host, from `CPU_MIN_ELEMENTS` up."""
    setting = fused_setting()
    if setting is not None:
        return setting
    if device.type == "cpu":
        return numel >= CPU_MIN_ELEMENTS
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return False


def refusal(
    device: torch.device,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    decoupled: bool,
    rounding: bool,
) -> str | None:
    """Build and run the kernel once on `_PROBE` elements of the (master, grad, moments) `dtypes` on
    `device`: None when it ran, else why not (a missing compiler, say), logged once; the caller then takes
    its chunked step."""
    cache_key = (str(device), *dtypes, decoupled, rounding)
    if cache_key not in _refusals:
        try:
            # inductor plans its loops (how many threads) by the sizes it first sees: a real size, not 64
            p, g, m, v = (torch.zeros(_PROBE, dtype=dtype, device=device) for dtype in (*dtypes, dtypes[2]))
            settings = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
            hyper = torch.tensor(hyper_numbers(settings, 1, decoupled), device=device)
            key = torch.zeros((), dtype=torch.int32, device=device)
            update_for(device, decoupled, rounding)(p, g, m, v, hyper, key)
            _refusals[cache_key] = None
        except Exception as exc:  # any failure to build or run it: the chunked step is the fallback
            first = (str(exc).splitlines() or [""])[0][:200]
            _refusals[cache_key] = f"its kernel did not build here ({type(exc).__name__}: {first})"
            _log.warning("bf16 master step: the chunked step runs: the one-pass %s", _refusals[cache_key])
    return _refusals[cache_key]
