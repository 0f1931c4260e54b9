"""A checkpoint is where nothing may be lost: crashes during a save, and damaged or mismatched files.

- A real training process is SIGKILLed while it saves its second checkpoint: part-way through writing
  its shard, before the manifest, and before `latest` moves. Every time `latest` still names the first
  checkpoint, which loads (without a process group, and into a 2-rank engine that then saves over the
  broken tag); the interrupted tag refuses to load with "did not finish", or, when only `latest` was
  missing, loads by its tag.
- On 2 ranks, a flipped byte in one shard, a truncated engine state file, a deleted shard, a `latest`
  naming a deleted tag, and a model with a differently shaped layer each give the same clear error on
  every rank, naming the file or the parameter; nothing falls back to another tag.
- Ranks passing different tags save under rank 0's (or fail with tag_validation FAIL); a client_state that
  would need code to load fails the save on every rank and leaves `latest` alone; save_latest=False,
  load_module_only and load_optimizer_states=False load what they say.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import (
    CheckpointIncomplete,
    get_fp32_state_dict_from_checkpoint,
    read_latest,
)
from runtime.checkpoint.durable import FAULT_ENV, FAULT_MARKER_ENV
from runtime.checkpoint.manifest import ENGINE_STATE, MANIFEST, shard_file_name
from tests.dist import run_distributed
from tests.models import loss_fn, make_model, param_groups, rank_batch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {
    "train_batch_size": 12,
    "steps_per_print": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 700},
}


def _step(engine, rank: int = 0, world: int = 1) -> None:
    x, y = rank_batch(engine.global_steps, 0, 12, rank, world)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _child(save_dir: str, point: str, marker: str, expected: str) -> None:
    """Run in a subprocess: save step 1 normally, then stop at `point` while saving step 2."""
    import runtime

    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)
    _step(engine)
    engine.save_checkpoint(save_dir)
    torch.save(engine.full_state_dict(), expected)
    _step(engine)
    os.environ[FAULT_ENV] = point
    os.environ[FAULT_MARKER_ENV] = marker
    engine.save_checkpoint(save_dir)  # never returns: the fault hook sleeps until the test kills us


def _resume_after_crash(rank: int, world: int, save_dir: str) -> tuple[int, str | None]:
    import runtime

    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)
    engine.load_checkpoint(save_dir)
    steps = engine.global_steps
    _step(engine, rank, world)
    engine.save_checkpoint(save_dir)  # global_step2 again: over the tag the crash left incomplete
    return steps, read_latest(save_dir)


POINTS = ("shard", "manifest", "latest")


def test_sigkill_in_the_middle_of_a_save_leaves_latest_on_the_last_good_checkpoint(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    children = {}
    for point in POINTS:
        args = [
            str(tmp_path / point),
            point,
            str(tmp_path / f"{point}.paused"),
            str(tmp_path / f"{point}.pt"),
        ]
        code = f"from tests.test_checkpoint_faults import _child; _child(*{args!r})"
        children[point] = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, stderr=subprocess.PIPE
        )
    try:
        deadline = time.monotonic() + 120
        for point, proc in children.items():
            while not (tmp_path / f"{point}.paused").exists():
                assert proc.poll() is None, (
                    f"{point}: child exited early: {proc.stderr.read().decode()[-2000:]}"
                )
                assert time.monotonic() < deadline, f"{point}: the save never reached the fault point"
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)  # mid-save, no cleanup of any kind
            assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for point in POINTS:
        save_dir = tmp_path / point
        assert read_latest(save_dir) == "global_step1", point
        expected = torch.load(tmp_path / f"{point}.pt", weights_only=True)
        state = get_fp32_state_dict_from_checkpoint(save_dir)
        assert all(torch.equal(state[k], v) for k, v in expected.items()), point
        broken = save_dir / "global_step2"
        if point == "latest":  # everything but the pointer was written: the tag itself is complete
            state2 = get_fp32_state_dict_from_checkpoint(save_dir, "global_step2")
            assert not torch.equal(state2["out.weight"], state["out.weight"])
            continue
        assert not (broken / MANIFEST).exists()
        with pytest.raises(CheckpointIncomplete, match="save of tag 'global_step2' did not finish"):
            get_fp32_state_dict_from_checkpoint(save_dir, "global_step2")
        if point == "shard":  # killed while the shard was half written, under its temporary name
            assert [p.name.startswith(f".{shard_file_name(0)}.tmp-") for p in broken.iterdir()] == [True]

    # a new job (2 ranks) resumes from the last good tag and saves over the broken one
    steps, latest = run_distributed(_resume_after_crash, 2, str(tmp_path / "shard"))[0]
    assert (steps, latest) == (1, "global_step2")
    left = sorted(p.name for p in (tmp_path / "shard" / "global_step2").iterdir())
    assert left == sorted([MANIFEST, ENGINE_STATE, shard_file_name(0), shard_file_name(1)])


# ---------------------------------------------------------------------------------------- damaged files


def _damage_and_load(rank: int, world: int, root: str) -> dict[str, str]:
    """Save, damage copies of the checkpoint (rank 0), then try to load each one on every rank."""
    import torch.distributed as dist

    import runtime
    from tests.models import UnevenNet

    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)
    _step(engine, rank, world)
    good = Path(root) / "good"
    engine.save_checkpoint(str(good))
    tag = good / "global_step1"
    damage = {
        "flipped byte": lambda d: _flip(d / "global_step1" / shard_file_name(1)),
        "truncated engine state": lambda d: _truncate(d / "global_step1" / ENGINE_STATE),
        "deleted shard": lambda d: (d / "global_step1" / shard_file_name(0)).unlink(),
        "latest names a deleted tag": lambda d: shutil.rmtree(d / "global_step1"),
    }
    if rank == 0:
        for name, spoil in damage.items():
            shutil.copytree(good, Path(root) / name)
            spoil(Path(root) / name)
    dist.barrier()
    errors = {}
    for name in damage:
        try:
            engine.load_checkpoint(str(Path(root) / name))
            errors[name] = "loaded"
        except Exception as error:  # the test reports what each rank saw
            errors[name] = f"{type(error).__name__}: {error}"
    torch.manual_seed(0)
    other = UnevenNet(hidden=25)
    wrong, *_ = runtime.initialize(model=other, model_parameters=param_groups(other), config=CONFIG)
    try:
        wrong.load_checkpoint(str(good))
        errors["other model"] = "loaded"
    except Exception as error:
        errors["other model"] = f"{type(error).__name__}: {error}"
    errors["tag"] = str(tag)
    return errors


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 100] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def test_damaged_or_mismatched_checkpoints_fail_the_same_way_on_every_rank(tmp_path: Path) -> None:
    reports = run_distributed(_damage_and_load, 2, str(tmp_path))
    expected = {
        "flipped byte": (
            "CheckpointCorrupted",
            f"flipped byte/global_step1/{shard_file_name(1)}: checksum mismatch",
        ),
        "truncated engine state": (
            "CheckpointCorrupted",
            f"{ENGINE_STATE}: {{}} bytes, but the manifest recorded",
        ),
        "deleted shard": ("CheckpointCorrupted", f"deleted shard/global_step1/{shard_file_name(0)}: missing"),
        "latest names a deleted tag": ("CheckpointNotFound", "names tag 'global_step1', but"),
        "other model": (
            "CheckpointMismatch",
            "parameter 'hidden.weight': shape [31, 24] in the checkpoint, [31, 25]",
        ),
    }
    for name in expected:  # the same words on every rank, so the launcher folds them into one line
        assert reports[0][name].split(": ", 1)[1] == reports[1][name].split(": ", 1)[1], name
    for rank, errors in enumerate(reports):
        for name, (kind, text) in expected.items():
            got = errors[name]
            assert got.startswith(kind + ":"), (rank, name, got)
            if "{}" in text:
                size = (tmp_path / name / "global_step1" / ENGINE_STATE).stat().st_size
                text = text.format(size)
            assert text in got, (rank, name, got)  # the rank that checked the file and the one told


# ------------------------------------------------------------------------------------ misuse and options


def _misuse_and_options(rank: int, world: int, root: str) -> dict:
    import runtime

    seen: dict = {}

    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}

    def build(**extra):
        model = make_model(0)
        config = {**CONFIG, "scheduler": warmup, **extra}
        engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
        return engine

    def error_of(fn) -> str:
        try:
            fn()
        except Exception as error:  # what each rank saw
            return f"{type(error).__name__}: {error}"
        return "no error"

    engine = build()
    _step(engine, rank, world)
    _step(engine, rank, world)  # the warmup has moved the lr off its start
    # ranks disagree on the tag: by default (WARN) everything is saved under rank 0's
    engine.save_checkpoint(root, tag=f"tag{rank}")
    seen["tags"] = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    strict = build(checkpoint={"tag_validation": "FAIL"})
    seen["fail_tag"] = error_of(lambda: strict.save_checkpoint(root, tag=f"other{rank}"))
    seen["bad_client_state"] = error_of(
        lambda: engine.save_checkpoint(root, "bad", client_state={"x": object()})
    )
    seen["bad_tag_written"] = (Path(root) / "bad").exists()
    engine.save_checkpoint(root, "quiet", save_latest=False)
    seen["latest"] = read_latest(root)
    masters = engine.full_state_dict(rank0_only=False)
    seen["lr"] = engine.get_lr()

    fresh = build()
    fresh.load_checkpoint(root, "quiet", load_module_only=True)
    seen["module_only"] = (fresh.global_steps, len(fresh.optimizer.state), _same(fresh, masters))
    fresh = build()
    fresh.load_checkpoint(root, load_optimizer_states=False)
    seen["no_optimizer"] = (fresh.global_steps, len(fresh.optimizer.state), _same(fresh, masters))
    seen["no_optimizer_lr"] = fresh.get_lr()  # the schedule's, not the fresh optimizer's
    fresh = build()
    fresh.load_checkpoint(root)
    state = fresh.optimizer.state[fresh.groups[0].master]
    seen["everything"] = (fresh.global_steps, sorted(state), _same(fresh, masters))
    return seen


def _same(engine, masters: dict) -> bool:
    got = engine.full_state_dict(rank0_only=False)
    return all(torch.equal(got[k], v) for k, v in masters.items())


def test_tag_agreement_unsaveable_client_state_and_partial_loads(tmp_path: Path) -> None:
    for rank, seen in enumerate(run_distributed(_misuse_and_options, 2, str(tmp_path / "ckpt"))):
        assert seen["tags"] == ["tag0"], rank  # rank 0's tag, one complete checkpoint
        assert seen["fail_tag"] == (
            "CheckpointRefused: ranks passed different checkpoint tags to save_checkpoint "
            "(rank 0: 'other0'; rank 1: 'other1')"
        ), seen
        assert seen["bad_client_state"].startswith("CheckpointError: "), seen
        assert "client_state['x'] is a builtins.object" in seen["bad_client_state"]
        assert seen["bad_tag_written"] is False  # refused before any file was written
        assert seen["latest"] == "tag0"  # neither the failed save nor save_latest=False moved it
        assert seen["module_only"] == (0, 0, True)  # weights only: no counters, no optimizer state
        assert seen["no_optimizer"] == (2, 0, True)  # counters and weights, a fresh optimizer
        assert seen["no_optimizer_lr"] == seen["lr"] and seen["lr"][0] > 0
        assert seen["everything"] == (2, ["exp_avg", "exp_avg_sq", "step"], True)
