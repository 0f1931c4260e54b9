"""Saves that must not happen: ranks naming different folders, and weights that are NaN.

- On 2 gloo ranks, each passing its own save_dir (a client naming its folder by the clock does this), the
  save fails on every rank with the same message naming each rank's folder, before anything is written;
  load_checkpoint with different load_dir values fails the same way. (Before, rank 1 was told that rank
  0's folder "does not exist on rank 1's host: save_dir must be a shared filesystem".)
- A NaN in one weight on one rank stops every rank's save with a message naming the parameter and the
  step; `latest` and the previous checkpoint stay as they were, and the refused tag is not created.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.checkpoint import read_latest
from runtime.checkpoint.agree import by_rank, rank_ranges
from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch

CONFIG = {
    "train_batch_size": 12,
    "steps_per_print": 0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 700},
}


def _engine(config: dict):
    import runtime

    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _step(engine, rank: int, world: int) -> None:
    x, y = rank_batch(engine.global_steps, 0, 12, rank, world)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as error:  # what this rank saw
        return f"{type(error).__name__}: {error}"
    return "no error"


def _different_folders(rank: int, world: int, root: str) -> dict:
    engine = _engine(CONFIG)
    _step(engine, rank, world)
    seen = {"save": _error_of(lambda: engine.save_checkpoint(f"{root}/run{rank}"))}
    seen["written"] = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
    engine.save_checkpoint(f"{root}/shared")  # the same folder on both ranks: saves
    seen["load"] = _error_of(lambda: engine.load_checkpoint(f"{root}/shared" if rank == 0 else f"{root}/x"))
    return seen


def test_ranks_with_different_save_or_load_dirs_are_told_each_ranks_folder(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    reports = run_distributed(_different_folders, 2, str(root))
    assert reports[0] == reports[1]  # the same words on every rank: the launcher folds them
    seen = reports[0]
    assert seen["save"] == (
        "CheckpointRefused: ranks passed different save_dir values to save_checkpoint "
        f"(rank 0: {root}/run0; rank 1: {root}/run1); every rank must use the same directory"
    )
    assert "shared filesystem" not in seen["save"]
    assert seen["written"] == []  # refused before anything was created
    assert seen["load"] == (
        "CheckpointRefused: ranks passed different load_dir values to load_checkpoint "
        f"(rank 0: {root}/shared; rank 1: {root}/x); every rank must use the same directory"
    )


def test_rank_lists_fold_into_ranges() -> None:
    assert rank_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert rank_ranges([4]) == "4"
    assert by_rank(["/a/x", "/a/y", "/a/x"]) == "ranks 0,2: /a/x; rank 1: /a/y"
    assert by_rank(["/a"] * 4 + ["/b"]) == "ranks 0-3: /a; rank 4: /b"


def _nan_on_one_rank(rank: int, world: int, root: str) -> dict:
    engine = _engine({**CONFIG, "zero_optimization": {"stage": 0}})  # fp32 stage 0: the weight is the master
    _step(engine, rank, world)
    engine.save_checkpoint(root)
    _step(engine, rank, world)
    name, weight = next(iter(engine.module.named_parameters()))
    if rank == 1:
        with torch.no_grad():
            weight.view(-1)[3] = float("nan")
    return {
        "save": _error_of(lambda: engine.save_checkpoint(root)),
        "latest": read_latest(root),
        "tags": sorted(p.name for p in Path(root).iterdir() if p.is_dir()),
        "name": name,
    }


def test_a_nan_weight_on_one_rank_stops_every_ranks_save_and_keeps_latest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    reports = run_distributed(_nan_on_one_rank, 2, str(root))
    assert reports[0] == reports[1], reports
    seen = reports[0]
    assert seen["save"] == (
        f"CheckpointRefused: not saving checkpoint 'global_step2' at step 2: parameter {seen['name']!r} "
        f"holds NaN or inf (rank 1's shard); {root}/latest still names 'global_step1'"
    )
    assert seen["latest"] == "global_step1"
    assert seen["tags"] == ["global_step1"]  # the refused tag was never created
