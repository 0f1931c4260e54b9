"""The fused master step (runtime/precision/fused_master.py): fp32 masters behind 16-bit working weights,
updated from the 16-bit gradients and cast back into the weights (ZeRO-3: each rank's working shard) in
one pass. The default on CUDA
devices with Triton; these tests turn it on for the CPU with `DSLAUNCH_FUSED_MASTER_STEP=1` (dynamo traces
the same function there, with the eager backend) and compare with the same run through torch's own AdamW
step (`=0`); the `gpu` test compares the default on CUDA (inductor's kernel) with `=0`.

What a user relies on: it trains to the same masters, moments and losses as torch's step, at ZeRO 0-3 on
one rank and 1-2 on two (several buckets, so shards are not contiguous), in bf16 and fp16 (loss scaling),
with clipping, weight-decay groups, Adam and AdamW and a changing learning rate; its optimizer state is
torch's, so a checkpoint written with one step resumes with the other and a `load_state_dict` mid-run is
honoured; an optimizer it does not cover keeps its own step, and forcing it then says why.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch

ENV = "DSLAUNCH_FUSED_MASTER_STEP"


FP16 = {"initial_scale_power": 8, "auto_cast": True}


def _config(precision: str, zero: dict[str, Any], *, clip: float = 0.0, opt: str = "AdamW") -> dict[str, Any]:
    return {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        precision: {"enabled": True, **(FP16 if precision == "fp16" else {})},
        "zero_optimization": zero,
        "gradient_clipping": clip,
        "optimizer": {"type": opt, "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3},
        },
        "steps_per_print": 0,
    }


def _steps(engine: Any, steps: range, rank: int, world_size: int) -> list[float]:
    """Train `engine` on this rank's part of the global batches of `steps` (2 micro-steps each)."""
    losses = []
    for step in steps:
        for micro in range(2):
            x, y = (t.to(engine.device) for t in rank_batch(step, micro, 8, rank, world_size))
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _train(
    fused: bool | None, config: dict[str, Any], rank: int, world_size: int, steps: int = 4
) -> dict[str, Any]:
    """One run: `fused` True sets the switch to 1, False to 0, None leaves it unset (the default)."""
    import runtime

    if fused is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = "1" if fused else "0"
    log: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: log.append(record.getMessage())  # type: ignore[method-assign]
    names = ("runtime.offload.placement", "runtime.precision.fused_master")
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        model = make_model(0)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        losses = _steps(engine, range(steps), rank, world_size)
        state = engine.optimizer.state_dict()["state"]
        moments = [v["exp_avg_sq"].clone() for _, v in sorted(state.items())]
        params = list(engine.module.parameters())
        with runtime.zero.GatheredParameters(params):  # ZeRO-3 over two ranks: each holds a shard
            working = [p.detach().cpu().clone() for p in params]
        return {
            "losses": losses,
            "masters": [g.master.detach().cpu().clone() for g in engine.groups],
            "working": working,
            "moments": [m.cpu() for m in moments],
            "steps": [float(v["step"]) for v in state.values()],
            "log": log,
        }
    finally:
        os.environ.pop(ENV, None)
        for logger in loggers:
            logger.removeHandler(handler)


def _assert_same(fused: dict[str, Any], plain: dict[str, Any]) -> None:
    assert any("one fused pass" in line for line in fused["log"]), fused["log"]  # it really ran
    assert not any("one fused pass" in line for line in plain["log"])
    assert fused["steps"] == plain["steps"]
    torch.testing.assert_close(fused["losses"], plain["losses"], rtol=1e-4, atol=1e-5)
    for a, b in zip(fused["masters"], plain["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
    for a, b in zip(fused["moments"], plain["moments"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-9)
    for a, b in zip(fused["working"], plain["working"], strict=True):  # the cast of equal masters
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3)


CASES = [
    ("bf16", {"stage": 0}, 0.0, "AdamW"),
    ("bf16", {"stage": 1}, 1.0, "AdamW"),
    ("bf16", {"stage": 2}, 0.0, "Adam"),
    ("bf16", {"stage": 3}, 0.5, "AdamW"),
    ("fp16", {"stage": 2}, 1.0, "AdamW"),
]


@pytest.mark.parametrize(("precision", "zero", "clip", "opt"), CASES, ids=lambda c: str(c))
def test_one_rank_equals_torch_step(precision: str, zero: dict, clip: float, opt: str) -> None:
    """Device: CPU. Same masters, moments, weights and losses as torch's AdamW/Adam over 4 steps of 2
    micro-steps, with the scheduler moving the learning rate."""
    [result] = run_distributed(_both, 1, _config(precision, zero, clip=clip, opt=opt))
    _assert_same(result["fused"], result["plain"])
    # the first step's pause is explained, once: it compiled one graph of every segment
    built = [line for line in result["fused"]["log"] if "segments built in" in line]
    assert len(built) == 1 and built[0].startswith("fused optimizer step: its graph of "), built


def _both(rank: int, world_size: int, config: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    return {
        "fused": _train(True, config, rank, world_size, steps),
        "plain": _train(False, config, rank, world_size, steps),
    }


def _both_in_small_runs(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    from runtime.precision import fused_master

    os.environ["DSLAUNCH_AUTOGRAD_GRADS"] = "1"  # one gradient tensor a parameter, not one flat buffer
    fused_master.RUN_ELEMENTS = 200  # the 312- and 744-element matrices alone, the rest joined in runs
    launches: list[list[int]] = []  # each step's segments: how many gradient pieces each one joins
    step = fused_master.FusedMasterAdam.step

    calls: list[int] = []  # each step's calls of the compiled step (the host's cost: one, not a segment's)
    built = fused_master.compile_step

    def counted(device: Any) -> Any:
        kernel = built(device)

        def call(*args: Any) -> None:
            if calls:  # the probe's call comes before the first step's
                calls[-1] += 1
            kernel(*args)

        return call

    def counting_step(self: Any, optimizer: Any, segments: Any, *args: Any, **kwargs: Any) -> None:
        launches.append([len(seg.grads) for group in segments for seg in group])
        calls.append(0)
        step(self, optimizer, segments, *args, **kwargs)

    fused_master.FusedMasterAdam.step = counting_step  # type: ignore[method-assign]
    fused_master.compile_step = counted
    return {**_both(rank, world_size, config), "launches": launches, "calls": calls}


@pytest.mark.parametrize(("precision", "stage"), [("bf16", 2), ("bf16", 3), ("fp16", 2)])
def test_one_rank_autograd_gradients_in_runs_equal_torch_step(precision: str, stage: int) -> None:
    """Device: CPU. One rank keeping autograd's gradient tensors (runtime/zero/one_rank.py), one a
    parameter, which the fused step launches on in runs (`plan_runs`): some alone, some joined with
    their neighbours and the layout's padding; at ZeRO-3 too (one rank: a flat group a gather unit).
    The fused step runs (not torch's in its place), in one compiled call a step, and trains as torch's
    step does, with clipping."""
    [result] = run_distributed(_both_in_small_runs, 1, _config(precision, {"stage": stage}, clip=1.0))
    _assert_same(result["fused"], result["plain"])
    pieces = sum(p.numel() > 0 for p in make_model(0).parameters())  # at least one gradient tensor each
    for joined in result["launches"]:  # fewer launches than gradient tensors: some joined, some alone
        assert len(joined) < pieces and max(joined) > 1 and min(joined) == 1, joined
    # however many segments and groups, the host calls the compiled step once a step
    assert result["calls"] == [1] * len(result["launches"]), result["calls"]


def _device_reads_a_step(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """How many times one optimizer step reads a number back from the device (`aten._local_scalar_dense`:
    a host sync on a GPU), over all of this rank's flat groups."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import runtime

    class CountReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default:
                CountReads.reads += 1
            return func(*args, **(kwargs or {}))

    os.environ[ENV] = "1"
    try:
        model = make_model(0)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        _steps(engine, range(1), rank, world_size)  # the first step binds the state (reads each count once)
        x, y = rank_batch(1, 0, 8, rank, world_size)
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss_fn(engine(x), y))
        # the compiled update runs as its eager function here, so the mode sees every op of the step
        with CountReads(), torch.compiler.set_stance("force_eager"):
            engine.step()
        return {"reads": CountReads.reads, "groups": len(engine.groups)}
    finally:
        os.environ.pop(ENV, None)


@pytest.mark.parametrize(
    ("world", "precision", "stage"), [(1, "bf16", 3), (2, "bf16", 2), (2, "bf16", 3), (1, "fp16", 2)]
)
def test_the_fused_step_reads_the_device_once_however_many_groups(
    world: int, precision: str, stage: int
) -> None:
    """Device: CPU. ZeRO-3 at one rank keeps a flat group per gather unit, and weight-decay groups make
    more anywhere; the fused step over all of them reads one number back from the device (the finiteness
    verdict, after the launches), not one a group: on an H100 a read a group cost a 3B Llama's ZeRO-3
    step 7 ms (30 groups, each launch waiting for the last)."""
    results = run_distributed(_device_reads_a_step, world, _config(precision, {"stage": stage}, clip=1.0))
    for result in results:
        assert result["groups"] > 1
        assert result["reads"] == 1, result


@pytest.mark.parametrize(
    ("numels", "runs"),
    [
        ([5, 5, 20, 0, 3, 3, 3, 0], [(0, 2), (2, 3), (3, 8)]),  # joined, alone, the rest joined
        ([4, 4, 4, 4], [(0, 3), (3, 4)]),  # a run closes once it holds the target
        ([0, 0, 20, 0], [(2, 3)]),  # empty pieces make no launch of their own
        ([30, 10, 30], [(0, 1), (1, 2), (2, 3)]),  # exactly the target is a run of its own
        ([], []),
    ],
)
def test_plan_runs(numels: list[int], runs: list[tuple[int, int]]) -> None:
    """Device: none. The launches of a master's gradient pieces at a target of 10 elements: in order,
    covering every element once, a large piece never copied into a run."""
    from runtime.precision.fused_master import plan_runs

    assert plan_runs(numels, 10) == runs
    covered = [i for a, b in runs for i in range(a, b) if numels[i]]
    assert covered == [i for i, n in enumerate(numels) if n]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_ranks_equal_torch_step(stage: int) -> None:
    """Device: CPU, 2 ranks over gloo, small buckets (each rank's shard is several pieces of the flat
    buffer; at ZeRO-3 every unit is sharded, none persistent, and the step writes each rank's working
    shard): every rank's masters and the losses match torch's step."""
    zero = {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    for result in run_distributed(_both, 2, _config("bf16", zero, clip=1.0)):
        _assert_same(result["fused"], result["plain"])


def _resume(rank: int, world_size: int, folder: str, first: bool, second: bool) -> dict[str, Any]:
    """Two steps with the first setting, a checkpoint, a fresh engine with the second setting loading it,
    two more steps: the losses and masters after."""
    import runtime

    config = _config("bf16", {"stage": 2}, clip=1.0)
    out: dict[str, Any] = {}
    for fused, load in ((first, False), (second, True)):
        os.environ[ENV] = "1" if fused else "0"
        model = make_model(0)
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        if load:
            engine.load_checkpoint(folder)
        losses = _steps(engine, range(2, 4) if load else range(2), rank, world_size)
        if not load:
            engine.save_checkpoint(folder)
        out["losses"] = out.get("losses", []) + losses
        out["masters"] = [g.master.detach().clone() for g in engine.groups]
    os.environ.pop(ENV, None)
    return out


@pytest.mark.parametrize(
    ("first", "second"), [(True, False), (False, True)], ids=["fused-to-torch", "torch-to-fused"]
)
def test_checkpoint_moves_between_the_steps(tmp_path, first: bool, second: bool) -> None:
    """Device: CPU. A checkpoint saved under one step resumes under the other exactly as a run that never
    switched: the optimizer state is torch's in both."""
    [switched] = run_distributed(_resume, 1, str(tmp_path / "a"), first, second)
    [straight] = run_distributed(_resume, 1, str(tmp_path / "b"), False, False)
    torch.testing.assert_close(switched["losses"], straight["losses"], rtol=1e-4, atol=1e-5)
    for a, b in zip(switched["masters"], straight["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def _reload_midway(rank: int, world_size: int, fused: bool) -> dict[str, Any]:
    import runtime

    os.environ[ENV] = "1" if fused else "0"
    model = make_model(0)
    config = _config("bf16", {"stage": 0})
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    _steps(engine, range(2), rank, world_size)
    # a round trip through torch's own format: new state tensors replace the ones the fused step bound
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    _steps(engine, range(2, 4), rank, world_size)
    os.environ.pop(ENV, None)
    return {"masters": [g.master.detach().clone() for g in engine.groups]}


def test_load_state_dict_mid_run_is_honoured() -> None:
    """Device: CPU. `optimizer.load_state_dict` replaces the moments torch's state holds; the fused step
    notices and carries on from them, ending where torch's step ends."""
    [fused] = run_distributed(_reload_midway, 1, True)
    [plain] = run_distributed(_reload_midway, 1, False)
    for a, b in zip(fused["masters"], plain["masters"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_uncovered_optimizer_keeps_its_step_and_says_why() -> None:
    """Device: CPU. AdamW with amsgrad is not covered: forcing the fused step logs a warning naming the
    option, and training runs torch's own step (the same result as without forcing)."""
    config = _config("bf16", {"stage": 1})
    config["optimizer"]["params"]["amsgrad"] = True
    [result] = run_distributed(_both, 1, config, 2)
    forced, plain = result["fused"], result["plain"]
    assert "DSLAUNCH_FUSED_MASTER_STEP=1 ignored: amsgrad=True" in forced["log"]
    for a, b in zip(forced["masters"], plain["masters"], strict=True):
        assert torch.equal(a, b)


def test_the_switch_and_the_default() -> None:
    """Device: CPU. Unset, the switch leaves the choice to the device: the fused step on CUDA with Triton
    (inductor compiles its kernel), torch's own elsewhere, which a CPU run shows; a bad value is refused by
    name."""
    from runtime.precision.fused_master import default_refusal, fused_setting

    try:
        for text, expected in (("", None), ("0", False), ("1", True)):
            os.environ[ENV] = text
            assert fused_setting() is expected
        os.environ[ENV] = "yes"
        with pytest.raises(ValueError, match="DSLAUNCH_FUSED_MASTER_STEP='yes': expected 0 or 1"):
            fused_setting()
    finally:
        os.environ.pop(ENV, None)
    assert default_refusal(torch.device("cpu")) == (
        "the masters are on cpu, and the default is CUDA's (DSLAUNCH_FUSED_MASTER_STEP=1 turns it on)"
    )
    [default] = run_distributed(_default_and_off, 1, _config("bf16", {"stage": 2}), 1)
    assert not any("one fused pass" in line for line in default["fused"]["log"])
    assert default["fused"]["masters"][0].equal(default["plain"]["masters"][0])  # torch's step both times


def _default_and_off(rank: int, world_size: int, config: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    """The same run with the switch unset (the default) and off."""
    return {
        "fused": _train(None, config, rank, world_size, steps),
        "plain": _train(False, config, rank, world_size, steps),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [0, 2])
def test_the_cuda_default_equals_torch_step(stage: int) -> None:
    """Device: CUDA. Unset, the switch gives the fused step on a GPU (inductor's Triton kernel): the same
    masters, moments and losses as torch's fused AdamW with it off."""
    [result] = run_distributed(
        _default_and_off, 1, _config("bf16", {"stage": stage}, clip=1.0), timeout=300, device="cuda"
    )
    _assert_same(result["fused"], result["plain"])


def _nan_at_step_three(rank: int, world_size: int, poison: bool) -> dict[str, Any]:
    """Four steps of the CUDA default; with `poison`, step 3's loss is nan, else step 3 never runs."""
    import runtime

    model = make_model(0)
    config = _config("bf16", {"stage": 0}, clip=1.0)
    config.update(train_batch_size=4, gradient_accumulation_steps=1)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    for step in range(4):
        if step == 2 and not poison:
            continue
        x, y = (t.to(engine.device) for t in rank_batch(step, 0, 4, rank, world_size))
        loss = loss_fn(engine(x), y) * (float("nan") if step == 2 else 1.0)
        engine.backward(loss)
        engine.step()
    state = engine.optimizer.state_dict()["state"]
    return {
        "skipped": engine.skipped_steps,
        "masters": [g.master.detach().cpu().clone() for g in engine.groups],
        "moments": [v["exp_avg_sq"].cpu().clone() for _, v in sorted(state.items())],
        "steps": [float(v["step"]) for v in state.values()],
    }


@pytest.mark.gpu
def test_the_cuda_kernel_skips_a_nan_step() -> None:
    """Device: CUDA. bf16's non-finite check with the fused step (the default there): the kernel itself
    leaves a step with nan gradients out, so the run ends where one that never saw that step ends."""
    [poisoned] = run_distributed(_nan_at_step_three, 1, True, timeout=300, device="cuda")
    [clean] = run_distributed(_nan_at_step_three, 1, False, timeout=300, device="cuda")
    assert poisoned["skipped"] == 1 and clean["skipped"] == 0
    assert poisoned["steps"] == clean["steps"] == [3.0] * len(clean["steps"])
    pairs = zip(poisoned["masters"] + poisoned["moments"], clean["masters"] + clean["moments"], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def _kernel_fails(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """The fused step asked for where its kernel cannot be built (a toolchain missing, here a stand-in
    that raises), and the same run with it off."""
    from runtime.precision import fused_master

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no C++ compiler found\nsecond line")

    built = fused_master.compile_step
    fused_master.compile_step = lambda device: broken
    try:
        asked = _train(True, config, rank, world_size)
    finally:
        fused_master.compile_step = built
    return {"asked": asked, "plain": _train(False, config, rank, world_size)}


def test_a_kernel_that_does_not_build_leaves_torch_step_running() -> None:
    """Device: CPU. The fused step's kernel is built by a probe on a few elements before the first real
    step: where that fails, training runs torch's own step (the same masters as with it off), nothing of
    the state was touched, and the log says why in one line."""
    [result] = run_distributed(_kernel_fails, 1, _config("bf16", {"stage": 2}))
    asked, plain = result["asked"], result["plain"]
    assert not any("one fused pass" in line for line in asked["log"])
    assert (
        "DSLAUNCH_FUSED_MASTER_STEP=1 ignored: its kernel did not build here "
        "(RuntimeError: no C++ compiler found)"
    ) in asked["log"]
    assert asked["steps"] == plain["steps"]
    for a, b in zip(asked["masters"], plain["masters"], strict=True):
        assert torch.equal(a, b)


def _graph_fails(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """The fused step where the probe's few elements compile and the real step's graph does not (a backend
    that refuses any input of more than 128 elements: a stand-in for a compiler failing on one size)."""
    from runtime.precision import fused_master

    def picky(gm: Any, inputs: list[Any]) -> Any:
        if any(isinstance(t, torch.Tensor) and t.numel() > 128 for t in inputs):
            raise RuntimeError("no kernel for this size\nsecond line")
        return gm.forward

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("runtime.precision.fused_master")
    logger.addHandler(handler)
    built = fused_master.compile_step
    fused_master.compile_step = lambda device: torch.compile(
        fused_master.adam_steps_, backend=picky, dynamic=False, fullgraph=True
    )
    try:
        asked = _train(True, config, rank, world_size)
    finally:
        fused_master.compile_step = built
        logger.removeHandler(handler)
    return {"asked": asked, "plain": _train(False, config, rank, world_size), "warnings": warnings}


def test_a_step_graph_that_does_not_compile_runs_op_by_op_and_trains_the_same() -> None:
    """Device: CPU. The probe built, but the first real step's graph fails to compile: the step runs the
    same arithmetic op by op (nothing of the failed graph ran), trains as torch's step does, and the log
    says so once, in one line."""
    [result] = run_distributed(_graph_fails, 1, _config("bf16", {"stage": 2}, clip=1.0))
    _assert_same(result["asked"], result["plain"])
    assert not any("segments built in" in line for line in result["asked"]["log"])  # nothing was built
    [warning] = result["warnings"]
    assert warning.startswith("the fused optimizer step's graph did not compile, it runs op by op: ")
    assert "RuntimeError: no kernel for this size" in warning and "second line" not in warning


def _state_at_setup(rank: int, world_size: int, stage: int, fused: bool) -> dict[str, Any]:
    """The optimizer state right after initialize, and where the fused step's moments live after one step."""
    import runtime

    os.environ[ENV] = "1" if fused else "0"
    try:
        model = make_model(0)
        config = _config("bf16", {"stage": stage})
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        state = engine.optimizer.state
        params = [p for group in engine.optimizer.param_groups for p in group["params"]]
        made = {
            "all": len(params) > 0
            and all(set(state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in params),
            "zero": all(not state[p][k].any() for p in params for k in ("exp_avg", "exp_avg_sq")),
            "steps": sorted({(float(state[p]["step"]), state[p]["step"].device.type) for p in params}),
            "fp32": all(state[p]["exp_avg"].dtype == torch.float32 for p in params),
            # one flat buffer per group, shaped like its master (the fused step's layout)
            "flat": all(
                state[p]["exp_avg"]._base is not None and state[p]["exp_avg"]._base.shape == g.master.shape
                for g in engine.groups
                for p in engine.optimizer.param_groups[g.index]["params"]
            ),
        }
        buffers = {p: state[p]["exp_avg"]._base.data_ptr() for p in params}
        _steps(engine, range(1), rank, world_size)
        made["kept"] = all(state[p]["exp_avg"]._base.data_ptr() == buffers[p] for p in params)
        made["fused_ran"] = engine.masters._fused is not None  # the placement took the one-pass step
        made["stepped"] = sorted({float(state[p]["step"]) for p in params})
        engine.destroy()
        return made
    finally:
        os.environ.pop(ENV, None)


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("fused", [False, True], ids=["torch-step", "fused-step"])
def test_adams_state_is_made_when_the_engine_is_built(stage: int, fused: bool) -> None:
    """torch's Adam makes its moments in the first step, after the backward, so a first step can fit where
    no later one does; the engine makes them at setup, zero with step 0 where torch keeps it (the CPU for
    torch's unfused step), in the fused step's flat layout, which that step then takes without a copy."""
    got = run_distributed(_state_at_setup, 1, stage, fused)[0]
    assert got["all"] and got["zero"] and got["fp32"] and got["flat"], got
    assert got["steps"] == [(0.0, "cpu")]
    assert got["fused_ran"] is fused
    assert got["kept"]  # the first step updated the buffers made at setup, whichever step ran
    assert got["stepped"] == [1.0]


def _resume_in_place(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import runtime

    os.environ[ENV] = "1"
    try:
        engines = []
        for _ in range(2):
            model = make_model(0)
            config = _config("bf16", {"stage": 0})
            engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
            engines.append(engine)
        saved, fresh = engines
        _steps(saved, range(2), rank, world_size)
        saved.save_checkpoint(folder, "t")
        params = [p for group in fresh.optimizer.param_groups for p in group["params"]]
        buffers = [fresh.optimizer.state[p]["exp_avg"].data_ptr() for p in params]
        fresh.load_checkpoint(folder, "t")
        want = [v["exp_avg"] for _, v in sorted(saved.optimizer.state_dict()["state"].items())]
        got = [v["exp_avg"] for _, v in sorted(fresh.optimizer.state_dict()["state"].items())]
        return {
            "in_place": [fresh.optimizer.state[p]["exp_avg"].data_ptr() for p in params] == buffers,
            "equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and len(got) > 0,
            "losses": _steps(fresh, range(2, 3), rank, world_size)
            == _steps(saved, range(2, 3), rank, world_size),
        }
    finally:
        os.environ.pop(ENV, None)


def test_a_resume_fills_the_state_made_at_setup_in_place(tmp_path: Any) -> None:
    """Loading into the moments made at setup, not beside them: no second copy at the load's peak, and the
    fused step's first step after it still takes them as they are."""
    got = run_distributed(_resume_in_place, 1, str(tmp_path))[0]
    assert got["in_place"] and got["equal"] and got["losses"], got


def _partial_state_at_setup(rank: int, world_size: int) -> dict[str, Any]:
    import runtime

    model = make_model(0)
    config = _config("bf16", {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    split = engine.masters.split
    state = engine.optimizer.state

    def params(indices: Any) -> list[torch.Tensor]:
        return [p for i in indices for p in engine.optimizer.param_groups[engine.groups[i].index]["params"]]

    def entries(indices: Any) -> list[tuple[str, ...]]:
        return [tuple(sorted(state[p])) if p in state else () for p in params(indices)]

    got = {"device": entries(split.device), "host": entries(split.host)}
    got["zero"] = all(not state[p][k].any() for p in params(split.device) for k in ("exp_avg", "exp_avg_sq"))
    buffers = [state[p]["exp_avg"].data_ptr() for p in params(split.device)]
    _steps(engine, range(1), rank, world_size)
    got["kept"] = [state[p]["exp_avg"].data_ptr() for p in params(split.device)] == buffers
    got["stepped"] = sorted({float(state[p]["step"]) for p in params(split.device)})
    engine.destroy()
    return got


def test_a_partial_offloads_device_share_has_its_state_at_setup() -> None:
    """With `offload_optimizer.ratio` between 0 and 1 and fp32 masters, the device's groups step with torch's
    Adam on the device: their moments are made at setup too (the host's share has its own buffers), and the
    first step updates those."""
    got = run_distributed(_partial_state_at_setup, 1)[0]
    assert got["device"] and all(e == ("exp_avg", "exp_avg_sq", "step") for e in got["device"]), got
    assert got["zero"] and got["kept"] and got["stepped"] == [1.0]
