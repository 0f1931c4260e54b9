"""Adam/AdamW over bf16 master weights (DeepSpeed's `bf16_master_weights_and_grads`), with the moments in
fp32 or bf16 (`bf16_optimizer_states`) and the new weights rounded stochastically.

Owns `MasterAdam`, `stochastic_round_` and `for_masters`, which the engine calls on the optimizer it built
over the flat master shards: where the policy's masters are bf16 and the optimizer is torch's Adam/AdamW,
it is rebuilt as a `MasterAdam` with the same param groups and hyperparameters.

Why stochastic rounding: a bf16 weight w moves only when the update exceeds half its ulp (2^-8 |w|), so
with round-to-nearest the many small Adam updates of a low learning rate, or late in a schedule, are
rounded away and training stalls. Rounding up with probability equal to the discarded fraction makes the
stored weight equal the fp32 result in expectation: no update is lost on average, at no memory cost (a
Kahan compensation buffer would add 2 bytes a parameter back). torchao's `_AdamW(bf16_stochastic_round=
True)` does the same, but it compiles its step with `torch.compile` per parameter shape (tens of seconds
on a CPU host, and a C++ toolchain), so the update here is our own: torch's fused Adam kernel on fp32
copies of one chunk at a time, then the rounding, written back. Chunks bound the fp32 temporaries
whatever the shard size. On one CPU thread of the dev box the step costs 2.3 ns an element with
stochastic rounding and bf16 moments, 1.7 without rounding, against 1.0 for torch's fused fp32 AdamW
(1.3 / 1.0 / 0.5 on two threads).

The state keys are torch's (`step` as a float32 tensor, `exp_avg`, `exp_avg_sq`), so checkpoints move to
and from runs with fp32 states; `load_state_dict` converts the moments to `state_dtype` (torch's own would
cast them to the parameter's dtype). The offloaded step runs this optimizer's `step()` on the host masters
(runtime.offload.step.host_adam.supports says no to it, so the generic host path takes it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from runtime.precision import master_kernel

_log = logging.getLogger(__name__)
# elements a chunk: on a GPU large, since each pass is a kernel launch; on a CPU 64K a thread, so the
# chunk's passes stay in cache (4x faster than 4M-element chunks on one thread of the dev box) and every
# thread has work (torch splits an op across threads in pieces of at least 32K elements)
_DEVICE_CHUNK = 1 << 24
_CPU_CHUNK_PER_THREAD = 1 << 16
_LOW_BITS = -(1 << 16)  # int32 mask 0xFFFF0000: the bits a bf16 keeps of an fp32
# CPU noise: a table holding every 16-bit value equally often (16 times, shuffled once), read from an
# offset drawn per (step, parameter, chunk). torch's CPU generator is one serial Mersenne twister (2.4 ns
# an element on any number of threads, more than the whole Adam update); the table costs one add. Over
# the offsets each element's noise is exactly uniform, so the rounding stays unbiased.
_TABLE_VALUES = 1 << 20
_tables: dict[int, torch.Tensor] = {}


def _cpu_noise(numel: int, key: int) -> torch.Tensor:
    """`numel` (at most the CPU chunk) noise values in [0, 2^16) from the table, at the key's offset."""
    span = _TABLE_VALUES + numel
    table = _tables.get(0)
    if table is None or table.numel() < span:
        values = torch.arange(_TABLE_VALUES, dtype=torch.int32) & 0xFFFF
        order = torch.randperm(_TABLE_VALUES, generator=torch.Generator().manual_seed(0))
        values = values[order]
        table = torch.cat([values, values[: max(numel, _CPU_CHUNK_PER_THREAD * 64)]])  # reads never wrap
        _tables[0] = table
    offset = (key * 0x9E3779B97F4A7C15 >> 17) % _TABLE_VALUES
    return table[offset : offset + numel]


def stochastic_round_(
    out: torch.Tensor,
    value: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    noise: torch.Tensor | None = None,
) -> None:
    """Write fp32 `value` into bf16 `out`, rounding to one of the two nearest bf16 numbers with the
    probability of its distance from the other: add uniform noise below the 16 bits bf16 drops (`noise`,
    int32 values in [0, 2^16), or drawn from `generator`), then truncate (exact, since the dropped bits
    are then zero). Infinities stay infinite (their low bits are zero, so the noise never carries); a NaN
    stays non-finite; the largest finite values may round up to infinity, as their next bf16 neighbour
    is."""
    if noise is None:
        noise = torch.empty(value.shape, dtype=torch.int32, device=value.device).random_(generator=generator)
        noise &= 0xFFFF
    bits = value.view(torch.int32) + noise
    bits &= _LOW_BITS
    out.copy_(bits.view(torch.float32))


class MasterAdam(torch.optim.Adam):
    """Adam (or AdamW: `decoupled_weight_decay`) whose parameters are bf16 masters; the update is computed
    in fp32 and the moments are kept in `state_dtype`."""

    runs_own_update = True  # the offloaded step calls step(), not its fused one-pass Adam

    def __init__(
        self,
        params: Any,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        state_dtype: torch.dtype = torch.float32,
        stochastic_rounding: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def round_into(self, out: torch.Tensor, value: torch.Tensor, step: int, index: int, chunk: int) -> None:
        """Stochastic rounding with noise that is a function of (seed, step, parameter, chunk) alone: a
        run resumed from a checkpoint (which restores the step count) rounds exactly as the unbroken run."""
        key = (((self._seed * 1_000_003 + step) * 1_000_033 + index) * 65_537 + chunk) % (1 << 63)
        if value.device.type == "cpu":
            stochastic_round_(out, value, noise=_cpu_noise(value.numel(), key))
            return
        if value.device not in self._generators:
            self._generators[value.device] = torch.Generator(value.device)
        stochastic_round_(out, value, self._generators[value.device].manual_seed(key))

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's settings as they are now, for a `step` that runs later on another thread
        (the offloaded delayed update), while the caller's scheduler may already change the groups."""
        return [
            {key: group[key] for key in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")}
            for group in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure: Any = None, *, hyperparameters: list[dict[str, Any]] | None = None) -> Any:
        """One update of every parameter with a gradient; `hyperparameters` (from `hyperparameters()`)
        stand in for the groups' current settings."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # the parameter's position in the optimizer (the rounding noise's key)
        for number, group in enumerate(self.param_groups):
            options = group if hyperparameters is None else hyperparameters[number]
            beta1, beta2 = options["betas"]
            kernel = torch._fused_adamw_ if options["decoupled_weight_decay"] else torch._fused_adam_
            settings = dict(
                lr=float(options["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(options["weight_decay"]),
                eps=float(options["eps"]),
                amsgrad=False,
                maximize=False,
            )
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self._state_of(p)
                state["step"] += 1
                step = state["step"].to(p.device)
                noise = (int(state["step"].item()), index)
                self._update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step, kernel, settings, noise)
        return loss

    def _update(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        step: torch.Tensor,
        kernel: Any,
        settings: dict[str, Any],
        noise: tuple[int, int],
    ) -> None:
        flat = [t.view(-1) for t in (p, g, m, v)]
        decoupled = kernel is torch._fused_adamw_
        if self._one_pass(flat, decoupled):
            self._update_one_pass(flat, settings, decoupled, noise)
            return
        size = _CPU_CHUNK_PER_THREAD * torch.get_num_threads() if p.device.type == "cpu" else _DEVICE_CHUNK
        for start in range(0, p.numel(), size):
            pc, gc, mc, vc = (t[start : start + size] for t in flat)
            # fp32 working copies (the ones already fp32 are stepped in place)
            pw, gw, mw, vw = (t if t.dtype == torch.float32 else t.float() for t in (pc, gc, mc, vc))
            kernel([pw], [gw], [mw], [vw], [], [step], **settings)
            for low, work in ((mc, mw), (vc, vw)):
                if low is not work:
                    low.copy_(work)  # the moments round to nearest: their relative error does not pile up
            if pc is pw:
                continue
            if self.stochastic_rounding and pc.dtype == torch.bfloat16:
                self.round_into(pc, pw, *noise, start // size)
            else:
                pc.copy_(pw)

    def prepare(self) -> None:
        """Make the state and build the one-pass kernels the step will take, now, while the engine is built.

        The moments: made in the first step, after its backward, they would let a first step fit that no
        later one does (the 8B at 162,816 tokens on an H200 peaked at 59.9 GiB in its first step, 67.5
        from the second on, at shorter lengths): made here, a configuration that cannot hold them fails at
        setup, where the engine explains it (runtime/engine/setup_oom.py), as DeepSpeed's ZeRO optimizers
        make their state at initialization. Zeros with step 0 are what the first step would make.

        The kernels: inductor compiles each once a process (14 s on the 2-core CI host with a cold cache, a
        minute on issue 32's 16-core host), which the first step would otherwise stall on, uncounted by
        anything that times setup. The probe assumes gradients in the masters' dtype; a step that lands
        another builds its own at once."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p)
        built: set[tuple[torch.device, torch.dtype, bool, bool]] = set()
        for group in self.param_groups:
            decoupled = bool(group["decoupled_weight_decay"])
            for p in group["params"]:
                rounding = self.stochastic_rounding and p.dtype == torch.bfloat16
                mode = (p.device, p.dtype, decoupled, rounding)
                if mode in built or not master_kernel.wanted(p.device, p.numel()):
                    continue
                built.add(mode)
                started = time.perf_counter()
                dtypes = (p.dtype, p.dtype, self.state_dtype)
                refused = master_kernel.refusal(p.device, dtypes, decoupled, rounding)
                took = time.perf_counter() - started
                if refused is None and took >= 1.0:  # built here, not found built by an earlier engine
                    _log.info("bf16 master step: its one-pass kernel for %s built in %.1f s", p.device, took)

    def _one_pass(self, flat: list[torch.Tensor], decoupled: bool) -> bool:
        """Whether this parameter takes master_kernel's compiled one-pass step (where it is wanted and
        its kernel builds for these dtypes)."""
        p, g, m, _ = flat
        if not master_kernel.wanted(p.device, p.numel()):
            return False
        rounding = self.stochastic_rounding and p.dtype == torch.bfloat16
        return master_kernel.refusal(p.device, (p.dtype, g.dtype, m.dtype), decoupled, rounding) is None

    def _update_one_pass(
        self,
        flat: list[torch.Tensor],
        settings: dict[str, Any],
        decoupled: bool,
        noise: tuple[int, int],
    ) -> None:
        p = flat[0]
        rounding = self.stochastic_rounding and p.dtype == torch.bfloat16
        numbers = master_kernel.hyper_numbers(settings, noise[0], decoupled)  # noise[0]: the step count
        hyper = torch.tensor(numbers, dtype=torch.float32, device=p.device)
        update = master_kernel.update_for(p.device, decoupled, rounding)
        for piece, start in enumerate(range(0, p.numel(), master_kernel.PIECE)):
            key = master_kernel.rounding_key(self._seed, *noise, piece)
            key_t = torch.tensor(key, dtype=torch.int32, device=p.device)
            update(*(t[start : start + master_kernel.PIECE].detach() for t in flat), hyper, key_t)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the moments taken again from `state_dict` in `state_dtype` (torch's own load
        casts them to the parameter's dtype, which would round fp32 moments of bf16 masters)."""
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in zip(ids, params, strict=True):
            saved = state_dict["state"].get(index, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if torch.is_tensor(saved.get(key)):
                    self.state[param][key] = saved[key].to(device=param.device, dtype=self.state_dtype)


def for_masters(
    optimizer: Any, master_dtype: torch.dtype, state_dtype: torch.dtype, stochastic_rounding: bool
) -> Any:
    """`optimizer`, rebuilt as a `MasterAdam` over the same param groups when the masters are bf16 and it
    is torch's Adam/AdamW; otherwise as it is (an error for another optimizer with stochastic rounding)."""
    if master_dtype != torch.bfloat16 or isinstance(optimizer, MasterAdam) or optimizer is None:
        return optimizer
    if hasattr(optimizer, "round_masters"):  # runtime.optim.muon: rounds its own updates, AdamW's with us
        optimizer.round_masters(state_dtype, stochastic_rounding)
        return optimizer
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        if stochastic_rounding:
            from runtime.config import ConfigError

            raise ConfigError(
                "bf16.stochastic_rounding",
                f"is built into the Adam/AdamW and Muon updates only, not {type(optimizer).__name__}",
                hint='set "stochastic_rounding": false to step this optimizer on bf16 masters with '
                "round-to-nearest (small updates are lost), or use AdamW or Muon",
            )
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError("bf16 master weights: Adam with amsgrad or maximize is not built")
        keep = ("params", "lr", "betas", "eps", "weight_decay")
        groups.append({k: v for k, v in group.items() if k in keep or k not in optimizer.defaults})
        groups[-1]["decoupled_weight_decay"] = isinstance(optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay", False)
        )
    adam = MasterAdam(groups, state_dtype=state_dtype, stochastic_rounding=stochastic_rounding)
    adam.prepare()  # during the engine's setup, not in its first step
    return adam
