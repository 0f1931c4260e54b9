"""A step whose gradients are not finite is skipped on every rank, in every precision and ZeRO stage.

One 2-rank gloo world runs the grid: fp32, bf16 and fp16 at ZeRO stages 0-3, CPU offload at stage 2
with the host step and with the device step (which runs on the CPU here, the same chunks and kernels),
and the fused master step (runtime/precision/fused_master.py, the CUDA default, which skips inside its
kernel: the verdict is read after the launch) at bf16 ZeRO-1 and fp16 ZeRO-3.
In each case the last rank's loss is multiplied by nan (and, in a second run, by 1e30) at step 3 only;
the run must end with the same fp32 masters, working weights and optimizer state (Adam's moments and
step count), on every rank, as the same engine trained on the same batches without step 3. The LR
scheduler (WarmupLR, still rising) must not advance on the skipped step, as DeepSpeed does for skipped
fp16 steps. fp16 keeps its loss scaler (hysteresis 2: the one overflow does not lower the scale).

Then: 3 non-finite steps in a row with `bf16.max_consecutive_nonfinite_steps: 3` stop training on every
rank with `NonfiniteGradientsError` (message and hint checked); rank 0 warned once per skipped step,
naming it. fp16 with fp32 inputs fails with a clear error from the engine's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch

STEPS = 5
BAD_STEP = 3  # 1-based, as the engine counts steps in its messages
ROWS = 4  # global rows per step
WORLD = 2
POISONS = {"nan": float("nan"), "1e30": 1e30}  # what the last rank's loss is multiplied by


@dataclass(frozen=True)
class Case:
    dtype: str
    stage: int
    offload: str = "none"  # "host": the CPU runs the offloaded Adam step; "device": the device step
    fused: bool = False  # the fused master step (DSLAUNCH_FUSED_MASTER_STEP=1), which skips in its kernel

    @property
    def name(self) -> str:
        return (
            f"{self.dtype}-stage{self.stage}"
            + ("" if self.offload == "none" else f"-offload-{self.offload}")
            + ("-fused" if self.fused else "")
        )

    def config(self, **bf16: Any) -> dict:
        zero: dict = {"stage": self.stage, "reduce_bucket_size": 700}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0  # every module is gathered and released
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": "cpu", "update": self.offload}
        cfg: dict = {
            "train_batch_size": ROWS,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10},
            },
            "zero_optimization": zero,
        }
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True, **bf16}
        elif bf16:
            cfg["bf16"] = {"enabled": False, **bf16}  # the bf16 section's skip keys govern fp32 too
        if self.dtype == "fp16":
            cfg["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 8}
        return cfg


CASES = [Case(dtype, stage) for dtype in ("fp32", "bf16", "fp16") for stage in (0, 1, 2, 3)] + [
    Case("bf16", 2, "host"),
    Case("bf16", 2, "device"),
    Case("bf16", 1, fused=True),
    Case("fp16", 3, fused=True),
]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _optimizer_state(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's optimizer state tensors by (param index, key)."""
    state = engine.optimizer.state_dict()["state"]
    return {
        f"{index}.{key}": value.clone() for index, values in state.items() for key, value in values.items()
    }


def _train(case: Case, rank: int, world_size: int, *, poison: float | None, bad_steps: set[int], **bf16: Any):
    """Train STEPS steps; on `bad_steps` the last rank's loss is multiplied by `poison`, or (poison None)
    the step's batch is left out entirely (the reference)."""
    import os

    import runtime

    if case.fused:  # the CPU's default is torch's step
        os.environ["DSLAUNCH_FUSED_MASTER_STEP"] = "1"
    placement, said = logging.getLogger("runtime.offload.placement"), _Records()
    said.setLevel(logging.INFO)
    placement.addHandler(said)
    placement.setLevel(logging.INFO)
    model = make_model(0)
    engine, _, _, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=case.config(**bf16)
    )
    out: dict = {"lrs": [], "norms": []}
    try:
        for step in range(1, STEPS + 1):
            if poison is None and step in bad_steps:
                continue
            x, y = rank_batch(step, 0, ROWS, rank, world_size)
            loss = loss_fn(engine(x), y)
            if poison is not None and step in bad_steps and rank == world_size - 1:
                loss = loss * poison
            engine.backward(loss)
            engine.step()
            out["lrs"].append(engine.get_lr()[0])
            out["norms"].append(engine.get_global_grad_norm())
    except Exception as error:
        out["error"] = (type(error).__name__, str(error), getattr(error, "hint", None), engine.global_steps)
    finally:
        os.environ.pop("DSLAUNCH_FUSED_MASTER_STEP", None)
        placement.removeHandler(said)
    out["fused"] = any("one fused pass" in message for message in said.messages)
    out["master"] = engine.full_state_dict(rank0_only=False)
    with runtime.zero.GatheredParameters(list(engine.module.parameters())):  # whole under stage 3
        out["working"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    out["optimizer"] = _optimizer_state(engine)
    out["skipped"] = engine.skipped_steps
    out["loss_scale"] = engine.loss_scale
    engine.destroy()
    return out


def _differences(got: dict, want: dict) -> list[str]:
    problems = []
    for part in ("master", "optimizer"):
        for key, value in want[part].items():
            if not torch.equal(got[part][key], value):
                diff = float((got[part][key].float() - value.float()).abs().max())
                problems.append(f"{part} {key} differs by {diff:.3e}")
    if got["working"].keys() != want["working"].keys():
        problems.append("working weights differ in names")
    else:  # stage 3 keeps released (empty) parameters: compare what is there
        problems.extend(
            f"working {k}" for k, v in want["working"].items() if not torch.equal(got["working"][k], v)
        )
    return problems


def _grid(rank: int, world_size: int) -> dict:
    handler = _Records()
    logger = logging.getLogger("runtime")
    logger.addHandler(handler)
    report: dict = {}
    try:
        for case in CASES:
            reference = _train(case, rank, world_size, poison=None, bad_steps={BAD_STEP})
            for poison, factor in POISONS.items():
                handler.messages.clear()
                got = _train(case, rank, world_size, poison=factor, bad_steps={BAD_STEP})
                report[(case.name, poison)] = {
                    "error": got.get("error"),
                    "skipped": got["skipped"],
                    "fused": got["fused"],
                    "differences": _differences(got, reference),
                    "finite": all(v.isfinite().all() for v in got["master"].values()),
                    # the skipped step leaves the LR where it was; the reference never saw that step
                    "lrs": (got["lrs"][BAD_STEP - 1], got["lrs"][BAD_STEP - 2], got["lrs"][BAD_STEP:]),
                    "reference_lrs": reference["lrs"][BAD_STEP - 1 :],
                    "skipped_norm": got["norms"][BAD_STEP - 1],
                    "loss_scale": (got["loss_scale"], reference["loss_scale"]),
                    "warnings": list(handler.messages),
                }

        # three bad steps in a row stop the job at the third, on every rank, with the error
        handler.messages.clear()
        stop = _train(
            Case("bf16", 2), rank, world_size, poison=float("nan"), bad_steps={2, 3, 4},
            max_consecutive_nonfinite_steps=3,
        )  # fmt: skip
        report["stop"] = {
            "error": stop.get("error"),
            "warnings": list(handler.messages),
            "skipped": stop["skipped"],
        }
        # the same without the check (DeepSpeed's bf16 default): the step is applied, the weights are NaN
        unchecked = _train(
            Case("fp32", 1),
            rank,
            world_size,
            poison=float("nan"),
            bad_steps={BAD_STEP},
            check_grad_overflow=False,
        )
        report["unchecked"] = {
            "skipped": unchecked["skipped"],
            "finite": all(v.isfinite().all() for v in unchecked["master"].values()),
        }
    finally:
        logger.removeHandler(handler)
    return report


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return run_distributed(_grid, WORLD, timeout=240)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_nonfinite_step_is_skipped_on_every_rank(grid: list[dict], case: Case, poison: str) -> None:
    for rank, report in enumerate(grid):
        got = report[(case.name, poison)]
        where = f"rank {rank}"
        assert got["error"] is None, where
        assert got["fused"] == case.fused, where  # the step under test ran
        assert got["skipped"] == 1, where
        # weights, masters, Adam's moments and step count equal a run that never saw step 3
        assert got["differences"] == [], where
        assert got["finite"], where
        skipped_lr, lr_before, lrs_after = got["lrs"]
        assert skipped_lr == lr_before, where  # the scheduler did not advance on the skipped step
        assert lrs_after == got["reference_lrs"], where
        assert not torch.isfinite(torch.tensor(got["skipped_norm"])), where
        assert got["loss_scale"][0] == got["loss_scale"][1], where
    warnings = grid[0][(case.name, poison)]["warnings"]
    if case.dtype == "fp16":  # the skip is said, with the scale (hysteresis 2: it stays)
        assert warnings == [
            f"step {BAD_STEP}: fp16 gradients overflowed; the step was skipped on every rank (loss scale "
            "stays 256: 1 overflow(s) of hysteresis left)"
        ]
    else:
        assert len(warnings) == 1 and warnings[0].startswith(f"step {BAD_STEP}: the global gradient norm is ")
        assert "skipped on every rank" in warnings[0] and "1 consecutive skipped step(s)" in warnings[0]
        # the key that limits them, named for what governs this precision (no fp32 section exists)
        key = "(bf16.max_consecutive_nonfinite_steps, which governs fp32 runs too)"
        assert warnings[0].endswith(key if case.dtype == "fp32" else "(bf16.max_consecutive_nonfinite_steps)")
    assert grid[1][(case.name, poison)]["warnings"] == []  # rank 0 only


def test_consecutive_nonfinite_steps_stop_training_on_every_rank(grid: list[dict]) -> None:
    for rank, report in enumerate(grid):
        kind, message, hint, steps_done = report["stop"]["error"]
        assert kind == "NonfiniteGradientsError", rank
        assert steps_done == 3 and report["stop"]["skipped"] == 3, rank  # stopped at the third bad step
        assert message == (
            "step 4: 3 consecutive steps (from step 2) had a non-finite gradient norm (last: nan) and were "
            "skipped; training stopped (bf16.max_consecutive_nonfinite_steps=3)"
        )
        assert "\n" not in message
        assert hint.startswith("set gradient_clipping (e.g. 1.0) or lower the learning rate")
        assert hint.endswith("the weights are still those from before step 2")
    warnings = grid[0]["stop"]["warnings"]
    assert [w.split(":")[0] for w in warnings] == ["step 2", "step 3", "step 4"]
    assert "3 consecutive skipped step(s), training stops at 3" in warnings[-1]


def test_without_the_check_a_nan_step_is_applied(grid: list[dict]) -> None:
    """bf16.check_grad_overflow: false is DeepSpeed's bf16 behaviour: the step goes through."""
    for report in grid:
        assert report["unchecked"] == {"skipped": 0, "finite": False}


def _one_rank_offload(rank: int, world_size: int) -> dict:
    """With one rank and no clipping the checked offloaded step may start during backward, before the
    verdict (the host step waits for it; the device step updates into a second copy and drops it on a bad
    step: runtime/offload/step/speculative.py); either way the skipped step equals a run without it."""
    report = {}
    for case in (Case("bf16", 2, "host"), Case("fp32", 1, "device")):
        reference = _train(case, rank, world_size, poison=None, bad_steps={BAD_STEP})
        got = _train(case, rank, world_size, poison=float("nan"), bad_steps={BAD_STEP})
        report[case.name] = (got["skipped"], _differences(got, reference))
    return report


def test_one_rank_offload_skips_a_nonfinite_step_exactly_waiting_or_speculating() -> None:
    report = run_distributed(_one_rank_offload, 1, timeout=120)[0]
    assert report == {"bf16-stage2-offload-host": (1, []), "fp32-stage1-offload-device": (1, [])}


def test_a_clean_step_resets_the_count_and_zero_means_no_limit() -> None:
    from runtime.precision.nonfinite import NonfiniteGradientsError, SkipNonfinite

    class Log:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def nonfinite(self, step: int, norm: float, consecutive: int, limit: int, key: str = "") -> None:
            self.calls.append((step, str(norm), consecutive, limit))

        def overflow(self, *args: Any) -> None:
            raise AssertionError("not fp16")

    guard, log = SkipNonfinite(limit=2), Log()
    guard.skipped(step=5, norm=torch.tensor(float("inf")), log=log)
    guard.applied(step=6)  # a clean step resets the count
    guard.skipped(step=7, norm=torch.tensor(float("nan")), log=log)
    with pytest.raises(NonfiniteGradientsError) as info:
        guard.skipped(step=8, norm=torch.tensor(float("inf")), log=log)
    assert log.calls == [(5, "inf", 1, 2), (7, "nan", 1, 2), (8, "inf", 2, 2)]
    assert str(info.value).startswith("step 8: 2 consecutive steps (from step 7)")
    assert info.value.hint.endswith("before step 7")
    never = SkipNonfinite(limit=0)
    for step in range(100):
        never.skipped(step=step, norm=torch.tensor(float("nan")), log=log)
    assert never.consecutive == 100


def test_every_skipped_fp16_step_is_said_and_fp32_names_the_key_that_governs_it() -> None:
    from runtime.precision.errors import LossScaleError
    from runtime.precision.loss_scaler import DynamicLossScaler
    from runtime.precision.nonfinite import LossScaling, NonfiniteGradientsError, SkipNonfinite
    from tests.support.logs import captured_log

    class Log:
        def overflow(self, *args: Any) -> None:
            pass

        def nonfinite(self, *args: Any, **kwargs: Any) -> None:
            pass

    # a scale of 2**18 that overflows every step reaches min_loss_scale at the 18th skip, hysteresis 1:
    # every skip was silent with steps_per_print 0
    guard = LossScaling(DynamicLossScaler(initial_scale_power=18, hysteresis=1))
    with captured_log("runtime", logging.WARNING) as said:
        for step in range(1, 19):
            guard.skipped(step=step, norm=None, log=Log())
        with pytest.raises(LossScaleError):
            guard.skipped(step=19, norm=None, log=Log())
    assert len(said) == 18
    assert said[0] == (
        "step 1: fp16 gradients overflowed; the step was skipped on every rank (loss scale 262144 -> 131072)"
    )
    # a long run of overflows is reported one in a hundred after the first twenty
    guard = LossScaling(DynamicLossScaler(initial_scale_power=16, hysteresis=1, min_scale=2.0**-300))
    with captured_log("runtime", logging.WARNING) as said:
        for step in range(1, 251):
            guard.skipped(step=step, norm=None, log=Log())
    assert len(said) == 22
    assert said[19].endswith("; further skipped steps are reported once every 100")
    assert said[20].startswith("step 100: ") and said[21].endswith("(200 skipped steps so far)")
    fp32 = SkipNonfinite(limit=1, precision="fp32")
    with pytest.raises(NonfiniteGradientsError) as info:
        fp32.skipped(step=4, norm=torch.tensor(float("nan")), log=Log())
    assert str(info.value).endswith("(bf16.max_consecutive_nonfinite_steps=1, which governs fp32 runs too)")


def test_config_keys_and_defaults() -> None:
    from runtime.config import ConfigError, load_config

    base = {"train_batch_size": 2}
    cfg = load_config(base, world_size=1)
    assert (cfg.bf16.check_grad_overflow, cfg.bf16.max_consecutive_nonfinite_steps) == (True, 10)
    cfg = load_config(
        {
            **base,
            "bf16": {"enabled": True, "check_grad_overflow": False, "max_consecutive_nonfinite_steps": 0},
        },
        world_size=1,
    )
    assert (cfg.bf16.check_grad_overflow, cfg.bf16.max_consecutive_nonfinite_steps) == (False, 0)
    with pytest.raises(ConfigError, match=r"bf16\.max_consecutive_nonfinite_steps"):
        load_config({**base, "bf16": {"max_consecutive_nonfinite_steps": -1}}, world_size=1)
