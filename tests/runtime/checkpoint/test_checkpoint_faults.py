"""A checkpoint is where nothing may be lost: damaged or mismatched files, misuse, and refused writes.

(A rank killed in the middle of a save: tests/runtime/checkpoint/test_checkpoint_swap.py.)

- On 2 ranks, a flipped byte in one shard, a truncated engine state file, a deleted shard, a `latest`
  naming a deleted tag, and a model with a differently shaped layer each give the same clear error on
  every rank, naming the file or the parameter; nothing falls back to another tag.
- A full filesystem, a read-only one, an immutable folder and a file where the folder should be each fail
  the save with one line naming the path and the cause (ENOSPC, EROFS, EPERM, EEXIST/ENOTDIR), exit code 2
  when uncaught, and the checkpoint saved before still loads.
- Ranks passing different tags save under rank 0's (or fail with tag_validation FAIL); a client_state that
  would need code to load fails the save on every rank and leaves `latest` alone; save_latest=False,
  load_module_only and load_optimizer_states=False load what they say.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import read_latest
from runtime.checkpoint.manifest import ENGINE_STATE, shard_file_name
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch
from tests.support.paths import REPO

ROOT = REPO
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


# ---------------------------------------------------------------------------------------- damaged files


def _damage_and_load(rank: int, world: int, root: str) -> dict[str, str]:
    """Save, damage copies of the checkpoint (rank 0), then try to load each one on every rank."""
    import torch.distributed as dist

    import runtime
    from tests.support.models import UnevenNet

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
    try:  # one tag's folder where the directory save_checkpoint was given belongs (was an IndexError)
        engine.load_checkpoint(str(tag))
        errors["tag folder"] = "loaded"
    except Exception as error:
        errors["tag folder"] = f"{type(error).__name__}: {error}"
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
            "parameter 'inp.weight': shape [24, 13] in the checkpoint, [25, 13] in the model (2 more differ)",
        ),
        "tag folder": (
            "CheckpointNotFound",
            "good/global_step1 is the folder of one checkpoint (tag 'global_step1'), not a checkpoint "
            "directory: load_checkpoint takes the directory save_checkpoint was given",
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
    seen["module_only"] = (fresh.global_steps, _stepped(fresh), _same(fresh, masters))
    fresh = build()
    fresh.load_checkpoint(root, load_optimizer_states=False)
    seen["no_optimizer"] = (fresh.global_steps, _stepped(fresh), _same(fresh, masters))
    seen["no_optimizer_lr"] = fresh.get_lr()  # the schedule's, not the fresh optimizer's
    fresh = build()
    fresh.load_checkpoint(root)
    state = fresh.optimizer.state[fresh.groups[0].master]
    seen["everything"] = (fresh.global_steps, sorted(state), _same(fresh, masters))
    return seen


def _stepped(engine) -> int:
    """How many parameters' optimizer state has taken a step (the engine makes it, zero, at setup)."""
    return sum(1 for state in engine.optimizer.state.values() if state and float(state["step"]) > 0)


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


# ------------------------------------------------------------------------------------------ refused writes


def _refused_writes(root: str) -> None:
    """Run as root in a private mount namespace: save tag "last" into each folder, make the folder refuse
    writes (a full tmpfs, a read-only bind mount, chattr +i), save "last" again and record the error and
    whether the first checkpoint still loads; then a save left uncaught, for the exit code."""
    import json

    import runtime
    from runtime.checkpoint import CheckpointError, check_save_dir

    def early(folder: Path) -> str:  # what the check before training says about the folder
        try:
            check_save_dir(folder)
        except CheckpointError as error:
            return str(error)
        return "fine"

    base = Path(root)
    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=CONFIG)

    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True)

    def fill(folder: Path) -> None:  # a filler file that takes every free block
        with open(folder / "filler", "wb") as out:
            try:
                while True:
                    out.write(b"x" * 65536)
                    out.flush()
            except OSError:
                pass

    for name in ("full", "ro", "immutable"):
        (base / name).mkdir()
    mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(base / "full"))
    (base / "afile").write_text("not a folder")
    refuse = {
        "full": lambda d: fill(d),
        "ro": lambda d: (mount("--bind", str(d), str(d)), mount("-o", "remount,bind,ro", str(d))),
        "immutable": lambda d: subprocess.run(["chattr", "+i", str(d)], check=True, capture_output=True),
    }
    seen: dict = {}
    for name, spoil in refuse.items():
        folder = base / name
        _step(engine)
        engine.save_checkpoint(str(folder), tag="last")
        saved, steps = engine.full_state_dict(), engine.global_steps
        _step(engine)  # what the refused save would have written
        try:
            spoil(folder)
        except (subprocess.CalledProcessError, OSError) as error:
            seen[name] = f"unsupported: {error}"
            continue
        try:
            engine.save_checkpoint(str(folder), tag="last")
            seen[name] = ["saved"]
        except CheckpointError as error:
            seen[name] = [type(error).__name__, str(error), error.hint]
        other = make_model(0)
        fresh, *_ = runtime.initialize(model=other, model_parameters=param_groups(other), config=CONFIG)
        fresh.load_checkpoint(str(folder))
        state = fresh.full_state_dict()
        seen[name].append(fresh.global_steps == steps)
        seen[name].append(all(torch.equal(state[k], v) for k, v in saved.items()))
        seen[name].append(sorted(p.name for p in folder.iterdir() if p.name != "filler"))
        seen[name].append(early(folder))
        if name == "immutable":
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    for name, save_dir in (("file", base / "afile"), ("under a file", base / "afile" / "ckpt")):
        try:
            engine.save_checkpoint(str(save_dir))
            seen[name] = ["saved"]
        except CheckpointError as error:
            seen[name] = [type(error).__name__, str(error), error.hint]
        seen[name].append(early(save_dir))
    print(json.dumps(seen), flush=True)
    engine.save_checkpoint(str(base / "ro"), tag="last")  # uncaught: the excepthook ends the process


def test_a_full_read_only_or_immutable_folder_or_a_file_in_the_way_fails_the_save_in_one_line(
    tmp_path: Path,
) -> None:
    namespace = ["unshare", "-m", "--propagation", "private"]
    probe = subprocess.run([*namespace, "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs `unshare -m` (root, mount namespaces) to mount a full and a read-only filesystem")
    module = "tests.runtime.checkpoint.test_checkpoint_faults"
    code = f"from {module} import _refused_writes; _refused_writes({str(tmp_path)!r})"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run(
            [*namespace, sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:  # pytest must be able to remove the folder whatever happened
        subprocess.run(["chattr", "-i", str(tmp_path / "immutable")], capture_output=True)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    seen = json.loads(lines[-1])
    root = str(tmp_path)
    kept = "latest still names 'last', which is untouched"
    expected = {
        "full": f"in {root}/full: the filesystem is full (ENOSPC); {root}/full/{kept}",
        "ro": f"in {root}/ro: {root}/ro/.last~new: the filesystem is mounted read-only (EROFS); "
        f"{root}/ro/{kept}",
        "immutable": f"in {root}/immutable: {root}/immutable/.last~new: operation not permitted (EPERM); "
        f"{root}/immutable/{kept}",
    }
    early = {
        "ro": "the filesystem is mounted read-only (EROFS)",
        "immutable": "operation not permitted (EPERM)",
    }
    unsupported = []
    for name, text in expected.items():
        if isinstance(seen[name], str):
            unsupported.append(f"{name}: {seen[name]}")
            continue
        kind, message, hint, same_steps, same_weights, left, check = seen[name]
        assert kind == "CheckpointWriteError", (name, seen[name])
        assert message.startswith("cannot save checkpoint 'last' ") and text in message, (name, message)
        assert "\n" not in message and hint, (name, hint)
        assert same_steps and same_weights, name  # the checkpoint saved before loads, whole
        assert left == ["last", "latest", "zero_to_fp32.py"], (name, left)  # the refused save left nothing
        # check_save_dir, before training, finds the same cause (a full disk shows only when a save writes)
        if name == "full":
            assert check == "fine"
        else:
            assert check.startswith(f"cannot save checkpoints in {root}/{name}: "), check
            assert check.endswith(early[name]), check
    assert seen["file"][:2] == [
        "CheckpointWriteError",
        f"cannot save checkpoint 'global_step6' in {root}/afile: {root}/afile is a file, where a folder is "
        "needed (EEXIST); no earlier checkpoint was touched",
    ], seen["file"]
    assert seen["under a file"][1].endswith(
        f"/ckpt: {root}/afile is a file, where a folder is needed (ENOTDIR); no earlier checkpoint was "
        "touched"
    ), seen["under a file"]
    in_the_way = f"{root}/afile is a file, where a folder is needed"
    assert seen["file"][3] == f"cannot save checkpoints in {root}/afile: {in_the_way} (EEXIST)"
    assert seen["under a file"][3] == f"cannot save checkpoints in {root}/afile/ckpt: {in_the_way} (ENOTDIR)"
    # uncaught: exit code 2, one error line and one hint line, no traceback
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "hint:", "Traceback"))]
    assert [line.split(":")[0] for line in errors] == ["error", "hint"], proc.stderr[-3000:]
    assert "(EROFS)" in errors[0]
    if unsupported:
        pytest.skip(f"the other conditions passed; not available on this machine: {'; '.join(unsupported)}")


def test_the_example_script_checks_its_save_dir_before_it_trains(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    args = ["--save_dir", str(tmp_path / "afile" / "ckpt"), "--save_interval", "1", "--steps", "2"]
    args += ["--model_size", "tiny", "--seq_len", "32", "--deepspeed_config", "scripts/configs/zero2.json"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "scripts/train_gpt.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-3000:]  # nothing trained
    assert proc.stderr.splitlines() == [
        f"error: cannot save checkpoints in {tmp_path}/afile/ckpt: {tmp_path}/afile is a file, where a "
        "folder is needed (ENOTDIR)",
        "hint: remove or rename that file, or pass another save_dir",
    ]
