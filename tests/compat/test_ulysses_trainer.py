"""Ulysses through Accelerate's ``ParallelismConfig(sp_backend="deepspeed")`` and the HF Trainer, unmodified,
on the `deepspeed` compat package, started the way users start it:

    accelerate launch --config_file sp.yaml hf_trainer_sp.py

(tests/configs/accelerate/ulysses_sp.yaml; the command line sets the process count, the ZeRO stage and the
sp / dp sizes over it, as users do). Accelerate registers the model with ``UlyssesSPAttentionHF``, wraps the
Trainer's DataLoader in ``UlyssesSPDataLoaderAdapter``, and the Trainer reduces each shard's loss over the
sequence group (``deepspeed_sp_compute_loss``); our engine takes the groups as its ``mpu``.

The reference is one process training the same whole sequences: each step's served shards, put back
together per sequence group, are one batch per data group; the loss is the mean of the data groups'
token means, gradients clipped at 1.0, AdamW. The Trainer's logged loss and gradient norm of every step
equal it within 1e-5 (relative), at sp 2 x dp 2 with ZeRO-3 (ALST's recipe; one launch of 4
processes, 27-74 s on the shared 2 cores: sp 4 at ZeRO-1 and sp 2 at ZeRO-2 would cost as much again each
and were checked by hand; see tests/runtime/sequence/test_sequence_engine.py for sp 2 x dp 2 at ZeRO-1/2/3
through our
API). The gradient norm is the check that matters: the Trainer keeps each shard's loss share or multiplies
it by sp by the installed `deepspeed` version (below 0.20.2 DeepSpeed's ZeRO-3 averaged over the sequence
group), and with clipping at 1.0 the losses alone would not show a gradient sp times too large.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib
import torch

from tests.support.dist import free_port
from tests.support.paths import REPO

REPO = REPO
SCRIPTS = REPO / "tests" / "scripts"
CONFIG = REPO / "tests" / "configs" / "accelerate" / "ulysses_sp.yaml"
BIN = Path(sys.executable).parent
RUNS = {"sp2xdp2-z3": (4, 2, 3)}  # name: (processes, sp, ZeRO stage)


def _launch(name: str, world: int, sp: int, stage: int, cwd: Path) -> subprocess.Popen:
    # CPU workers: Accelerate chooses its device itself, so a GPU host hides its GPUs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    command = [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()),
               "--config_file", str(CONFIG), "--num_processes", str(world), "--zero_stage", str(stage),
               "--parallelism_config_sp_size", str(sp),
               "--parallelism_config_dp_shard_size", str(world // sp),
               str(SCRIPTS / "hf_trainer_sp.py"), "--out", f"{name}.json"]  # fmt: skip
    out = subprocess.PIPE
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _reference(served: list[list[dict[str, list]]], sp: int) -> list[tuple[float, float]]:
    """(loss, gradient norm) of one process training each step's whole sequences (see the docstring)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from hf_trainer_sp import build_model
    finally:
        sys.path.remove(str(SCRIPTS))
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    world = len(served)
    out = []
    for step in range(len(served[0])):
        losses = []
        for first in range(0, world, sp):
            shards = [served[rank][step] for rank in range(first, first + sp)]
            ids = torch.cat([torch.tensor(s["input_ids"]) for s in shards], dim=1)
            targets = torch.cat([torch.tensor(s["shift_labels"]) for s in shards], dim=1)
            logits = model(input_ids=ids, use_cache=False).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        loss = sum(losses) / len(losses)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def test_trainer_with_accelerate_sp_equals_one_process(tmp_path: Path) -> None:
    declared = tomllib.loads((REPO / "compat" / "pyproject.toml").read_text())["project"]["version"]
    installed = metadata.version("deepspeed")
    assert installed == declared, f"deepspeed {installed} installed, compat says {declared}: reinstall compat"
    procs = {name: _launch(name, *spec, tmp_path) for name, spec in RUNS.items()}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, output[-4000:]
        world, sp, _ = RUNS[name]
        run = json.loads((tmp_path / f"{name}.json").read_text())
        assert (run["world"], run["sp"], run["engine"]) == (world, sp, "runtime.engine.engine")
        served = run["served"]
        # every rank served 8 shards of SEQ/sp tokens, and a group's shards make whole dataset rows
        assert [len(steps) for steps in served] == [8] * world
        assert all(len(row) == 32 // sp for steps in served for step in steps for row in step["input_ids"])
        want = _reference(served, sp)
        got = [(log["loss"], log["grad_norm"]) for log in run["logs"]]
        assert len(got) == 8, run["logs"]
        for (loss, norm), (ref_loss, ref_norm) in zip(got, want, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (name, got, want)
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (name, got, want)
        assert min(norm for _, norm in want) > 1.0  # every step clipped: the norm is what tells
