"""The Adam/AdamW step of fp32 masters behind 16-bit working weights, in one pass over each group's bytes.

Owns `FusedMasterAdam` (the step, binding torch's state to the flat moments it needs), `fused_setting`
(the `DSLAUNCH_FUSED_MASTER_STEP` switch), `compile_step` (the compiled step), `compile_refusal` (a probe
that builds its kernels before the first real step, so a missing toolchain means torch's step, not a
crash) and `plan_runs` (which gradient pieces one kernel updates). Which optimizers it stands in for and
the state's layout are runtime/precision/adam_state.py's. The device placement
(runtime/offload/placement.py `DeviceMasters`) decides where it applies and hands it segments: matching
slices of a master, of its reduced 16-bit gradient and of the working weights.

On by default on CUDA devices with Triton, where inductor compiles it: on an H100 it took the step of a
3.2B Llama from 58 to 35 ms and the compiled engine from 0.94x to 1.02-1.03x a compiled plain loop, and
1.04x once one rank kept autograd's gradients and the step stopped reading the device per group
(BENCHMARKS.md, issue 33). `DSLAUNCH_FUSED_MASTER_STEP=0` turns it off; `=1` turns it on elsewhere too
(the CPU tests: dynamo with the eager backend traces the same function, checked equal to torch's step).

Why: the unfused step moves each parameter's bytes three times. The 16-bit gradient is cast into a fresh
fp32 buffer (2 bytes read, 4 written), torch's fused AdamW updates master and moments from it (16 read,
12 written), and the master is cast back into the working weight (4 read, 2 written): 40 bytes a
parameter, plus a transient fp32 gradient of 4 bytes a parameter at the step's memory peak. One
elementwise kernel that reads the 16-bit gradient and writes the 16-bit weight itself moves 28 bytes and
needs no buffer. A compiled plain PyTorch loop under autocast also pays about 40 (its casts of weights and
gradients), so these 12 bytes decide whether the compiled engine keeps up with it (BENCHMARKS.md, issue 33).
The step is one `torch.compile`d call (`adam_steps_`: every segment's `adam_update_`, a Triton kernel
each, launched from inductor's wrapper), with lr, weight decay, the step count and the gradient factor as
device scalars, so a scheduler's new lr or the next step never recompiles and nothing waits for the
device. It was a compiled call a segment until 2026-12-08; those calls' host time (141 of them at a 3B
Llama, 41-44 ms a step on H100 hosts) exceeded the kernels' 35 ms.

The state stays torch's: `optimizer.state[p]` holds `step` (a float32 device tensor, as torch's fused
Adam keeps it), `exp_avg` and `exp_avg_sq` for every parameter the optimizer holds (the flat master, or
one view of it per parameter at one rank), so `state_dict`, checkpoints and a later unfused step read it
unchanged. Here the moments are views into one flat buffer per group, which the one-pass kernel needs; a
`load_state_dict` (or anything else) that replaces them is noticed at the next step and copied back in.
The arithmetic is torch's fused AdamW's, in the same order, in fp32.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.precision.adam_state import MOMENTS, flat_moment, offset_in

_log = logging.getLogger(__name__)
_ENV = "DSLAUNCH_FUSED_MASTER_STEP"
KERNEL_FAILED = "its kernel did not build here"  # compile_refusal's reasons start so


def fused_setting() -> bool | None:
    """The `DSLAUNCH_FUSED_MASTER_STEP` switch, for this step and master_kernel's of bf16 masters: "1" on
    wherever the step allows it, "0" off, unset None (the default, which each decides by the device)."""
    text = os.environ.get(_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{_ENV}={text!r}: expected 0 or 1")
    return None if text == "" else text == "1"


def default_refusal(device: torch.device) -> str | None:
    """Why the fused step is not the default on `device`, or None where it is (a CUDA device with Triton,
    which inductor's kernel needs)."""
    if device.type != "cuda":
        return f"the masters are on {device.type}, and the default is CUDA's ({_ENV}=1 turns it on)"
    from torch.utils._triton import has_triton

    if not has_triton():
        return "Triton, which compiles its kernel, is not installed"
    return None


def adam_update_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    working: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    weight_decay: torch.Tensor,
    factor: torch.Tensor,
    keep: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    decoupled: bool,
) -> None:
    """One Adam(W) update of `master` (fp32) from the 16-bit `grad` times `factor`, moments in place, and
    the new weight cast into `working`; lr, step (already counted), weight_decay, factor and keep are 0-d
    fp32 tensors, so a scheduler that moves lr or weight decay never recompiles (a decay of 0 multiplies by
    exactly 1, or adds exactly 0: torch's step, which skips it, gives the same bits). With `keep` 0
    (non-finite gradients) master and moments keep their values, so the skip needs no host decision before
    the launch."""
    g = grad.to(torch.float32) * factor
    if decoupled:
        weight = master * (1.0 - lr * weight_decay)
    else:
        weight = master
        g = g + weight_decay * master
    avg = exp_avg * beta1 + g * (1.0 - beta1)
    avg_sq = exp_avg_sq * beta2 + g * g * (1.0 - beta2)
    bias1 = 1.0 - torch.pow(beta1, step)
    bias2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, step))
    denom = avg_sq.sqrt() / bias2_sqrt + eps
    weight = weight - avg / denom * (lr / bias1)
    kept = keep > 0
    exp_avg.copy_(torch.where(kept, avg, exp_avg))
    exp_avg_sq.copy_(torch.where(kept, avg_sq, exp_avg_sq))
    master.copy_(torch.where(kept, weight, master))
    working.copy_(master)


Hyper = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float, float, bool]
"""A param group's lr, step count and weight decay (0-d fp32 device tensors), beta1, beta2, eps and
whether the decay is decoupled (AdamW)."""
Piece = tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor]
"""One launch's master, gradient pieces (joined in order), exp_avg, exp_avg_sq and working weights."""


def adam_steps_(groups: list[tuple[Hyper, list[Piece]]], factor: torch.Tensor, keep: torch.Tensor) -> None:
    """Every group's `adam_update_`s of one step, in one compiled call: one call's host cost (dynamo's
    guards, AOT's and inductor's wrappers) instead of one a segment, which made the step of a 3B Llama
    wait on the host (141 calls, 41-44 ms of host time against 35 ms of kernels on H100s); the kernels
    launch from inductor's generated wrapper. On the 2-core CPU machine, with inductor there too, the step
    of a model with that Llama's tensors at 1/1024 their size went from 21.3 to 13.6 ms, most of what is
    left being the CPU kernels themselves (scripts/bench/step_host.py, BENCHMARKS.md). A segment's
    gradient pieces are joined inside the graph, where inductor may fuse the join into the update's loads."""
    for (lr, step, weight_decay, beta1, beta2, eps, decoupled), pieces in groups:
        for master, grads, exp_avg, exp_avg_sq, working in pieces:
            grad = grads[0] if len(grads) == 1 else torch.cat(grads)
            adam_update_(
                master, grad, exp_avg, exp_avg_sq, working, lr, step, weight_decay, factor, keep,
                beta1, beta2, eps, decoupled,
            )  # fmt: skip


def compile_step(device: torch.device, backend: str | None = None) -> Callable[..., None]:
    """`adam_steps_` compiled for `device`'s type: inductor on a GPU (the point of it), dynamo with the
    eager backend elsewhere (the same traced graph: what the CPU tests check); `backend` names another
    (scripts/bench/step_host.py times inductor's on the CPU). Shapes are static, since a
    step's segments are the same every step. The segments go in as views, not as flat buffers sliced
    inside the graph: mutating slices of an input makes AOT write the whole input back (on the CPU, 8
    updates of 1M elements took 374 ms that way against 2.4 ms as views of a 64M buffer). Each caller gets
    a copy of the function's code object, since dynamo keeps compiled graphs per code object and allows
    eight to one: every engine's step is a graph of its own, and a process of many engines must not fall
    back to running its step op by op."""
    fn = types.FunctionType(adam_steps_.__code__.replace(), adam_steps_.__globals__, adam_steps_.__name__)
    backend = backend or ("inductor" if device.type == "cuda" else "eager")
    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)


def compile_refusal(device: torch.device, working_dtype: torch.dtype) -> str | None:
    """Run the compiled step once on a few elements of `device` (a segment alone and one joined from two
    pieces), so that a toolchain that cannot build its kernels (inductor's compiler, Triton's) is found
    before any real state is touched: the reason, or None when it ran."""
    try:
        master, exp_avg, exp_avg_sq = (torch.zeros(128, dtype=torch.float32, device=device) for _ in range(3))
        grad, working = (torch.zeros(128, dtype=working_dtype, device=device) for _ in range(2))
        one = torch.ones((), dtype=torch.float32, device=device)  # lr, step, decay, factor and keep
        hyper: Hyper = (one, one, one, 0.9, 0.999, 1e-8, True)
        halves = [(t[:64], t[64:]) for t in (master, exp_avg, exp_avg_sq, grad, working)]
        pieces: list[Piece] = [
            (halves[0][0], (halves[3][0],), halves[1][0], halves[2][0], halves[4][0]),
            (halves[0][1], (halves[3][1][:32], halves[3][1][32:]), halves[1][1], halves[2][1], halves[4][1]),
        ]
        compile_step(device)([(hyper, pieces)], one, one)
    except Exception as exc:  # any failure to build or run it: torch's own step is the fallback
        first = (str(exc).splitlines() or [""])[0][:200]
        return f"{KERNEL_FAILED} ({type(exc).__name__}: {first})"
    return None


RUN_ELEMENTS = 1 << 24
"""What one kernel of the update should cover at least: 16M elements, about 150 us of an H100's memory
time at 28 bytes each. Gradients as many small tensors (one rank's autograd gradients:
runtime/zero/one_rank.py) are joined into runs of this size, so the step is a few large kernels, not one a
tensor (GPT-2 XL's 580 tensors one compiled call each: 63 ms a step against 18, when each kernel was a
call of its own from Python)."""


def plan_runs(numels: Sequence[int], target: int | None = None) -> list[tuple[int, int]]:
    """Consecutive pieces of one master as [start, end) index runs, one launch each: a piece of at least
    `target` elements (default `RUN_ELEMENTS`) alone, nothing copied; smaller neighbours together until
    they reach `target` (joined into one buffer at the launch: 4 bytes an element moved, a seventh of the
    update's 28). Empty pieces join whatever run is open, or none."""
    target = RUN_ELEMENTS if target is None else target
    runs: list[tuple[int, int]] = []
    start, total = 0, 0
    for index, numel in enumerate(numels):
        if numel >= target:
            if total:
                runs.append((start, index))
            runs.append((index, index + 1))
            start, total = index + 1, 0
            continue
        total += numel
        if total >= target:
            runs.append((start, index + 1))
            start, total = index + 1, 0
    if total:
        runs.append((start, len(numels)))
    return runs


@dataclass(frozen=True)
class Segment:
    """Matching 1-D slices: `master` (fp32) starts `offset` elements into its group's flat master and
    `working` holds the weights the update is cast into; `grads` is its reduced 16-bit gradient in one or
    more consecutive 1-D pieces, joined inside the compiled step (`adam_steps_`)."""

    master: torch.Tensor
    grads: tuple[torch.Tensor, ...]
    working: torch.Tensor
    offset: int


@dataclass
class _GroupState:
    """The flat moments of one optimizer param group and the views of them torch's state holds."""

    params: list[torch.Tensor]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    views: list[tuple[torch.Tensor, torch.Tensor]]
    steps: list[torch.Tensor]
    lr: torch.Tensor
    weight_decay: torch.Tensor
    # each launch's (offset, length) -> its moments' views, made at the first step that asks
    moments: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def moments_at(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.moments.get((offset, n))
        if pair is None:
            pair = self.moments[offset, n] = (
                self.exp_avg.narrow(0, offset, n),
                self.exp_avg_sq.narrow(0, offset, n),
            )
        return pair


class FusedMasterAdam:
    """Takes the step of a torch Adam/AdamW built over flat fp32 masters (one per param group, or one
    view of it per parameter), writing the working weights as it goes."""

    def __init__(self, masters: Sequence[torch.Tensor], indices: Sequence[int]) -> None:
        self.masters = list(masters)
        self.indices = list(indices)  # the optimizer param group of each master
        self._groups: list[_GroupState | None] = [None] * len(self.masters)
        self._factor = torch.zeros((), dtype=torch.float32, device=self.masters[0].device)
        self._keep = torch.ones((), dtype=torch.float32, device=self.masters[0].device)
        self._kernel = compile_step(self.masters[0].device)
        self._compiled = False  # whether a step has run (the first compiles)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        segments: Sequence[Sequence[Segment]],
        factor: float | torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Update every group's segments (`segments[i]` belongs to `masters[i]`): gradients times `factor`
        (averaging, unscaling and clipping folded into one number, or a 0-d device tensor when it depends
        on the norm). `keep`, a 0-d device tensor, is 0 where the gradients were not finite: then nothing
        changes, step counts included (None: always 1). The caller reads the verdict after the launches."""
        if isinstance(factor, torch.Tensor):
            factor_t = factor.to(torch.float32).reshape(())
        else:
            factor_t = self._factor.fill_(factor)
        keep_t = self._keep if keep is None else keep.to(torch.float32).reshape(())
        work: list[tuple[Hyper, list[Piece]]] = []
        for index, group_segments in enumerate(segments):
            options = optimizer.param_groups[self.indices[index]]
            state = self._bound(optimizer, index)
            # alpha picks the overload that reads keep_t on the device: without it the 0-d tensor binds
            # as a Scalar, read with .item(), a host sync per group (30 at a 3B Llama's ZeRO-3, 7 ms a step)
            torch._foreach_add_(state.steps, keep_t, alpha=1)
            state.lr.fill_(float(options["lr"]))
            state.weight_decay.fill_(float(options["weight_decay"]))
            beta1, beta2 = options["betas"]
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
                options.get("decoupled_weight_decay")
            )
            hyper = (state.lr, state.steps[0], state.weight_decay, float(beta1), float(beta2),
                     float(options["eps"]), decoupled)  # fmt: skip
            pieces = [
                (seg.master, seg.grads, *state.moments_at(seg.offset, seg.master.numel()), seg.working)
                for seg in group_segments
            ]
            work.append((hyper, pieces))
        started = time.perf_counter()
        try:
            self._kernel(work, factor_t, keep_t)
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            # the probe's two segments built, this step's graph did not (a compiler failing on one size,
            # say): nothing of it ran, since a graph compiles whole before it runs. The same arithmetic
            # op by op keeps training right, slower, and the log says so once.
            inner = getattr(exc, "inner_exception", exc)
            why = f"{type(inner).__name__}: {(str(inner).splitlines() or [''])[0][:200]}"
            _log.warning("the fused optimizer step's graph did not compile, it runs op by op: %s", why)
            self._kernel, self._compiled = adam_steps_, True
            adam_steps_(work, factor_t, keep_t)
            return
        if not self._compiled:  # the first step compiles a graph of every segment: say why it paused
            self._compiled = True
            count = sum(len(pieces) for _, pieces in work)
            took = time.perf_counter() - started
            _log.info("fused optimizer step: its graph of %d segments built in %.1f s (once)", count, took)

    def _bound(self, optimizer: torch.optim.Optimizer, index: int) -> _GroupState:
        """The group's flat moments, with torch's state pointing into them (re-made when something
        replaced the group's parameters or their state since the last step)."""
        params = list(optimizer.param_groups[self.indices[index]]["params"])
        state = self._groups[index]
        if state is not None and self._intact(optimizer, state, params):
            return state
        state = self._bind(optimizer, index, params)
        self._groups[index] = state
        return state

    @staticmethod
    def _intact(optimizer: torch.optim.Optimizer, state: _GroupState, params: list[torch.Tensor]) -> bool:
        if len(params) != len(state.params) or any(
            a is not b for a, b in zip(params, state.params, strict=True)
        ):
            return False
        for param, (avg, avg_sq), step in zip(params, state.views, state.steps, strict=True):
            entry = optimizer.state.get(param, {})
            if entry.get("exp_avg") is not avg or entry.get("exp_avg_sq") is not avg_sq:
                return False
            if entry.get("step") is not step:
                return False
        return True

    def _bind(self, optimizer: torch.optim.Optimizer, index: int, params: list[torch.Tensor]) -> _GroupState:
        master = self.masters[index]
        # the flat moments `make_adam_state` made while the engine was built are taken as they are (a copy
        # would hold the moments twice at the first step's peak); anything else is copied into new ones
        adopted = {key: flat_moment(optimizer, params, master, key) for key in MOMENTS}
        flat: dict[str, torch.Tensor] = {}
        for key in MOMENTS:
            made = adopted[key]
            flat[key] = torch.zeros_like(master, dtype=torch.float32) if made is None else made
        views, steps = [], []
        for param in params:
            offset = offset_in(master, param)
            if offset is None:
                raise AssertionError(
                    f"optimizer group {index} holds a tensor that is not a view of its master"
                )
            entry = optimizer.state[param]
            pair = []
            for key in MOMENTS:
                view = flat[key].narrow(0, offset, param.numel()).view(param.shape)
                if key in entry and adopted[key] is None:  # resumed, or stepped unfused: keep the values
                    view.copy_(entry[key].reshape(param.shape))
                entry[key] = view
                pair.append(view)
            views.append((pair[0], pair[1]))
            old = entry.get("step")
            count = float(old) if old is not None else 0.0  # a read of one number, only when (re)binding
            entry["step"] = torch.tensor(count, dtype=torch.float32, device=master.device)
            steps.append(entry["step"])
        lr, decay = (torch.zeros((), dtype=torch.float32, device=master.device) for _ in range(2))
        _log.debug(
            "fused master step: group %d bound (%d tensors, %d elements)", index, len(params), master.numel()
        )
        return _GroupState(params, flat["exp_avg"], flat["exp_avg_sq"], views, steps, lr, decay)
