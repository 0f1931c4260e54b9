"""train_gpt.py's model flags end to end: a Hugging Face GPT-2 from a config alone (--config_name,
--model_type), --pipeline_parallel and --tensor_parallel on 2 CPU workers under dslaunch, and the one-line
errors for what cannot work."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.dist import free_port
from tests.support.paths import REPO

ROOT = REPO
TRAIN = ROOT / "scripts" / "train_gpt.py"
DSLAUNCH = shutil.which("dslaunch", path=str(Path(sys.executable).parent))

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (test.sh installs it)",
)
needs_launcher = pytest.mark.skipif(DSLAUNCH is None, reason="needs the dslaunch command")

# A GPT-2 small enough for seconds on CPU; no dropout, so runs at different layouts compute the same.
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 64,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
COMMON = ["--steps", "3", "--log_interval", "1", "--seq_len", "32"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(args: list[str], *, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    head = [sys.executable] if ranks == 1 else [DSLAUNCH, "--num_gpus", str(ranks), "--master_port"]
    if ranks > 1:
        head.append(str(free_port()))
    return subprocess.run(
        [*head, str(TRAIN), *args], capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT
    )


def _losses(proc: subprocess.CompletedProcess[str]) -> list[float]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [float(v) for v in re.findall(r"step \d+/\d+ \| loss ([0-9.]+|nan|inf)", proc.stdout)]


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_GPT2))
    return folder


@needs_transformers
@needs_launcher
def test_config_name_trains_on_two_workers_like_one_process_with_the_same_global_batch(
    tiny_config: Path,
) -> None:
    """Random weights from the config, 2 gloo workers x 4 sequences vs 1 process x 8: the same losses."""
    single = _losses(_run(["--config_name", str(tiny_config), *COMMON, "--micro_batch_size", "8"]))
    two = _losses(
        _run(["--config_name", str(tiny_config / "config.json"), *COMMON, "--micro_batch_size", "4"], ranks=2)
    )
    assert len(single) == 3 and all(math.isfinite(v) for v in single), single
    assert single[-1] < single[0], single
    assert two == pytest.approx(single, abs=2e-4), (two, single)


@needs_transformers
def test_model_type_with_overrides_builds_the_overridden_size() -> None:
    proc = _run(
        [
            "--model_type",
            "gpt2",
            "--config_overrides",
            "n_embd=32,n_layer=1,n_head=2,vocab_size=256",
            *COMMON,
            "--micro_batch_size",
            "4",
        ]
    )
    losses = _losses(proc)
    # 256 x 32 tokens + 1024 x 32 positions + one block of 12 x 32^2 + biases and norms: 0.05M, not 124M
    assert "train_gpt: 0.05M params" in proc.stdout, proc.stdout
    assert len(losses) == 3 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("case", ["missing folder", "folder without config.json"])
def test_a_bad_config_name_is_one_line_saying_what_is_missing(tmp_path: Path, case: str) -> None:
    if case == "missing folder":
        name = tmp_path / "no-such-model"
        message = f"--config_name {name}: no such folder or file"
    else:
        name = tmp_path / "empty"
        name.mkdir()
        message = f"--config_name {name}: the folder lacks config.json"
    proc = _run(["--config_name", str(name), "--steps", "1"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"error: {message}", proc.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), proc.stderr


@needs_launcher
def test_pipeline_parallel_two_stages_train_the_builtin_gpt_and_resume_exactly(tmp_path: Path) -> None:
    """The built-in GPT as 2 stages (embedding and head tied across them), 2 micro-batches per step; a
    run saved at step 2 and resumed logs the uninterrupted run's losses for steps 3 and 4."""
    args = ["--pipeline_parallel", "2", "--n_layer", "2", "--log_interval", "1", "--seq_len", "32"]
    args += ["--micro_batch_size", "4"]
    proc = _run([*args, "--steps", "4"], ranks=2)
    losses = _losses(proc)
    assert "pipeline 2, tensor 1" in proc.stdout and "4 x 2 accumulation" in proc.stdout, proc.stdout
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.1, losses
    saving = [*args, "--save_dir", str(tmp_path / "ckpt"), "--save_interval", "2", "--resume"]
    assert _losses(_run([*saving, "--steps", "2"], ranks=2)) == losses[:2]
    resumed = _run([*saving, "--steps", "4"], ranks=2)
    assert "train_gpt: resumed from" in resumed.stdout and "pipe_stage_00_of_02" in resumed.stdout, (
        resumed.stdout
    )
    assert _losses(resumed) == losses[2:], resumed.stdout


@needs_transformers
@needs_launcher
def test_tensor_parallel_two_ranks_equal_one_process(tiny_config: Path) -> None:
    """AutoTP over 2 ranks (one data-parallel replica) computes what one process computes."""
    args = ["--config_name", str(tiny_config), *COMMON, "--micro_batch_size", "8"]
    single = _losses(_run(args))
    proc = _run([*args, "--tensor_parallel", "2"], ranks=2)
    tp = _losses(proc)
    assert "pipeline 1, tensor 2" in proc.stdout, proc.stdout
    assert len(tp) == 3 and tp[-1] < tp[0], tp
    assert tp == pytest.approx(single, abs=2e-4), (tp, single)


@needs_launcher
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline_parallel", "3"], "--pipeline_parallel 3 does not divide the 2 rank(s)"),
        (
            ["--tensor_parallel", "3", "--model_type", "gpt2"],
            "--tensor_parallel 3 does not divide the 2 rank(s)",
        ),
        (["--tensor_parallel", "2"], "--tensor_parallel 2 shards a Hugging Face GPT-2's projections"),
        (
            ["--tensor_parallel", "2", "--model_type", "gpt2", "--config_overrides", "n_embd=36,n_head=3"],
            "--tensor_parallel 2 does not divide the model's n_head = 3",
        ),
    ],
)
def test_a_degree_that_cannot_work_is_one_line(args: list[str], message: str) -> None:
    proc = _run([*args, "--steps", "1"], ranks=2)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    # both ranks fail the same way, unless the first to fail stops the other before it gets there (a race)
    one_rank = re.compile(r"rank [01] \(local rank [01]\) on \S+ exited with code 2: " + re.escape(message))
    assert f"failed the same way (exit code 2): {message}" in output or one_rank.search(output), output
    assert "Traceback" not in output, output
