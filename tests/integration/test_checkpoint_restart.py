"""End to end: dslaunch restarts a job whose worker dies, and the job resumes from its last checkpoint.

`dslaunch --num_gpus 2 --max_restarts 1 scripts/train_gpt.py --save_interval 2 --resume --die_at_step 5`:
rank 0 SIGKILLs itself after step 5 on the first attempt, the launcher stops the other worker and starts
both again, the new workers load global_step4 and run steps 5-8. Every logged loss (steps 1-8, step 5
twice) equals the loss of the same step in an uninterrupted run, and so does the final one.
"""

from __future__ import annotations

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
DSLAUNCH = shutil.which("dslaunch", path=str(Path(sys.executable).parent))


def _start(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    args = [DSLAUNCH, "--num_gpus", "2", "--max_restarts", "1", "--master_port", str(free_port())]
    args += [
        str(ROOT / "scripts" / "train_gpt.py"),
        "--deepspeed_config",
        str(ROOT / "scripts/configs/zero2.json"),
    ]
    args += ["--model_size", "tiny", "--steps", "8", "--seq_len", "32", "--micro_batch_size", "4"]
    args += ["--log_interval", "1", "--save_dir", str(tmp_path / name), "--save_interval", "2", "--resume"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
    )


def _finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    return output


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: dslaunch then stops its workers itself."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _losses(output: str) -> list[tuple[int, str]]:
    # the worker's own lines (the launcher's failure summary repeats some of them)
    return [
        (int(s), loss) for s, loss in re.findall(r"(?m)^\[rank 0\] step (\d+)/8 \| loss ([0-9.]+)", output)
    ]


@pytest.mark.skipif(DSLAUNCH is None, reason="needs the dslaunch console script")
def test_killed_worker_restarts_from_the_last_checkpoint_and_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # both jobs at once (own ports): the machine waits on imports more than it computes
    jobs = [_start(tmp_path, "straight"), _start(tmp_path, "crashed", "--die_at_step", "5")]
    try:
        straight, crashed = (_finish(job) for job in jobs)
    finally:
        for job in jobs:
            _stop(job)
    want = dict(_losses(straight))
    assert sorted(want) == list(range(1, 9)), straight
    got = _losses(crashed)
    # attempt 0 logs steps 1-5 and dies; attempt 1 resumes at step 4's checkpoint and logs 5-8
    assert [step for step, _ in got] == [1, 2, 3, 4, 5, 5, 6, 7, 8], crashed
    assert "restarting all workers (restart 1 of 1)" in crashed, crashed
    assert re.search(r"resumed from \S+/global_step4 at step 4", crashed), crashed
    assert [(step, loss) for step, loss in got if loss != want[step]] == [], crashed
    final = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", crashed).group(2)
    assert final == re.search(r"loss ([0-9.]+) -> ([0-9.]+)", straight).group(2) == want[8]
