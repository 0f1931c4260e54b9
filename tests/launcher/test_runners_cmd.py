"""Command lines of the remote runners (ssh, pdsh, mpirun, srun), checked without starting them: quoting
survives a shell, settings reach the tool, node selection matches the plan's order."""

from __future__ import annotations

import random
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import envfwd
from launcher.agent import decode_spec_arg
from launcher.errors import LaunchError
from launcher.plan import HostSlots, JobConfig, make_plan
from launcher.preflight import RemoteCheck, probe_command
from launcher.runners.base import RunnerOptions, agent_spec
from launcher.runners.fanout import agent_shell_command, merge_env_args
from launcher.runners.openmpi import mpirun_command
from launcher.runners.pdsh import PDSHRunner, pdsh_command
from launcher.runners.slurm import SlurmRunner, srun_command
from launcher.runners.ssh import remote_spec

NASTY_DIR = '/data/my runs/it\'s "here" $HOME'


def _sh_argv(command: str) -> list[str]:
    """How a POSIX shell splits ``command`` (what the remote login shell will do)."""
    out = subprocess.run(
        ["sh", "-c", 'for a in "$@"; do printf "%s\\0" "$a"; done', "sh", *shlex.split(command)],
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().split("\0")[:-1]


def test_ssh_agent_command_survives_a_shell_and_reports_each_failure(tmp_path: Path) -> None:
    # Run the exact command a remote login shell gets, here, with a directory name a shell could mangle.
    nasty = tmp_path / 'it\'s "here" $HOME `x`'
    nasty.mkdir()

    def sh(check: RemoteCheck) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["sh", "-c", probe_command(check)], capture_output=True, text=True, stdin=subprocess.DEVNULL
        )

    ok = sh(RemoteCheck(str(nasty), sys.executable, "launcher.agent"))
    assert ok.returncode == 0 and ok.stdout.startswith("@dslaunch-probe {"), ok
    # With call="main" the probe becomes the agent, which then wants its spec on stdin (here: none).
    agent = sh(RemoteCheck(str(nasty), sys.executable, "launcher.agent", call="main"))
    assert agent.returncode == 2 and "no spec on stdin" in agent.stdout
    assert sh(RemoteCheck(str(tmp_path / "gone"), sys.executable)).returncode == 101
    assert sh(RemoteCheck(str(nasty), str(tmp_path / "nopython"))).returncode == 102
    assert sh(RemoteCheck(str(nasty), sys.executable, "no_such_mod_q")).returncode == 103


def test_remote_spec_puts_forwarded_env_under_the_plan_and_swaps_the_interpreter() -> None:
    spec = {
        "env": {"MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "INFO"},
        "workers": [{"rank": 0, "argv": ["/head/python", "-u", "train.py", "/head/python"], "env": {}}],
    }
    fwd = {"NCCL_DEBUG": "WARN", "MASTER_ADDR": "evil", "HF_HOME": "/hf"}
    out = remote_spec(spec, fwd, "/remote/python", "/head/python")
    assert out["env"] == {"MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "INFO", "HF_HOME": "/hf"}
    # Only the interpreter position changes; an argument equal to the path is the user's business.
    assert out["workers"][0]["argv"] == ["/remote/python", "-u", "train.py", "/head/python"]
    assert spec["workers"][0]["argv"][0] == "/head/python"  # the plan's spec is not mutated


def test_pdsh_command_merges_ssh_args_and_keeps_the_agent_command_intact() -> None:
    remote = agent_shell_command(NASTY_DIR, sys.executable, ["--spec-b64", "eJx-_=", "--node-host", "%h"])
    extra = {"ssh_config": "/etc/my ssh/config", "ssh_port": 2222}
    argv, env = pdsh_command(
        ["w1", "w2"], remote, extra, ["-u", "60"], environ={"PDSH_SSH_ARGS_APPEND": "-o ProxyJump=bastion"}
    )
    assert argv[:9] == ["pdsh", "-S", "-b", "-R", "ssh", "-f", "2", "-w", "w1,w2"]
    assert argv[9:11] == ["-u", "60"]  # --launcher_args before the command
    assert _sh_argv(argv[-1])[:3] == ["cd", "--", NASTY_DIR]
    assert argv[-1].endswith("--node-host %h")  # pdsh's substitution survives quoting
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    # The user's value is kept, ours appended (DeepSpeed overwrote it); a path with a space stays one arg.
    assert shlex.split(env["PDSH_SSH_ARGS_APPEND"]) == [
        "-o", "ProxyJump=bastion", "-o", "BatchMode=yes", "-F", "/etc/my ssh/config", "-p", "2222",
    ]  # fmt: skip
    assert merge_env_args(None, ["-p", "22"]) == "-p 22"


def test_mpirun_one_agent_per_host_with_the_ssh_settings() -> None:
    agent = [
        sys.executable,
        "-m",
        "launcher.agent",
        "--spec-b64",
        "X",
        "--node-index-env",
        "OMPI_COMM_WORLD_RANK",
    ]
    argv = mpirun_command(["w1", "w2", "w3"], agent, {"ssh_config": "/c"}, ["--mca", "x", "y"], as_root=True)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    assert argv[argv.index("--np") + 1] == "3"
    assert argv[argv.index("--host") + 1] == "w1:1,w2:1,w3:1"
    assert argv[argv.index("--map-by") + 1] == "ppr:1:node"
    i = argv.index("plm_rsh_args")
    assert argv[i - 1] == "--mca" and shlex.split(argv[i + 1]) == ["-F", "/c"]
    assert argv[-len(agent) - 3 :] == ["--mca", "x", "y", *agent]
    assert "--allow-run-as-root" not in mpirun_command(["w1"], agent, {}, as_root=False)


def test_srun_maps_task_i_to_the_ith_host_of_the_plan(tmp_path: Path) -> None:
    argv, env = srun_command(["b", "a"], ["py", "-m", "launcher.agent"], "/w d", "/tmp/h", ["--gres=gpu:8"])
    assert argv[:10] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--distribution=arbitrary",
                         "--kill-on-bad-exit=0", "--wait=0", "--input=all", "--export=ALL",
                         "--chdir=/w d"]  # fmt: skip
    assert argv[10:] == ["--gres=gpu:8", "py", "-m", "launcher.agent"]
    assert env == {"SLURM_HOSTFILE": "/tmp/h"}


def _plan(hosts: list[str], **env: str):
    job = JobConfig(script="train.py", python=sys.executable, master_addr="10.0.0.1", job_id="j1",
                    cwd="/work dir", user_env=env)  # fmt: skip
    return make_plan([HostSlots(h, (0, 1), gpus=False) for h in hosts], job)


def _specs(runner, plan):
    return [agent_spec(plan, n, grace_period=3, lifeline=runner.lifeline) for n in plan.nodes]


def test_slurm_runner_writes_the_hostfile_in_plan_order_and_selects_by_task_rank() -> None:
    runner = SlurmRunner(RunnerOptions(python=sys.executable, extra={"forward_env": False}))
    plan = _plan(["node9", "node10", "node2"])
    guard, env = runner.guard_command(plan, _specs(runner, plan))
    assert Path(env["SLURM_HOSTFILE"]).read_text() == "node9\nnode10\nnode2\n"
    runner.close()
    assert not Path(env["SLURM_HOSTFILE"]).exists()
    assert guard[3] == "stdin"  # stop/kill lines on srun's stdin reach every agent: a graceful stop
    srun = guard[guard.index("--") + 1 :]
    assert srun[0] == "srun" and srun[-2:] == ["--node-index-env", "SLURM_PROCID"]
    job = decode_spec_arg(srun[srun.index("--spec-b64") + 1])
    assert [n["host"] for n in job["nodes"]] == ["node9", "node10", "node2"]
    assert [n["node_rank"] for n in job["nodes"]] == [0, 1, 2]  # task i runs node i of the plan
    assert runner.lifeline == ("stdin", "parent")


def test_pdsh_runner_spec_in_argv_selects_each_node_by_name() -> None:
    runner = PDSHRunner(RunnerOptions(python=sys.executable, extra={"forward_env": False}))
    plan = _plan(["w1", "w2"], DSL_X="a b'c\"$d")
    runner.forwarded = envfwd.ForwardedEnv({"NCCL_DEBUG": "WARN"}, {"NCCL_DEBUG": "environment"})
    guard, env = runner.guard_command(plan, _specs(runner, plan))
    assert guard[1:5] == ["-m", "launcher.runners.fanout", "group", "5.0"]  # pdsh: end its whole tree
    pdsh = guard[guard.index("--") + 1 :]
    assert pdsh[0] == "pdsh" and env["PDSH_RCMD_TYPE"] == "ssh"
    remote = shlex.split(pdsh[-1])
    job = decode_spec_arg(remote[remote.index("--spec-b64") + 1])
    assert [n["host"] for n in job["nodes"]] == ["w1", "w2"]
    assert all(n["env"]["DSL_X"] == "a b'c\"$d" and n["env"]["NCCL_DEBUG"] == "WARN" for n in job["nodes"])
    assert remote[-2:] == ["--node-host", "%h"]


def test_a_spec_too_large_for_argv_is_refused_with_a_way_out() -> None:
    noise = "".join(random.Random(0).choices(string.ascii_letters, k=300_000))  # incompressible
    runner = PDSHRunner(RunnerOptions(python=sys.executable, extra={"forward_env": False}))
    plan = _plan(["w1", "w2"], BIG=noise)
    with pytest.raises(LaunchError, match="use --launcher ssh"):
        runner.guard_command(plan, _specs(runner, plan))


@pytest.mark.parametrize("host", ["alice@w1", "w1:2222"])
def test_fanout_tools_refuse_per_host_user_or_port(host: str) -> None:
    runner = PDSHRunner(RunnerOptions(python=sys.executable))
    plan = _plan([host, "w2"])
    with pytest.raises(LaunchError, match=rf"host '{host}': user@ and :port .* --launcher ssh only"):
        runner.check(plan)


@pytest.mark.parametrize("host", ["[::1]", "[fe80::1]:2222"])
def test_fanout_tools_refuse_ipv6_literals_with_a_way_out(host: str) -> None:
    # pdsh reads brackets as a host range (node[1-4]): the host needs a name there.
    runner = PDSHRunner(RunnerOptions(python=sys.executable))
    plan = _plan([host, "w2"])
    with pytest.raises(LaunchError, match=r"IPv6 addresses in the hostfile work with --launcher ssh only"):
        runner.check(plan)
