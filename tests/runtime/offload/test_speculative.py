"""The checked offload step updates during backward and still skips a non-finite step exactly.

With one rank, no clipping and the non-finite check on (fp16's loss scaler, bf16's
`check_grad_overflow`), the offloaded update streams during backward into a second copy of the state,
kept on a finite verdict and dropped on a non-finite one (runtime/offload/step/speculative.py). Each case
trains 5 steps of 2 micro-batches and is compared, bit for bit, with:

- the same run without step 3's batches, when step 3 is poisoned in its first micro-batch: the last
  rank's loss times nan (every gradient non-finite), or an inf in the first layer's gradient only (its
  span lands last, after every other span was updated and its working weights overwritten): masters,
  working weights, Adam's moments and step counts, the LR scheduler and fp16's loss scale;
- the same clean run with the update waiting for the verdict (`speculate=False`, the order before):
  the speculative step changes nothing in the numbers.

Cases: the CPU's step and the device step (on the CPU here: the same chunks, slots and kernels), bf16
and fp16, `ratio` 0.5 (the device's share stepped after the verdict, the host's speculatively), at world
1 (speculative) and 2 (gradients land after backward: the step still waits; the same exactness). World 1
also checks where the speculation shows: the second copy's 12 bytes a parameter in the memory
breakdown, made only by a checked step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.runtime.offload.cases import SMALL_CHUNKS
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch, with_offload_settings

STEPS, BAD_STEP, ACCUMULATION, ROWS = 5, 3, 2, 4
POISONS = ("loss-nan", "first-layer-inf")


@dataclass(frozen=True)
class Case:
    dtype: str  # "bf16" or "fp16"
    update: str  # offload_optimizer.update: "host" (the CPU's step) or "device" (the device step)
    ratio: float = 1.0
    # the internal setting: None (auto) speculates with the device step alone; the CPU's step is forced
    speculate: bool | None = None

    @property
    def name(self) -> str:
        return f"{self.dtype}-{self.update}" + ("" if self.ratio == 1.0 else f"-ratio{self.ratio:g}")

    def config(self, world_size: int, *, check: bool = True, speculate: bool | None = None) -> Any:
        speculate = self.speculate if speculate is None else speculate
        # pinned: on a GPU, streaming and the device step need it (ignored without CUDA)
        offload = {"device": "cpu", "pin_memory": True, "update": self.update, "ratio": self.ratio}
        cfg: dict = {
            "train_batch_size": ROWS * ACCUMULATION,
            "gradient_accumulation_steps": ACCUMULATION,
            "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
            },
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 300, "offload_optimizer": offload},
        }
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True, "check_grad_overflow": check}
        else:
            cfg["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 8}
        return with_offload_settings(cfg, world_size=world_size, speculate=speculate, **SMALL_CHUNKS)


WORLD1 = [
    Case("bf16", "host", speculate=True),
    Case("bf16", "device"),
    Case("fp16", "host", speculate=True),
    Case("fp16", "device"),
    Case("bf16", "host", ratio=0.5, speculate=True),
    Case("fp16", "device", ratio=0.5),
]
WORLD2 = [Case("bf16", "host", speculate=True), Case("fp16", "device"), Case("bf16", "host", ratio=0.5)]


def _train(case: Case, rank: int, world_size: int, poison: str | None, *, skip: bool = False, **kw: Any):
    """STEPS steps; at BAD_STEP the first micro-batch is poisoned on the last rank (`poison`), or (`skip`)
    the step's batches are left out."""
    import runtime

    model = make_model(0)
    engine, _, _, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=case.config(world_size, **kw)
    )
    host = getattr(engine.masters, "host", engine.masters)  # the HostMasters (alone or beside the device)
    out: dict = {"lrs": [], "plan": host.plan.speculate, "streamed": []}
    for step in range(1, STEPS + 1):
        if skip and step == BAD_STEP:
            continue
        for micro in range(ACCUMULATION):
            bad = step == BAD_STEP and micro == 0 and rank == world_size - 1 and poison is not None
            handle = None
            if bad and poison == "first-layer-inf":
                handle = model.inp.weight.register_hook(lambda grad: grad * float("inf"))
            x, y = (t.to(engine.device) for t in rank_batch(step, micro, ROWS, rank, world_size))
            loss = loss_fn(engine(x), y)
            engine.backward(loss * float("nan") if bad and poison == "loss-nan" else loss)
            out["streamed"].append(host._streamed is not None)  # the update started during backward
            engine.step()
            if handle is not None:
                handle.remove()
        out["lrs"].append(engine.get_lr()[0])
    state = engine.optimizer.state_dict()["state"]
    out["optimizer"] = {f"{i}.{k}": v.cpu() for i, values in state.items() for k, v in values.items()}
    out["master"] = {k: v.cpu() for k, v in engine.full_state_dict(rank0_only=False).items()}
    out["working"] = {n: p.detach().cpu() for n, p in engine.module.named_parameters()}
    out["skipped"], out["loss_scale"] = engine.skipped_steps, engine.loss_scale
    out["host_buffer_bytes"] = engine.memory_breakdown().host_buffer_bytes
    out["host_numel"] = sum(g.master.numel() for g in host.groups)
    engine.destroy()
    return out


def _differences(got: dict, want: dict) -> list[str]:
    problems = [
        f"{part} {key}"
        for part in ("master", "optimizer", "working")
        for key, value in want[part].items()
        if not torch.equal(got[part][key], value)
    ]
    for key in ("skipped", "loss_scale"):
        if got[key] != want[key]:
            problems.append(f"{key}: {got[key]} != {want[key]}")
    return problems


def _grid(rank: int, world_size: int, cases: list[Case] | None = None) -> dict:
    report: dict = {}
    for case in cases or (WORLD1 if world_size == 1 else WORLD2):
        reference = _train(case, rank, world_size, None, skip=True)
        reference["skipped"] = 1  # the run that never saw the step counts none; the poisoned ones skip it
        for poison in POISONS:
            got = _train(case, rank, world_size, poison)
            lrs = got["lrs"][: BAD_STEP - 1] + got["lrs"][BAD_STEP:]  # the LR stood still at the skip
            report[(case.name, poison)] = (
                _differences(got, reference),
                lrs == reference["lrs"] and got["lrs"][BAD_STEP - 1] == got["lrs"][BAD_STEP - 2],
            )
        waited = _train(case, rank, world_size, None, speculate=False)
        clean = _train(case, rank, world_size, None)
        waited["skipped"] = clean["skipped"]
        report[(case.name, "clean")] = _differences(clean, waited)
        # boundary backwards that started the update; the second copy in the host buffers
        extra = clean["host_buffer_bytes"] - waited["host_buffer_bytes"]
        report[(case.name, "speculated")] = (
            clean["plan"],
            sum(clean["streamed"]),
            sum(waited["streamed"]),
            extra,
            clean["host_numel"],
        )
    if world_size == 1 and cases is None:  # "auto" with the CPU's step: it waits (plan_speculation)
        auto = _train(Case("bf16", "host"), rank, world_size, None)
        report["auto-host"] = (auto["plan"], sum(auto["streamed"]))
        # unchecked: the plain streamed step, no second copy made
        unchecked = _train(Case("bf16", "host"), rank, world_size, None, check=False)
        report["unchecked"] = (sum(unchecked["streamed"]), unchecked["host_buffer_bytes"])
        report["unchecked-waited"] = _train(
            Case("bf16", "host"), rank, world_size, None, check=False, speculate=False
        )["host_buffer_bytes"]
    return report


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_distributed(_grid, 1, timeout=240)[0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(_grid, 2, timeout=240)


@pytest.mark.parametrize("case", WORLD1, ids=lambda case: case.name)
def test_one_rank_checked_step_updates_during_backward_and_skips_exactly(one_rank: dict, case: Case) -> None:
    for poison in POISONS:
        differences, lrs_held = one_rank[(case.name, poison)]
        assert differences == [], poison  # as if step 3's batches had never been seen
        assert lrs_held, poison
    assert one_rank[(case.name, "clean")] == []  # a good step: the numbers of the step that waited
    plan, streamed, streamed_waiting, extra, numel = one_rank[(case.name, "speculated")]
    assert plan is True  # forced, or "auto" with the device step: this host has room for the copy
    assert (streamed, streamed_waiting) == (STEPS, 0)  # every boundary backward started the update
    assert extra == 12 * numel  # a second fp32 master and two moments


CUDA = [Case("bf16", "device"), Case("fp16", "device"), Case("bf16", "host", speculate=True)]
CUDA += [Case("bf16", "device", ratio=0.5)]


@pytest.mark.gpu
def test_cuda_checked_step_updates_during_backward_and_skips_exactly() -> None:
    """On a GPU: the device step's downloads into the second copy on their own streams, pinned, the
    working weights rewritten from the masters after the update's kernels on a skip."""
    report = run_distributed(_grid, 1, CUDA, timeout=240, device="cuda")[0]
    for case in CUDA:
        for poison in POISONS:
            assert report[(case.name, poison)] == ([], True), (case.name, poison)
        assert report[(case.name, "clean")] == [], case.name
        plan, streamed, _, extra, numel = report[(case.name, "speculated")]
        assert (plan, streamed, extra) == (True, STEPS, 12 * numel), case.name


def test_the_unchecked_step_streams_without_a_second_copy(one_rank: dict) -> None:
    streamed, buffers = one_rank["unchecked"]
    assert streamed == STEPS and buffers == one_rank["unchecked-waited"]


def test_auto_leaves_the_cpus_checked_step_waiting(one_rank: dict) -> None:
    assert one_rank["auto-host"] == (False, 0)


@pytest.mark.parametrize("case", WORLD2, ids=lambda case: case.name)
def test_two_ranks_wait_for_the_verdict_and_skip_exactly(two_ranks: list[dict], case: Case) -> None:
    for rank, report in enumerate(two_ranks):
        for poison in POISONS:
            differences, lrs_held = report[(case.name, poison)]
            assert differences == [] and lrs_held, (rank, poison)
        assert report[(case.name, "clean")] == [], rank
        plan, streamed, _, extra, _ = report[(case.name, "speculated")]
        assert (plan, streamed, extra) == (False, 0, 0), rank  # gradients land after backward


def test_the_plan_speculates_where_the_gpu_runs_the_step_and_the_host_has_room() -> None:
    from runtime.offload.plan import HOST_HEADROOM, plan_speculation

    numel, gib = 1 << 30, 1 << 30
    need = numel * (16 + 12) + HOST_HEADROOM
    kw = {"stream": True, "device_step": True, "host_share": 0.0, "state_itemsize": 4, "local_ranks": 1}
    kw["shard_numel"] = numel
    assert plan_speculation(setting=None, host_available=need, **kw)[0] is True
    on, why = plan_speculation(setting=None, host_available=need - 1, **kw)
    assert not on and why == (
        "the checked step waits for the verdict: a second copy of the state (12 bytes a parameter) would "
        f"need {need / gib:.1f} GiB of host memory and {(need - 1) / gib:.1f} GiB is available"
    )
    for cpu in ({"device_step": False}, {"host_share": 0.4}):  # the CPU's share would pay in traffic
        on, why = plan_speculation(setting=None, host_available=need * 2, **{**kw, **cpu})
        assert not on and why.startswith("the checked step waits for the verdict: the CPU runs (part of)")
    assert plan_speculation(setting=True, host_available=0, **{**kw, "device_step": False})[0]
    assert plan_speculation(setting=False, host_available=need * 2, **kw)[0] is False
    assert not plan_speculation(setting=True, host_available=need, **{**kw, "stream": False})[0]
