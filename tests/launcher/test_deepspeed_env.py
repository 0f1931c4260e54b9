"""DeepSpeed's ``.deepspeed_env`` (``K=V`` lines for every worker on other hosts, from the home and the
working directory; ``DS_ENV_FILE`` renames it), read by our launcher beside ``.dslaunch_env``: the file
order, what ``accelerate launch`` writes into it, and its values reaching workers on the sshd testbed under
both the ``dslaunch`` and the ``deepspeed`` commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import envfwd
from tests.support.multinode import base_args, job_env, worker
from tests.support.sshd_testbed import Testbed

DEEPSPEED = Path(sys.executable).parent / "deepspeed"  # the compat distribution's command

ENV_WORKER = """
import json, os
keys = ["RANK", "FROM_DS_HOME", "FROM_DS_CWD", "BOTH", "MASTER_ADDR"]
print("REPORT " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""


def test_deepspeed_env_files_apply_before_ours_home_before_cwd(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=ds-home\nB=ds-home\nC=ds-home\nD=ds-home\n")
    (home / ".dslaunch_env").write_text("B=dsl-home\n")
    (cwd / ".deepspeed_env").write_text("C=ds-cwd\nD=ds-cwd\n")
    (cwd / ".dslaunch_env").write_text("D=dsl-cwd\n")
    fwd = envfwd.collect({}, cwd, home)
    assert dict(fwd.values) == {"A": "ds-home", "B": "dsl-home", "C": "ds-cwd", "D": "dsl-cwd"}
    assert fwd.sources["C"] == f"{cwd / '.deepspeed_env'}:1"


def test_accelerates_dump_of_its_environment_leaves_the_plan_to_the_launcher(tmp_path: Path) -> None:
    # accelerate launch --num_machines 2 appends its whole environment to ./.deepspeed_env, a RANK or
    # MASTER_ADDR of the shell included: DeepSpeed's launcher overrides those, and so does the plan here.
    # The same line in our own file stays an error (it names the file and line).
    (tmp_path / ".deepspeed_env").write_text("ACCELERATE_USE_DEEPSPEED=true\nRANK=7\nMASTER_ADDR=elsewhere\n")
    fwd = envfwd.collect({}, tmp_path, tmp_path / "nohome")
    assert dict(fwd.values) == {"ACCELERATE_USE_DEEPSPEED": "true"}
    (tmp_path / ".dslaunch_env").write_text("RANK=7\n")
    with pytest.raises(envfwd.EnvFileError, match=r"\.dslaunch_env:1: RANK is set by dslaunch"):
        envfwd.collect({}, tmp_path, tmp_path / "nohome")


def test_ds_env_file_renames_deepspeeds_file(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("A=default-name\n")
    (tmp_path / "team.env").write_text("A=renamed\n")
    fwd = envfwd.collect({"DS_ENV_FILE": "team.env"}, tmp_path, tmp_path / "nohome")
    assert dict(fwd.values) == {"A": "renamed"}


def reports(stdout: str) -> dict[str, dict]:
    got = [json.loads(line.split("REPORT ", 1)[1]) for line in stdout.splitlines() if "REPORT " in line]
    return {r["RANK"]: r for r in got}


@pytest.mark.ssh
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["dslaunch", "deepspeed"])
def test_deepspeed_env_reaches_workers_on_other_hosts(
    sshd_hosts: Testbed, tmp_path: Path, command: str
) -> None:
    home, cwd = tmp_path / "home", tmp_path / "proj"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("FROM_DS_HOME=home value\nBOTH=home\n")
    (cwd / ".deepspeed_env").write_text("FROM_DS_CWD=cwd\nBOTH=cwd\nMASTER_ADDR=not-this\n")
    script = worker(tmp_path, ENV_WORKER)
    launcher = [sys.executable, "-m", "launcher.cli"] if command == "dslaunch" else [str(DEEPSPEED)]
    args = [*launcher, *base_args(sshd_hosts), "--num_gpus", "1", "--no_local_rank", str(script)]
    r = subprocess.run(args, env=job_env(HOME=str(home)), cwd=cwd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    got = reports(r.stdout)
    assert sorted(got) == ["0", "1"]  # one worker on each of the two hosts
    for rep in got.values():
        assert (rep["FROM_DS_HOME"], rep["FROM_DS_CWD"], rep["BOTH"]) == ("home value", "cwd", "cwd")
        assert rep["MASTER_ADDR"] == sshd_hosts.host("worker1").address  # the plan's, not the file's
