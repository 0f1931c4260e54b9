"""scripts/bench/common.py: every result line says which commit, when, on what machine and from which
command it came (also from a copy of the tree without .git), result files are named by date, hardware
and theme, and a measurement that runs past its time is stopped with every process it started."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.bench import common
from tests.support.paths import REPO

ROOT = REPO
HOST_THREADS = ROOT / "scripts" / "bench" / "host_threads.py"


def _env(**extra: str) -> dict[str, str]:
    """This environment without the variables a command line records, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not common.COMMAND_ENV.match(k) and k != common.COMMIT_ENV}
    return {**env, **extra}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_a_bench_line_carries_the_commit_date_machine_and_command(tmp_path: Path) -> None:
    out = tmp_path / "threads.jsonl"
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    command = [sys.executable, str(HOST_THREADS), "--params", "2e4", "--reps", "1", "--out", str(out)]
    env = _env(DSLAUNCH_OFFLOAD_UPDATE="host", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [json.loads(line) for line in out.read_text().splitlines()]  # the file has the same
    assert len(lines) == 6 and all(line["bench"] == "host_threads" for line in lines)
    stamps = [line["provenance"] for line in lines]
    assert all(stamp == stamps[0] for stamp in stamps)  # once per process
    stamp = stamps[0]
    date = datetime.datetime.strptime(stamp["date"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.timezone.utc
    )
    assert before <= date <= datetime.datetime.now(datetime.timezone.utc)
    # run from another directory: the script is named as the repository sees it, the override it ran with
    # (a DSLAUNCH_* variable changes what the offload rows measure) comes first
    assert stamp["command"] == (
        f"DSLAUNCH_OFFLOAD_UPDATE=host OMP_NUM_THREADS=1 python scripts/bench/host_threads.py --params 2e4 "
        f"--reps 1 --out {out}"
    )
    machine = stamp["machine"]
    assert machine["hostname"] == socket.gethostname() and machine["cores"] == os.cpu_count()
    assert machine["memory_gib"] > 0 and machine["cpu"]
    assert (machine["gpu"] is None) == (machine["gpu_count"] == 0)
    assert stamp["torch"] == importlib.metadata.version("torch")
    if shutil.which("git") and (ROOT / ".git").exists():
        changed = _git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)scripts/bench/results"
        )
        assert (stamp["commit"], stamp["commit_from"]) == (_git("rev-parse", "HEAD").strip(), "git")
        assert stamp["dirty"] is bool(changed.strip())


def test_the_variable_names_the_commit_even_where_a_git_directory_exists() -> None:
    # the GPU machine's copy of the tree carries a .git of its own, at an older commit: the variable, set
    # by whoever sent the tree, is what the results came from
    stamp = common.commit_info({"DSLAUNCH_BENCH_COMMIT": "0123abc-dirty"}, start=ROOT)
    assert stamp == {"commit": "0123abc", "dirty": True, "commit_from": "DSLAUNCH_BENCH_COMMIT"}


def test_a_copy_of_the_tree_without_git_takes_the_commit_from_the_variable(tmp_path: Path) -> None:
    """The GPU machine runs on a copy of the working tree without .git: the commit comes from
    DSLAUNCH_BENCH_COMMIT (`git describe --dirty` style), or is "unknown"; git is never asked."""
    copy = tmp_path / "tree" / "scripts" / "bench" / "common.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "bench" / "common.py", copy)
    if common.repo_root(copy) is not None:
        pytest.skip(f"{tmp_path} lies inside a git repository: the copy would find its .git")

    def stamp(**extra: str) -> dict:
        proc = subprocess.run(
            [sys.executable, str(copy)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(**extra),
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    dirty = stamp(DSLAUNCH_BENCH_COMMIT="0123abc-dirty")
    assert (dirty["commit"], dirty["dirty"], dirty["commit_from"]) == (
        "0123abc",
        True,
        "DSLAUNCH_BENCH_COMMIT",
    )
    assert dirty["command"] == "python scripts/bench/common.py"  # relative to the copied tree
    clean = stamp(DSLAUNCH_BENCH_COMMIT="0123abc")
    assert (clean["commit"], clean["dirty"]) == ("0123abc", False)
    unknown = stamp()
    assert (unknown["commit"], unknown["dirty"], unknown["commit_from"]) == ("unknown", None, None)
    assert unknown["machine"]["hostname"] == socket.gethostname() and unknown["date"].endswith("Z")


def test_result_files_are_named_by_date_hardware_and_theme() -> None:
    day = datetime.date(2026, 12, 3)
    assert common.result_path("offload", "h200", day) == common.RESULTS / "20261203_h200_offload.jsonl"
    labels = {
        ("NVIDIA H200", 1): "h200",
        ("NVIDIA H200", 8): "h200x8",
        ("NVIDIA H100 80GB HBM3", 1): "h100",
        ("NVIDIA A100-SXM4-80GB", 2): "a100x2",
        (None, 0): "cpu",
    }
    for (gpu, count), label in labels.items():
        assert common.hardware_label({"gpu": gpu, "gpu_count": count}) == label
    parser = argparse.ArgumentParser()
    common.add_out_argument(parser, "offload")
    assert common.out_file(parser.parse_args([]).out, "offload") is None  # stdout only unless asked
    assert common.out_file(parser.parse_args(["--out", "x.jsonl"]).out, "offload") == Path("x.jsonl")
    bare = common.out_file(parser.parse_args(["--out"]).out, "offload")
    assert bare.parent == common.RESULTS and re.fullmatch(r"\d{8}_[a-z0-9]+_offload\.jsonl", bare.name)
    # every kept result follows the pattern (BENCHMARKS.md cites them by these names)
    kept = sorted(p.name for p in common.RESULTS.glob("*.jsonl"))
    assert kept and all(re.fullmatch(r"\d{8}_[a-z0-9]+_[a-z0-9-]+\.jsonl", name) for name in kept), kept


def test_a_measurement_past_its_time_is_stopped_with_everything_it_started() -> None:
    sleeper = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    done = common.run_isolated([sys.executable, "-c", sleeper], timeout=3.0)
    assert done.timed_out and done.returncode is None and done.wall_s < 30
    child = int(done.stdout.split()[0])  # what it printed before the timeout still comes back
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), f"the measurement's own child {child} outlived the timeout"
    finished = common.run_isolated(
        [sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60
    )
    assert (finished.returncode, finished.stdout, finished.timed_out) == (3, "out\n", False)


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its reaper has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
