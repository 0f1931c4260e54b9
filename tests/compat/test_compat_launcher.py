"""The `deepspeed` command's own flags (launcher.deepspeed_cli, launcher.core_binding): real launches of
2 CPU workers that report their CPU affinity, the pid file and the per-rank logs; refused flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core_binding import cores_for_rank, parse_core_list
from launcher.deepspeed_cli import translate
from launcher.errors import LaunchError
from tests.support.paths import REPO

REPO = REPO
REPORT = REPO / "tests" / "scripts" / "report_binding.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def deepspeed(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("OMP_NUM_THREADS", None)  # binding sets it per rank
    return subprocess.run(
        [str(DEEPSPEED), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_core_lists_and_blocks() -> None:
    assert parse_core_list("0,2-4, 7") == [0, 2, 3, 4, 7]
    assert cores_for_rank([0, 1, 2, 3, 4], 1, 2) == [2, 3]  # the remainder (core 4) stays unused
    with pytest.raises(ValueError, match="'4-2' is not an increasing range"):
        parse_core_list("4-2")
    with pytest.raises(ValueError, match="cannot bind 3 ranks to 2 core"):
        cores_for_rank([0, 1], 0, 3)


def test_flag_translation() -> None:
    parsed = translate(["--num_gpus=2", "--enable_each_rank_log", "logs", "--force_multi", "--no_ssh_check",
                        "--master_port", "29600", "train.py", "--deepspeed", "--lr", "1"])  # fmt: skip
    assert parsed.dslaunch_args == [
        "--num_gpus=2",
        "--log_dir",
        "logs",
        "--launcher",
        "ssh",
        "--master_port",
        "29600",
    ]
    assert parsed.script_and_args == ["train.py", "--deepspeed", "--lr", "1"]
    assert parsed.notes == ["--no_ssh_check: accepted, no effect (dslaunch checks hosts when it connects)"]
    with pytest.raises(LaunchError, match="--bind_core_list needs --bind_cores_to_rank"):
        translate(["--bind_core_list", "0-3", "train.py"])
    with pytest.raises(LaunchError, match="--node_rank 1: dslaunch starts every node from one command"):
        translate(["--node_rank", "1", "train.py"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--autotuning", "run"],
         "--autotuning: DeepSpeed's autotuning is not supported by dslaunch; set the batch size"),
        (["--elastic_training"],
         "--elastic_training: DeepSpeed's elastic training is not supported by dslaunch; use --max_restarts"),
    ],
)  # fmt: skip
def test_refused_flags_exit_2_with_the_reason(flags: list[str], message: str, tmp_path: Path) -> None:
    result = deepspeed([*flags, "--num_gpus", "2", str(REPORT), str(tmp_path)], tmp_path)
    assert result.returncode == 2
    assert f"dslaunch: error: {message}" in result.stderr
    assert not list(tmp_path.glob("rank_*.json"))  # nothing started


def test_bind_cores_save_pid_and_rank_logs(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    result = deepspeed(["--num_gpus", "2", "--bind_cores_to_rank", "--save_pid", "--enable_each_rank_log",
                        "logs", str(REPORT), str(tmp_path)], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    per_rank = len(cores) // 2
    launcher_pids = set()
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert seen["cores"] == cores[rank * per_rank : (rank + 1) * per_rank]
        assert seen["omp"] == str(per_rank)
        assert seen["argv"] == [f"--local_rank={rank}", str(tmp_path)]  # DeepSpeed's argument position
        assert len(seen["pid_file_of"]) == 1  # the launcher's /tmp/<pid>.deepspeed, while the job ran
        launcher_pids.update(seen["pid_file_of"])
        log = (tmp_path / "logs" / f"rank_{rank}.log").read_text()
        assert f"rank {rank} bound to {seen['cores']}" in log
    (pid,) = launcher_pids
    assert not os.path.exists(f"/tmp/{pid}.deepspeed")  # removed when the job ended

    last = str(cores[-1])
    result = deepspeed(["--num_gpus", "1", "--bind_cores_to_rank", "--bind_core_list", last, str(REPORT),
                        str(tmp_path)], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "rank_0.json").read_text())["cores"] == [int(last)]


def test_ds_report_says_which_deepspeed_is_importable() -> None:
    from launcher.deepspeed_report import find_deepspeed

    found = find_deepspeed()
    assert found.importable and found.is_dslaunch
    assert found.version == "0.20.2+dslaunch.0.1.0"
    assert Path(found.location or "") == REPO / "compat" / "deepspeed"
    where = REPO / "compat" / "deepspeed"
    expected = f"deepspeed 0.20.2+dslaunch.0.1.0: dslaunch's compatibility package, from {where}"
    assert found.describe() == expected
    # the installed ds_report command (both distributions install the same entry point) says so too
    report = subprocess.run([str(Path(sys.executable).parent / "ds_report"), "--json"], capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    checks = {c["name"]: c for c in json.loads(report.stdout)["checks"] if c["host"] is None}
    assert checks["deepspeed"]["status"] == "OK" and checks["deepspeed"]["detail"] == expected, checks


def test_help_lists_the_deepspeed_flags_then_dslaunchs(tmp_path: Path) -> None:
    result = deepspeed(["--help"], tmp_path)
    assert result.returncode == 0
    assert result.stdout.startswith("deepspeed: dslaunch's launcher under DeepSpeed's name.")
    assert "--bind_cores_to_rank" in result.stdout
    assert "Usage: dslaunch [OPTIONS] USER_SCRIPT" in result.stdout
