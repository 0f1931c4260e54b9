"""A run saved by real DeepSpeed 0.19.8 continues here: `engine.load_checkpoint(dir)` on DeepSpeed's folder.

The fixtures (tests/fixtures/deepspeed, README there) are DeepSpeed's own checkpoints of a 2-rank run at
ZeRO 1, 2 and 3 in fp32 and bf16, with DeepSpeed's continuation after its own load. Our engine, built from
another seed, loads each at 1, 2 and 3 ranks and trains the same three steps: at 2 ranks (DeepSpeed's world
size) the losses are bitwise DeepSpeed's, also when our run uses another ZeRO stage (a stage-3 checkpoint
into stage 1, a stage-1 one into stage 3); with a frozen parameter (stages 2 and 3, PEFT's case: DeepSpeed
keeps it in the model state files, in pieces at stage 3) within 1e-6 (measured 1.2e-7). At 1 and 3 ranks
fp32 is within 1e-6 (measured <= 3.6e-7: only the summation order differs) and bf16 within 2e-3 (measured
<= 7.9e-4: bf16 rounding of a differently ordered reduction). The lr of each step equals DeepSpeed's
schedule; the global step, client_state and the buffer come back. Across precision (a bf16 checkpoint
into an fp32 run, an fp32 one into bf16) the fp32 masters and Adam moments load as they are: the run
follows DeepSpeed's continuation in its own precision within bf16 tolerance (measured <= 1.6e-3). A
DeepSpeed folder is never "a save that did not finish"; a damaged one gets an error naming the missing or
unreadable file. At 2 ranks the engine comes from the compat `deepspeed.initialize`, at 1 and 3 from
`runtime.initialize`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import CheckpointCorrupted
from tests.fixtures.deepspeed import tiny
from tests.support.dist import run_distributed
from tests.support.paths import TESTS

FIXTURES = TESTS / "fixtures" / "deepspeed"
TOLERANCE = {"fp32": 1e-6, "bf16": 2e-3}
# (fixture, the precision and ZeRO stage our run uses)
CASES = [(tiny.fixture_name(s, d, f), d, s) for s, d, f in tiny.ALL] + [
    ("zero2_bf16", "fp32", 2),  # across precision
    ("zero3_fp32", "bf16", 3),
    ("zero3_fp32", "fp32", 1),  # across ZeRO stage: DeepSpeed's per-parameter pieces into flat partitions
    ("zero1_bf16", "bf16", 3),
]


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def _resume(
    rank: int, world: int, cases: list[tuple[str, str, int]], root: str = str(FIXTURES)
) -> list[dict]:
    import deepspeed  # our compat names, as a DeepSpeed user's script calls them (at world 2)

    import runtime

    torch.set_num_threads(1)
    out = []
    for name, dtype, stage in cases:
        frozen = expected(name)["frozen"]  # the frozen weight too must come from the checkpoint
        model = tiny.make_model(123, frozen=frozen)  # other initial weights: all from the checkpoint
        initialize = deepspeed.initialize if world == 2 else runtime.initialize
        engine, *_ = initialize(
            model=model, model_parameters=tiny.param_groups(model), config=tiny.config(stage, dtype, world)
        )
        _, client_state = engine.load_checkpoint(str(Path(root) / name / "ckpt"))
        loaded = {"steps": engine.global_steps, "client_state": client_state, "lr": engine.get_lr()[0]}
        losses, lrs = [], []
        for step in range(tiny.SAVED_AT + 1, tiny.SAVED_AT + tiny.CONTINUE + 1):
            x, y = tiny.batch(step, rank, world)
            loss = tiny.loss_fn(engine(x.to(torch.bfloat16) if dtype == "bf16" else x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            lrs.append(engine.get_lr()[0])
        out.append(dict(loaded, losses=losses, lrs=lrs, temperature=float(engine.module.temperature)))
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_from_deepspeed_equals_deepspeeds_continuation(world: int) -> None:
    results = run_distributed(_resume, world, CASES, timeout=240)[0]
    for (name, dtype, stage), got in zip(CASES, results, strict=True):
        ref = expected(name)
        if (
            ref["dtype"] != dtype and not ref["frozen"]
        ):  # across precision: the continuation of DeepSpeed's run in our precision
            ref = dict(ref, continuation=expected(name.replace(ref["dtype"], dtype))["continuation"])
        tol = TOLERANCE["bf16" if "bf16" in (dtype, ref["dtype"]) else "fp32"]
        where = f"{name} into {dtype} at ZeRO {stage}, world {world}"
        assert got["steps"] == ref["global_steps_after_load"] == tiny.SAVED_AT, where
        assert got["client_state"] == ref["client_state"], where
        assert got["lr"] == pytest.approx(ref["lrs_before_save"][-1], rel=1e-12), where
        assert got["lrs"] == pytest.approx(ref["continuation_lrs"], rel=1e-12), where
        assert got["temperature"] == 1.25, where  # the buffer, from DeepSpeed's module state
        if (world, dtype, ref["frozen"]) == (ref["world_size"], ref["dtype"], False):
            # the same sums in the same order: equal but for the last bits that the CPU's vector width
            # decides (DeepSpeed wrote the fixture on another machine; a few fp32 ulps, not a tolerance)
            assert got["losses"] == pytest.approx(ref["continuation"], rel=2**-21, abs=0), where
        assert got["losses"] == pytest.approx(ref["continuation"], abs=tol), where


def _as_if_compiled(folder: Path) -> None:
    """Rewrite a copied fixture's model state files as DeepSpeed writes a run whose model it was given
    `torch.compile`d: every name under the wrapper's `_orig_mod.`."""
    for path in folder.glob("ckpt/global_step*/*model_states.pt"):
        states = torch.load(path, map_location="cpu", weights_only=False)
        states["param_shapes"] = [
            {f"_orig_mod.{name}": shape for name, shape in group.items()} for group in states["param_shapes"]
        ]
        for key in ("module", "frozen_param_shapes", "frozen_param_fragments", "shared_params"):
            states[key] = {f"_orig_mod.{name}": value for name, value in (states.get(key) or {}).items()}
        states["buffer_names"] = [f"_orig_mod.{name}" for name in states["buffer_names"]]
        torch.save(states, path)


def test_a_deepspeed_run_of_a_compiled_model_loads_under_the_models_own_names(tmp_path: Path) -> None:
    """`deepspeed.initialize(model=torch.compile(model))` saves every weight as `_orig_mod.<name>`; such
    a checkpoint loads into the uncompiled model (or a compiled one: the engine unwraps it) exactly as the
    same checkpoint without the prefix: ZeRO 2 in bf16, and ZeRO 3 with a frozen parameter in pieces."""
    cases = [("zero2_bf16", "bf16", 2), ("zero3_fp32_frozen", "fp32", 3)]
    for name, _, _ in cases:
        shutil.copytree(FIXTURES / name, tmp_path / name)
        _as_if_compiled(tmp_path / name)
    assert (
        "_orig_mod.temperature"
        in torch.load(
            tmp_path / "zero2_bf16/ckpt/global_step4/mp_rank_00_model_states.pt", weights_only=False
        )["module"]
    )
    plain = run_distributed(_resume, 2, cases)[0]
    prefixed = run_distributed(_resume, 2, cases, str(tmp_path))[0]
    assert prefixed == plain


def _load_damaged(rank: int, world: int, folder: str) -> str:
    import runtime

    model = tiny.make_model(0)
    engine, *_ = runtime.initialize(
        model=model, model_parameters=tiny.param_groups(model), config=tiny.config(2, "fp32", world)
    )
    try:
        engine.load_checkpoint(folder)
    except CheckpointCorrupted as error:
        return f"{type(error).__name__}: {error} | {error.hint}"
    return "loaded"


def test_damaged_deepspeed_folder_names_the_file(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "zero2_fp32" / "ckpt", root)
    tag = root / "global_step4"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    missing = run_distributed(_load_damaged, 1, str(root))[0]
    assert missing.startswith(
        f"CheckpointCorrupted: {tag / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: missing (the DeepSpeed "
        "checkpoint was saved by 2 ranks)"
    ), missing
    assert "did not finish" not in missing and "every rank's *_optim_states.pt" in missing
    shutil.copy(
        FIXTURES / "zero2_fp32" / "ckpt" / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag
    )
    model_states = tag / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:3000])  # truncated
    truncated = run_distributed(_load_damaged, 2, str(root))[0]
    assert truncated.startswith(f"CheckpointCorrupted: {model_states}: cannot be read ("), truncated
    assert "truncated or damaged" in truncated
