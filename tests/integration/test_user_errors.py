"""What a user sees when their input is wrong: one line and a hint, exit code 2, no traceback.

Real processes throughout, on CPU (DS_ACCELERATOR=cpu): the README's porting snippet, written out as a
file, launched by dslaunch on 2 ranks (it must accept the --local_rank=N every launcher appends), then
given a misspelt config key and a checkpoint with a flipped byte; the same errors from a plain
``python train.py``, with and without DSLAUNCH_TRACEBACK=1; the error file (TORCHELASTIC_ERROR_FILE) that
dslaunch reads; and a rendezvous port that another process holds.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.checkpoint.manifest import shard_file_name
from tests.support.dist import free_port
from tests.support.paths import REPO

ROOT = REPO
DSLAUNCH = [sys.executable, "-m", "launcher.cli"]

# What the README's snippet leaves to the user: the imports, a model whose forward(x, y) has .loss, data.
PRELUDE = """\
import argparse
import os

from runtime.data import SyntheticTokenDataset
from runtime.models import GPT, GPTConfig

model = GPT(GPTConfig.named("tiny", vocab_size=64, max_seq_len=16, n_layer=1))
dataset = SyntheticTokenDataset(vocab_size=64, seq_len=16, num_samples=16, seed=0)
"""
EPILOGUE = """
if os.environ.get("SAVE_TO"):
    engine.save_checkpoint(os.environ["SAVE_TO"])
if os.environ.get("LOAD_FROM"):
    engine.load_checkpoint(os.environ["LOAD_FROM"])
print(f"trained {engine.global_steps} steps on rank {engine.comm.rank}", flush=True)
"""
GOOD_CONFIG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
TYPO_CONFIG = {**GOOD_CONFIG, "zero_optimization": {"stgae": 2}}
TYPO_MESSAGE = 'zero_optimization.stgae: unknown key; did you mean "stage"?'


def readme_snippet() -> str:
    """The code block under the README's "Porting a DeepSpeed script" heading, as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Porting a DeepSpeed script", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + readme_snippet() + EPILOGUE, encoding="utf-8")
    for name, config in (("good.json", GOOD_CONFIG), ("typo.json", TYPO_CONFIG)):
        (tmp_path / name).write_text(json.dumps(config), encoding="utf-8")
    return script


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSLAUNCH_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _dslaunch(script: Path, config: str, **env: str) -> subprocess.CompletedProcess:
    args = [*DSLAUNCH, "--num_gpus", "2", "--master_port", str(free_port()), str(script)]
    args += ["--deepspeed_config", str(script.parent / config)]
    return subprocess.run(args, env=_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=180)


def _python(script: Path, config: str, **env: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(script), "--deepspeed_config", str(script.parent / config)]
    return subprocess.run(args, env=_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=120)


FAILED_LINE = re.compile(
    r"ranks 0-1 failed the same way \(exit code 2\)|rank [01] \(local rank [01]\) on \S+ exited with code 2: "
)


def _assert_one_clean_error(result: subprocess.CompletedProcess, message: str) -> None:
    """Exit code 2, the message exactly once (every rank's failure folded into one summary line), no
    traceback, no label doubled ("[rank 1] [rank1]:").

    Both ranks meet the same error, but whether the second has met it by the time the launcher stops it
    is a race (on a fast 16-core host the first rank to fail often stops the other before it gets there):
    the summary says "ranks 0-1 failed the same way" or names the one rank that failed first."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.count(message) == 1, output
    assert FAILED_LINE.search(output), output
    assert "Traceback" not in output, output
    assert not re.search(r"\[rank\d+\]:", output), output  # torch's excepthook label
    assert not re.search(r"\[rank \d+\] \[rank", output), output


def test_the_readme_snippet_runs_under_dslaunch_on_two_ranks(job: Path) -> None:
    # torch's C++ log lines after the rendezvous (made visible here) carry no "[rankN]:" label of torch's
    # next to dslaunch's
    result = _dslaunch(job, "good.json", TORCH_CPP_LOG_LEVEL="INFO", TORCH_DISTRIBUTED_DEBUG="DETAIL")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "unrecognized arguments" not in output
    # (lines logged inside init_process_group itself, before it returns, can still carry torch's label)
    collectives = [line for line in output.splitlines() if "Running collective" in line]
    assert collectives and not any(re.search(r"\[rank\d+\]:", line) for line in collectives), output
    # 16 samples, 2 ranks x micro batch 4: two optimizer steps on each rank
    assert "[rank 0] trained 2 steps on rank 0" in output and "[rank 1] trained 2 steps on rank 1" in output


def test_a_misspelt_config_key_under_dslaunch_is_one_clean_error(job: Path) -> None:
    _assert_one_clean_error(_dslaunch(job, "typo.json"), TYPO_MESSAGE)


def test_a_corrupted_checkpoint_under_dslaunch_is_one_clean_error(job: Path, tmp_path: Path) -> None:
    saved = _python(job, "good.json", SAVE_TO=str(tmp_path / "ckpt"))  # one rank: its shard is rank 0's
    assert saved.returncode == 0, saved.stdout + saved.stderr
    shard = tmp_path / "ckpt" / "global_step4" / shard_file_name(0)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    result = _dslaunch(job, "good.json", LOAD_FROM=str(tmp_path / "ckpt"))
    _assert_one_clean_error(result, f"{shard}: checksum mismatch")
    assert "hint: the file changed after it was saved" in result.stdout + result.stderr


def test_plain_python_prints_error_and_hint_and_the_traceback_only_when_asked(job: Path) -> None:
    plain = _python(job, "typo.json")
    assert plain.returncode == 2, plain.stderr
    lines = plain.stderr.strip().splitlines()
    assert lines == [f"error: {TYPO_MESSAGE}", lines[1]] and lines[1].startswith("hint: fix that key"), lines
    traced = _python(job, "typo.json", DSLAUNCH_TRACEBACK="1")
    assert traced.returncode == 2, traced.stderr
    assert traced.stderr.startswith("Traceback (most recent call last):"), traced.stderr
    assert f"runtime.config.reader.ConfigError: {TYPO_MESSAGE}" in traced.stderr
    assert traced.stderr.strip().splitlines()[-2:] == lines


RAISE = """
import sys
import runtime
from runtime.config import ConfigError
if sys.argv[1] == "user":
    raise ConfigError("zero_optimization.stage", "must be 0-3, got 7")
raise RuntimeError("boom")
"""


def test_the_error_file_says_what_failed_and_whether_it_was_the_users_input(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    env = _env(TORCHELASTIC_ERROR_FILE=str(path), DSLAUNCH_ERROR_FILE=str(path))
    user = subprocess.run(
        [sys.executable, "-c", RAISE, "user"], env=env, capture_output=True, text=True, timeout=60
    )
    assert user.returncode == 2 and user.stderr == "", user.stderr  # under dslaunch: the launcher prints it
    record = json.loads(path.read_text())["message"]
    assert record["message"] == "zero_optimization.stage: must be 0-3, got 7"
    info = record["extraInfo"]
    assert info["kind"] == "user_input" and info["hint"].startswith("fix that key in the config")
    assert info["py_callstack"].startswith("Traceback (most recent call last):")
    assert "ConfigError: zero_optimization.stage: must be 0-3, got 7" in info["py_callstack"]
    assert int(info["timestamp"]) > 1_600_000_000

    other = subprocess.run(
        [sys.executable, "-c", RAISE, "crash"], env=env, capture_output=True, text=True, timeout=60
    )
    assert other.returncode == 1 and "RuntimeError: boom" in other.stderr  # Python's own traceback
    assert other.stderr.startswith("Traceback (most recent call last):")
    record = json.loads(path.read_text())["message"]
    assert record["message"] == "RuntimeError: boom"
    assert record["extraInfo"]["kind"] == "exception" and record["extraInfo"]["hint"] == ""


def test_a_busy_rendezvous_port_names_the_address_and_the_flag(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        result = subprocess.run(
            [sys.executable, "-c", "import runtime; runtime.init_distributed()"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert (
        f"[rank 0] error: rank 0 cannot open the rendezvous at MASTER_ADDR:MASTER_PORT (127.0.0.1:{port}): "
        "the port is already in use on this host" in result.stderr
    ), result.stderr
    assert "[rank 0] hint: pass --master_port with a free port" in result.stderr, result.stderr
