"""A save never touches the last complete checkpoint: one rank of two is SIGKILLed at each point of a save.

Each scenario is a real 2-rank gloo job (ZeRO-2 or ZeRO-3) that saves at step 1, trains step 2 and saves
again, mostly over the same tag ("last", as HF Trainer- and Lightning-style loops do), sometimes under a
new one. One rank stops at a chosen point of the second save (before any write, half-way through its
shard, before the manifest, right after the commit record, between the swap's two renames, before
`latest` moves) and is killed with SIGKILL; its peer is left to fail or is killed too. Then:

- without a process group, `latest` names a tag that loads, and the weights it holds are exactly step 1's
  (killed before the commit) or step 2's (killed after it): never neither, never a mix;
- a new 2-rank job resumes from it and trains to step 3, equal to an uninterrupted run, and its next save
  over the same tag leaves no staging folder, aside copy or commit record behind.

The same for a two-stage pipeline (one folder per stage, each with its own `latest`): the stages commit
together, so a rank killed while the other stage has already swapped its folder in still loads one step
everywhere.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import CheckpointIncomplete, CheckpointNotFound, read_latest
from runtime.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint
from runtime.checkpoint.durable import FAULT_ENV, FAULT_MARKER_ENV
from runtime.checkpoint.manifest import COMMIT_RECORD
from runtime.pipe.checkpoint import get_fp32_state_dict_from_pipeline_checkpoint, pipeline_stage_dirs
from tests.support.dist import _context, _worker, run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch
from tests.support.pipe_cases import data_iterator, layers_of, mse

WORLD = 2


def _config(stage: int) -> dict:
    return {
        "train_batch_size": 12,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700},
    }


@dataclass(frozen=True)
class Scenario:
    stage: int  # ZeRO stage; 0 for the pipeline
    point: str  # runtime.checkpoint.durable.FAULT_POINTS
    victim: int  # the rank that stops there and is killed
    overwrite: bool  # the second save reuses the first one's tag
    pipeline: bool = False

    @property
    def name(self) -> str:
        kind = "pipe" if self.pipeline else f"zero{self.stage}"
        return f"{kind}-{self.point}-rank{self.victim}-{'last' if self.overwrite else 'new'}"

    @property
    def tags(self) -> tuple[str, str]:
        return ("last", "last") if self.overwrite else ("global_step1", "global_step2")

    @property
    def committed(self) -> bool:  # killed after the commit record: the new save is the checkpoint
        return self.point in ("commit", "swap", "latest", "cleanup")


SCENARIOS = [
    Scenario(2, "start", 1, True),  # before anything is written
    Scenario(2, "shard", 1, True),  # half of rank 1's shard written, under its temporary name
    Scenario(2, "manifest", 0, False),  # every shard and the engine state written, no manifest
    Scenario(2, "swap", 0, True),  # the old folder renamed aside, the new one not yet in its place
    Scenario(2, "latest", 0, False),  # the new tag swapped in, `latest` not yet moved
    Scenario(3, "shard", 1, True),
    Scenario(3, "manifest", 0, True),
    Scenario(3, "commit", 0, True),  # the commit record written, nothing swapped yet
    Scenario(3, "swap", 0, True),
    Scenario(3, "latest", 0, True),
]
PIPELINE = [  # rank r is stage r; rank 0 also writes the commit record
    Scenario(0, "manifest", 1, True, pipeline=True),  # stage 0 complete, stage 1 without its manifest
    Scenario(0, "commit", 0, True, pipeline=True),  # committed, neither stage swapped
    Scenario(0, "swap", 1, True, pipeline=True),  # stage 0 swapped in (or about to), stage 1 half-way
]


def _step(engine, rank: int, world: int) -> None:
    if hasattr(engine, "train_batch"):  # the pipeline: one stage a rank, no data parallelism
        engine.train_batch(data_iterator("mlp", engine.global_steps, 4, 8, 0, 1))
        return
    x, y = rank_batch(engine.global_steps, 0, 12, rank, world)
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _engine(stage: int, pipeline: bool = False):
    import runtime

    if pipeline:
        from runtime.pipe import PipelineEngine, PipelineModule

        module = PipelineModule(layers_of("mlp"), num_stages=WORLD, loss_fn=mse, seed_layers=True)
        config = {
            "train_batch_size": 32,
            "train_micro_batch_size_per_gpu": 8,
            "steps_per_print": 0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        }
        return PipelineEngine(module, config)
    model = make_model(0)
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=_config(stage))
    return engine


def _save_twice(rank: int, world: int, case: Scenario, save_dir: str, marker: str) -> None:
    """Save at step 1, then stop at `case.point` on `case.victim` while saving step 2 (never returns
    there: the fault hook sleeps until the test kills the process)."""
    engine = _engine(case.stage, case.pipeline)
    _step(engine, rank, world)
    engine.save_checkpoint(save_dir, tag=case.tags[0])
    states = [engine.full_state_dict(rank0_only=False)]
    _step(engine, rank, world)
    states.append(engine.full_state_dict(rank0_only=False))
    if rank == 0 or case.pipeline:  # each stage holds its own layers
        torch.save(states, os.path.join(save_dir, "..", f"states{rank}.pt"))
    if rank == case.victim:
        os.environ[FAULT_ENV] = case.point
        os.environ[FAULT_MARKER_ENV] = marker
    engine.save_checkpoint(save_dir, tag=case.tags[1])


def _start(case: Scenario, save_dir: Path, marker: Path, ctx, results) -> list:
    store = tempfile.mkdtemp(prefix="dslaunch-swap-")
    args = (case, str(save_dir), str(marker))
    procs = [
        ctx.Process(
            target=_worker,
            args=(_save_twice, rank, WORLD, args, os.path.join(store, "s"), 0, "file", "cpu", results),
            daemon=True,
        )
        for rank in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    return procs


def _kill_at_fault_points(tmp_path: Path, scenarios: list[Scenario]) -> None:
    ctx = _context()
    results = ctx.Queue()  # the survivors' errors land here; the disk is what is checked
    running = {}
    for case in scenarios:
        (tmp_path / case.name / "ckpt").mkdir(parents=True)
        marker = tmp_path / case.name / "paused"
        running[case] = (_start(case, tmp_path / case.name / "ckpt", marker, ctx, results), marker)
    try:
        deadline = time.monotonic() + 150
        for case, (procs, marker) in running.items():
            while not marker.exists():
                dead = [p.exitcode for p in procs if not p.is_alive()]
                assert not dead, f"{case.name}: a rank exited (codes {dead}) before the fault point"
                assert time.monotonic() < deadline, f"{case.name}: the save never reached {case.point}"
                time.sleep(0.05)
            victim = procs[case.victim]
            os.kill(victim.pid, signal.SIGKILL)  # mid-save, no cleanup of any kind
            victim.join(timeout=30)
            assert victim.exitcode == -signal.SIGKILL, case.name
        for procs, _ in running.values():  # the peer fails on the lost connection, or is killed below
            for proc in procs:
                proc.join(timeout=20)
    finally:
        for procs, _ in running.values():
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        results.close()


def _resume(rank: int, world: int, root: str, scenarios: list[Scenario]) -> dict:
    """An uninterrupted run to step 3, then each crashed scenario resumed and trained to step 3, then saved
    over its tag again."""
    out = {}
    for stage, pipeline in sorted({(case.stage, case.pipeline) for case in scenarios}):
        engine = _engine(stage, pipeline)
        for _ in range(3):
            _step(engine, rank, world)
        out[stage, pipeline] = engine.full_state_dict(rank0_only=False)
    for case in scenarios:
        save_dir = os.path.join(root, case.name, "ckpt")
        engine = _engine(case.stage, case.pipeline)
        engine.load_checkpoint(save_dir)
        resumed_at = engine.global_steps
        while engine.global_steps < 3:
            _step(engine, rank, world)
        folder = engine.save_checkpoint(save_dir, tag=case.tags[1])
        left = sorted(p.name for p in Path(save_dir).iterdir())
        if case.pipeline:
            left.append(sorted(p.name for p in Path(folder).parent.iterdir()))
        out[case.name] = (resumed_at, engine.full_state_dict(rank0_only=False), left)
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_after_kill(tmp_path: Path, case: Scenario) -> None:
    save_dir = tmp_path / case.name / "ckpt"
    step1, step2 = ({}, {})
    for states in (tmp_path / case.name).glob("states*.pt"):
        one, two = torch.load(states, weights_only=True)
        step1.update(one)
        step2.update(two)
    old_tag, new_tag = case.tags
    if case.pipeline:  # every stage folder's `latest`, and the stages' weights together
        stages = pipeline_stage_dirs(save_dir)
        if case.point == "swap":  # stage 0 swapped in before its rank failed on the lost peer; stage 1 not
            seen = [sorted(p.name for p in d.iterdir() if p.is_dir()) for d in stages]
            assert seen == [["last"], [".last~new", ".last~old"]], seen
        assert [read_latest(d) for d in stages] == [new_tag if case.committed else old_tag] * WORLD, case.name
        state = get_fp32_state_dict_from_pipeline_checkpoint(save_dir)
    else:
        assert read_latest(save_dir) == (new_tag if case.committed else old_tag), case.name
        state = get_fp32_state_dict_from_checkpoint(save_dir)  # no process group: what `latest` gives
    assert _equal(state, step2 if case.committed else step1), case.name
    if not case.overwrite and not case.committed:  # the unfinished new tag refuses to load
        error = CheckpointIncomplete if case.point != "start" else CheckpointNotFound
        with pytest.raises(error, match="global_step2"):
            get_fp32_state_dict_from_checkpoint(save_dir, "global_step2")


def _check_resumed(resumed: list[dict], scenarios: list[Scenario]) -> None:
    for rank, seen in enumerate(resumed):
        for case in scenarios:
            resumed_at, state, left = seen[case.name]
            assert resumed_at == (2 if case.committed else 1), (rank, case.name)
            # the uninterrupted run's weights
            assert _equal(state, seen[case.stage, case.pipeline]), (rank, case.name)
            # no .last~new, .last~old or commit record left; zero_to_fp32.py from the first save
            tags = sorted({*case.tags, "latest", "zero_to_fp32.py"})
            if case.pipeline:
                stages = [f"pipe_stage_{s:02d}_of_{WORLD:02d}" for s in range(WORLD)]
                assert left == [*stages, "zero_to_fp32.py", tags], left
            else:
                assert left == tags, (rank, case.name, left)
            assert COMMIT_RECORD not in left


@pytest.mark.timeout(400)
def test_a_rank_killed_anywhere_in_a_save_leaves_a_latest_that_loads_the_old_or_the_new_state(
    tmp_path: Path,
) -> None:
    _kill_at_fault_points(tmp_path, SCENARIOS)
    for case in SCENARIOS:
        _check_after_kill(tmp_path, case)
    _check_resumed(run_distributed(_resume, WORLD, str(tmp_path), SCENARIOS, timeout=240), SCENARIOS)


@pytest.mark.timeout(300)
def test_pipeline_stages_commit_together_when_a_rank_is_killed_in_a_save(tmp_path: Path) -> None:
    _kill_at_fault_points(tmp_path, PIPELINE)
    for case in PIPELINE:
        _check_after_kill(tmp_path, case)
    _check_resumed(run_distributed(_resume, WORLD, str(tmp_path), PIPELINE, timeout=240), PIPELINE)
