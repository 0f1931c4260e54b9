"""Partial optimizer offload (`offload_optimizer.ratio`): part of the optimizer on the host, the rest on the
device, and the run equals plain PyTorch.

- Parity, world 2 in one spawn: ZeRO stages 2 and 3 with ratio 0.25 and 0.5, fp32, accumulation 1 and 2,
  clipping on (AdamW: the host's one-pass Adam beside torch's AdamW on the device) and off (SGD with
  momentum on both sides: any averaging error shows in the weights), plus bf16, against the plain PyTorch
  reference of tests/runtime/zero/test_zero_parity.py (fp32: losses and weights within 1e-5); also stage 1,
  fp16, the device step and parameter offload. Ratio 0 equals the run without offload and ratio 1 the full
  offload, bit for bit, and so does ratio 0.5 without clipping. With one rank the host's share
  updates during backward.
- One norm decides for both sides: a nan on either side skips the step on both.
- A checkpoint saved with ratio 0.25 resumes with ratio 0.5, without offload, or fully offloaded.
- The delayed update is refused, word for word.

The split, the config and the choice of a ratio: tests/runtime/offload/test_ratio_plan.py.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
import torch

from tests.runtime.offload.cases import SMALL_CHUNKS, OffloadCase, read_weights, train_and_read
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch, with_offload_settings
from tests.support.parity import ROWS, STEPS, compare, reference

# -- parity on two ranks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioCase(OffloadCase):
    ratio: float | None = 1.0  # None: no offload at all (the run ratio 0 must equal)
    warmup: bool = False  # a WarmupLR schedule (its per-param-group lists cross checkpoints)

    def config(self) -> dict:
        cfg = super().config()
        if self.warmup:
            params = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}
            cfg["scheduler"] = {"type": "WarmupLR", "params": params}
        if self.ratio is None:
            del cfg["zero_optimization"]["offload_optimizer"]
        else:
            cfg["zero_optimization"]["offload_optimizer"]["ratio"] = self.ratio
        return cfg


# stage 3 with persistence 0: a gather unit per module, so the split has seven groups to choose from
PARITY = [
    RatioCase(stage, "fp32", acc, clip, ratio=ratio, persistence=0 if stage == 3 else None)
    for stage in (2, 3)
    for ratio in (0.25, 0.5)
    for acc, clip in ((1, 0.5), (2, 0.0), (2, 0.5), (1, 0.0))
] + [
    RatioCase(2, "bf16", 2, 0.5, ratio=0.5),
    RatioCase(3, "bf16", 1, 0.0, ratio=0.25),  # default persistence: one unit, two groups
    RatioCase(1, "fp32", 2, 0.5, ratio=0.5),
    RatioCase(2, "fp16", 2, 0.5, ratio=0.5),  # the loss scale on both sides, one overflow check
    # the host's share through the device step (its Adam streams the state through the "device")
    RatioCase(2, "bf16", 1, 0.5, ratio=0.5, device_step=True, host_share=0.5),
    # parameter offload: the device side's updated masters go into working shards in host memory (at
    # ratio 0 all of them, through the stage's own write-back)
    RatioCase(3, "fp32", 2, 0.5, ratio=0.5, persistence=0, offload_param=True),
    RatioCase(3, "bf16", 1, 0.0, ratio=0.0, persistence=0, offload_param=True),
]
HOST_PARAMS = {  # (stage, ratio) -> the parameters whose optimizer state is on the host (2: also stage 1)
    # stages 1 and 2 split each param group: out.weight (155 of 1211 decayed elements; 0.5: + hidden.weight,
    # 899), and the biases/norm weights whose gradients come first (36 of 122; 0.5: 67)
    (2, 0.25): ["norm.bias", "out.bias", "out.weight"],
    (2, 0.5): ["hidden.weight", "norm.bias", "norm.weight", "out.bias", "out.weight"],
    # stage 3 takes whole groups (unit x param group) in the order backward finishes them: out.bias (5),
    # out.weight (155), norm (62), hidden.bias (31): 253 of 1333, nearest to 333; 0.5 adds hidden.weight
    (3, 0.25): ["hidden.bias", "norm.bias", "norm.weight", "out.bias", "out.weight"],
    (3, 0.5): ["hidden.bias", "hidden.weight", "norm.bias", "norm.weight", "out.bias", "out.weight"],
}
SAME = [  # (ratio case, the run it must equal bit for bit, the placement the ratio case must get)
    (RatioCase(2, "fp32", 2, 0.5, ratio=0.0), RatioCase(2, "fp32", 2, 0.5, ratio=None), "DeviceMasters"),
    (RatioCase(3, "bf16", 1, 0.0, ratio=0.0), RatioCase(3, "bf16", 1, 0.0, ratio=None), "DeviceMasters"),
    (RatioCase(2, "fp32", 1, 0.5, ratio=1.0), OffloadCase(2, "fp32", 1, 0.5), "HostMasters"),
    (
        RatioCase(3, "fp32", 2, 0.0, ratio=1.0, persistence=0),
        OffloadCase(3, "fp32", 2, 0.0, persistence=0),
        "HostMasters",
    ),
    # without a norm to add up, the split changes no arithmetic: ratio 0.5 is the run without offload
    (
        RatioCase(2, "fp32", 2, 0.0, ratio=0.5, adam_without_clip=True),
        RatioCase(2, "fp32", 2, 0.0, ratio=None, adam_without_clip=True),
        "PartialMasters",
    ),
    (
        RatioCase(3, "fp32", 1, 0.0, ratio=0.5, adam_without_clip=True, persistence=0),
        RatioCase(3, "fp32", 1, 0.0, ratio=None, adam_without_clip=True, persistence=0),
        "PartialMasters",
    ),
]


def _engine(case: OffloadCase, world_size: int):
    import runtime

    model = make_model(0)
    if getattr(case, "ratio", 1.0) is None:
        config = case.config()
    else:
        config = with_offload_settings(case.config(), world_size=world_size, **SMALL_CHUNKS)
    engine, _, _, _ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _host_params(engine) -> list[str]:
    split = getattr(engine.masters, "split", None)
    if split is None:
        return []
    return sorted(name for i in split.host for name in engine.groups[i].param_names)


def _train(case: OffloadCase, rank: int, world_size: int) -> dict:
    engine = _engine(case, world_size)
    placement, host = type(engine.masters).__name__, _host_params(engine)
    streams = placement == "PartialMasters" and engine.masters.host.grads.stream
    out = train_and_read(engine, case, rank, world_size)
    steps = _adam_steps(engine)
    host_bytes = None
    if placement == "PartialMasters":  # the memory report counts the host's masters and state only
        held = _state_bytes(engine, engine.masters.split.host)
        if case.offload_param:  # and the working shards that live there
            held += engine.zero.host_param_bytes()
        host_bytes = (engine.memory_breakdown().host_bytes, held)
    if streams:  # one more boundary backward: did the host's share start updating during it?
        x, y = rank_batch(STEPS, 0, ROWS, rank, world_size)
        for micro in range(case.accumulation):
            engine.backward(loss_fn(engine(x), y))
            if micro < case.accumulation - 1:
                engine.step()  # counts the micro-step
        streams = engine.masters.host._streamed is not None
        engine.step()
    engine.destroy()
    return {
        **out,
        "placement": placement,
        "host": host,
        "streams": streams,
        "steps": steps,
        "host_bytes": host_bytes,
    }


def _state_bytes(engine, positions) -> int:
    """Master and optimizer state bytes of the groups at `positions`."""
    total = 0
    for i in positions:
        master = engine.groups[i].master
        tensors = [master, *engine.optimizer.state[master].values()]
        total += sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
    return total


def _adam_steps(engine) -> set[float]:
    """Every master's Adam step count (the host's and the device's masters alike)."""
    return {float(state["step"]) for state in engine.optimizer.state.values() if "step" in state}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run_parity(rank: int, world_size: int, cases: list[OffloadCase]) -> dict:
    report: dict = {"parity": {}, "same": {}}
    logger = logging.getLogger("runtime.offload")
    for case in cases:
        lines = _Lines()
        logger.addHandler(lines)
        logger.setLevel(logging.INFO)
        got = _train(case, rank, world_size)
        logger.removeHandler(lines)
        got["log"] = [line for line in lines.lines if "ratio" in line]
        if rank == 0:
            report["parity"][str(asdict(case))] = (case, compare(case, got, reference(case)), got)
    if world_size == 1:  # the delayed update with a ratio below 1: refused, saying why
        from runtime.offload import enable_delayed_update

        engine = _engine(cases[0], world_size)
        with pytest.raises(ValueError) as refused:
            enable_delayed_update(engine)
        engine.destroy()
        report["delayed"] = str(refused.value)
    for case, other, placement in SAME if world_size == 2 else []:
        got, want = _train(case, rank, world_size), _train(other, rank, world_size)
        if rank == 0:
            report["same"][str(asdict(case))] = (placement, got, want)
    return report


def _check_parity(report: dict) -> None:
    failures = {key: problems for key, (_, problems, _) in report["parity"].items() if problems}
    assert not failures, "\n".join(f"{key}: {problems}" for key, problems in failures.items())
    for key, (case, _, got) in report["parity"].items():
        if case.ratio == 0.0:  # nothing on the host: the plain placement
            assert (got["placement"], got["host"], got["host_bytes"]) == ("DeviceMasters", [], None), key
            continue
        assert got["placement"] == "PartialMasters", (key, got["placement"])
        reported, held = got["host_bytes"]
        assert reported == held > 0, (key, reported, held)
        if case.stage < 3 or case.persistence == 0:
            assert got["host"] == HOST_PARAMS[max(case.stage, 2), case.ratio], (key, got["host"])
        else:  # one unit: its no-decay group (122 elements) is the only one ready first
            assert got["host"] == ["hidden.bias", "inp.bias", "norm.bias", "norm.weight", "out.bias"]
        if case.optimizer == "AdamW":  # every master stepped once per step, on either side
            assert got["steps"] == {float(STEPS)}, (key, got["steps"])


def test_partial_offload_matches_plain_pytorch_on_two_ranks() -> None:
    report = run_distributed(_run_parity, 2, PARITY, timeout=240)[0]
    assert len(report["parity"]) == len(PARITY) and len(report["same"]) == len(SAME)
    _check_parity(report)
    for key, (placement, got, want) in report["same"].items():
        assert got["placement"] == placement, (key, got["placement"])
        assert got["losses"] == want["losses"], key
        assert got["norms"] == want["norms"], key
        for name, tensor in want["master"].items():
            assert torch.equal(got["master"][name], tensor), (key, name)
            assert torch.equal(got["working"][name], want["working"][name]), (key, name)


STREAMED = [  # one rank: the host's share updates during backward as its buckets land (no norm needed)
    RatioCase(2, "fp32", 1, 0.0, ratio=0.5, adam_without_clip=True),
    RatioCase(1, "fp32", 2, 0.0, ratio=0.25, adam_without_clip=True),
    RatioCase(1, "fp32", 2, 0.5, ratio=0.5),  # clipping: after backward, one norm for both sides
    RatioCase(3, "fp32", 1, 0.0, ratio=0.5, adam_without_clip=True, persistence=0),  # a group per unit
]


def test_partial_offload_streams_the_host_share_with_one_rank() -> None:
    report = run_distributed(_run_parity, 1, STREAMED, timeout=240)[0]
    assert len(report["parity"]) == len(STREAMED)
    _check_parity(report)
    for key, (case, _, got) in report["parity"].items():
        assert got["streams"] == (case.clip == 0), key
    assert report["delayed"] == (
        "the delayed parameter update needs all of the optimizer on the host, and "
        "zero_optimization.offload_optimizer.ratio is 0.5: the host's share would be updated from gradients "
        "one step stale while the device's share is current. Set the ratio to 1.0, or train without the "
        "delayed update"
    )
    # the split, once, in numbers: stage 2 at 0.5 puts 899 of 1211 decayed and 67 of 122 other elements
    # on the host (966 of 1333: 0.725)
    _, _, first = next(iter(report["parity"].values()))
    assert first["log"] == [
        "offload: zero_optimization.offload_optimizer.ratio 0.5: 2 flat group(s) on the host, 2 on the "
        "device; this rank's optimizer shard: 966 elements on the host (11.3 KiB of master and Adam "
        "moments), 367 on the device (4.3 KiB); achieved share on the host 0.725 (whole parameters go to "
        "one side)"
    ]


# -- one decision for both sides -------------------------------------------------------------------------

POISONED = {"out.weight": "host", "inp.weight": "device"}  # where each one's state is at ratio 0.25
BAD_STEP = 2  # 0-based


def _poisoned_run(rank: int, world_size: int, name: str | None) -> dict:
    """Five bf16 steps; at BAD_STEP the last rank's gradient of `name` is nan (None: the step is left
    out, the reference)."""
    case = RatioCase(2, "bf16", 1, 0.5, ratio=0.25)
    engine = _engine(case, world_size)
    params = dict(engine.module.named_parameters())
    for step in range(5):
        handle = None
        if step == BAD_STEP and name is None:
            continue
        if step == BAD_STEP and rank == world_size - 1:
            handle = params[name].register_hook(lambda grad: grad * float("nan"))
        x, y = rank_batch(step, 0, ROWS, rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        if handle is not None:
            handle.remove()
    state = engine.optimizer.state_dict()["state"]
    out = {
        "master": engine.full_state_dict(rank0_only=False),
        "state": {f"{i}.{key}": v.clone() for i, values in state.items() for key, v in values.items()},
        "skipped": engine.skipped_steps,
        "host": _host_params(engine),
    }
    engine.destroy()
    return out


def _run_poisoned(rank: int, world_size: int) -> dict:
    reference = _poisoned_run(rank, world_size, None)
    report = {}
    for name in POISONED:
        got = _poisoned_run(rank, world_size, name)
        same = all(torch.equal(got[part][key], value) for part in ("master", "state")
                   for key, value in reference[part].items())  # fmt: skip
        report[name] = (got["skipped"], same, name in got["host"])
    return report


def test_a_nan_on_either_side_skips_the_step_on_both() -> None:
    """A non-finite gradient in the host's share or in the device's: both sides skip the step (one norm
    decides), on both ranks, and the run ends where the run without that step does, bit for bit."""
    reports = run_distributed(_run_poisoned, 2, timeout=240)
    for report in reports:
        assert report == {name: (1, True, side == "host") for name, side in POISONED.items()}


# -- checkpoints across ratios ---------------------------------------------------------------------------

RESUME = [  # (case saved from, ratio to load with: None is no offload); the LR still warming up
    (RatioCase(2, "fp32", 1, 0.5, ratio=0.25, warmup=True), 0.5),
    (RatioCase(2, "fp32", 2, 0.5, ratio=0.25, warmup=True), None),
    (RatioCase(2, "fp32", 1, 0.5, ratio=0.25, warmup=True), 0.25),  # the same ratio: bit for bit
    (RatioCase(3, "fp32", 1, 0.5, ratio=0.25, persistence=0, warmup=True), 0.5),
    (RatioCase(3, "fp32", 2, 0.5, ratio=0.5, persistence=0, warmup=True), 1.0),
]
RESUME_STEPS, SAVED_AT = 6, 3


def _steps(engine, case: OffloadCase, first: int, last: int, rank: int, world_size: int) -> list[float]:
    """Train steps first..last-1 on the global batches of tests/support/models.py; this rank's losses."""
    losses = []
    for step in range(first, last):
        for micro in range(case.accumulation):
            x, y = rank_batch(step, micro, ROWS, rank, world_size)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _full_state(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every parameter's whole fp32 master and Adam moments, wherever they live (collective)."""
    from runtime.deepspeed_api.params import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        name: (
            safe_get_full_fp32_param(param),
            safe_get_full_optimizer_state(param, "exp_avg"),
            safe_get_full_optimizer_state(param, "exp_avg_sq"),
        )
        for name, param in engine.module.named_parameters()
    }


def _run_resume(rank: int, world_size: int, root: str) -> list:
    results = []
    for index, (saved, ratio) in enumerate(RESUME):
        loading = replace(saved, ratio=ratio)
        engine = _engine(loading, world_size)
        straight = _steps(engine, loading, 0, RESUME_STEPS, rank, world_size)
        want, _, _ = read_weights(engine, loading.stage)
        want_lrs = {group["lr"] for group in engine.optimizer.param_groups}
        engine.destroy()

        engine = _engine(saved, world_size)
        losses = _steps(engine, saved, 0, SAVED_AT, rank, world_size)
        engine.save_checkpoint(f"{root}/case{index}")
        state_saved = _full_state(engine)
        engine.destroy()

        engine = _engine(loading, world_size)
        engine.load_checkpoint(f"{root}/case{index}")
        placement = type(engine.masters).__name__
        state_loaded = _full_state(engine)
        same_state = state_saved.keys() == state_loaded.keys() and all(
            torch.equal(a, b)
            for key in state_saved
            for a, b in zip(state_saved[key], state_loaded[key], strict=True)
        )
        losses += _steps(engine, loading, SAVED_AT, RESUME_STEPS, rank, world_size)
        got, _, _ = read_weights(engine, loading.stage)
        steps = _adam_steps(engine)
        lrs = {group["lr"] for group in engine.optimizer.param_groups}
        engine.destroy()
        if rank == 0:
            counts = (steps, lrs, want_lrs)
            results.append((saved, ratio, placement, same_state, straight, losses, want, got, counts))
    return results


def test_checkpoint_saved_with_one_ratio_resumes_with_another(tmp_path: Path) -> None:
    """Saved with ratio 0.25 (or 0.5), loaded with 0.5, without offload, or with all of it on the host:
    every parameter's master and Adam moments after the load are bit for bit those that were saved,
    every master's Adam step count is the number of steps taken, the LR schedule goes on where it was
    (its per-group lists regrouped: 2, 4 or 7 optimizer groups), and the resumed run continues the
    straight run at the loading ratio: bit for bit at the same ratio, else within 1e-6 (with groups
    split differently the clipping norm's squares add up in another order, which rounds the clip factor
    differently in the last bit; runs without clipping are bit for bit the same at any ratio)."""
    results = run_distributed(_run_resume, 2, str(tmp_path), timeout=300)[0]
    assert len(results) == len(RESUME)
    placements = {0.25: "PartialMasters", 0.5: "PartialMasters", None: "DeviceMasters", 1.0: "HostMasters"}
    for saved, ratio, placement, same_state, straight, losses, want, got, counts in results:
        where = f"stage {saved.stage}, saved with ratio {saved.ratio}, loaded with {ratio}"
        assert placement == placements[ratio], where
        assert same_state, where
        steps, lrs, want_lrs = counts
        assert steps == {float(RESUME_STEPS)}, (where, steps)
        assert lrs == want_lrs and len(lrs) == 1, (where, lrs, want_lrs)  # every group where the schedule is
        if ratio == saved.ratio:
            assert losses == straight, where
            assert all(torch.equal(got[name], tensor) for name, tensor in want.items()), where
            continue
        assert losses == pytest.approx(straight, rel=1e-6, abs=0), where
        for name, tensor in want.items():
            assert torch.allclose(got[name], tensor, rtol=1e-6, atol=1e-7), (where, name)


# -- on a GPU --------------------------------------------------------------------------------------------


def _gpu_partial_vs_device(rank: int, world_size: int, stage: int, clip: float, update: str, param: bool):
    """bf16 GPT on CUDA: Adam on the device, then twice ratio 0.5, same data; relative update gaps, and
    where each side's state lives."""
    import runtime
    from runtime.models import GPT, GPTConfig

    results, where = [], {}
    for ratio in (None, 0.5, 0.5):
        torch.manual_seed(0)
        model = GPT(GPTConfig.named("tiny"))
        start = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        zero = {"stage": stage, "reduce_bucket_size": 20_000, "stage3_param_persistence_threshold": 0}
        if ratio is not None:
            offload = {"device": "cpu", "pin_memory": True, "ratio": ratio, "update": update}
            zero["offload_optimizer"] = offload
            if param:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config = {
            "train_batch_size": 4,
            "steps_per_print": 0,
            "gradient_clipping": clip,
            "bf16": {"enabled": True, "check_grad_overflow": clip > 0},  # streamed without clipping
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": zero,
        }
        engine, *_ = runtime.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            tokens = torch.randint(0, 256, (4, 65), generator=gen).to(engine.device)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        if ratio is not None:
            masters = engine.masters
            host = [engine.groups[i].master for i in masters.split.host]
            device = [g.master for g in masters.device_groups]
            where = {
                "placement": type(masters).__name__,
                "host": {t.device.type for t in host},
                "host_pinned": all(t.is_pinned() for t in host) if masters.update_on_device else True,
                "device": {t.device.type for t in device},
                "device_state": {
                    v.device.type for t in device for v in engine.optimizer.state[t].values() if v.dim() > 0
                },
            }
        results.append((start, {k: v.float().cpu() for k, v in engine.full_state_dict().items()}))
        engine.destroy()
    (start, ref), (_, got), (_, again) = results
    update_norm = torch.stack([(ref[n] - start[n]).norm() for n in start]).norm()
    total = torch.stack([(got[n] - ref[n]).norm() for n in start]).norm() / update_norm
    return {"total": float(total), "repeatable": all(torch.equal(got[n], again[n]) for n in start), **where}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("stage", "clip", "update", "param"),
    [(2, 1.0, "auto", False), (2, 0.0, "auto", False), (2, 1.0, "host", False), (3, 1.0, "auto", True)],
    ids=["stage2-clipped", "stage2-streamed", "stage2-host-step", "stage3-param-offload"],
)
def test_cuda_partial_offload_matches_device_adam(stage: int, clip: float, update: str, param: bool) -> None:
    """On a GPU, ratio 0.5: the device's share (masters and moments) on the GPU, the host's in host
    memory, and the result equals Adam on the device within the drift of tests/runtime/offload/test_step.py's
    CUDA
    test (bf16 roundings of two fp32 paths), the same in two runs."""
    args = (stage, clip, update, param)
    got = run_distributed(_gpu_partial_vs_device, 1, *args, timeout=240, device="cuda")[0]
    assert got["placement"] == "PartialMasters"
    assert (got["host"], got["device"], got["device_state"]) == ({"cpu"}, {"cuda"}, {"cuda"}), got
    assert got["host_pinned"], got
    assert got["repeatable"], "two partially offloaded runs with the same data ended with different weights"
    assert got["total"] < 0.05, f"the run differs from Adam on the device by {got['total']:.2e}"
