"""Unit tests of the launch plan (launcher.plan) and of the agent spec built from it: no processes."""

from __future__ import annotations

import pytest

from launcher.agent import decode_spec_arg, encode_spec_arg
from launcher.errors import LaunchError
from launcher.hostfile import parse_hostfile, select_hosts
from launcher.plan import HostSlots, JobConfig, make_plan, worker_argv
from launcher.runners.base import AgentEvent, ForeignLine, OutputLine, agent_spec, parse_agent_line

JOB = JobConfig(script="train.py", script_args=("--lr", "0.1"), python="/py", job_id="j1", max_restarts=2)


def _hosts(text: str, **filters) -> list[HostSlots]:
    selected = select_hosts(parse_hostfile(text, "hf"), **filters)
    return [HostSlots(s.host, s.slots) for s in selected]


def test_heterogeneous_slots_give_local_ranks_within_each_node():
    plan = make_plan(_hosts("a slots=3\nb slots=2\nc slots=1\n"), JOB)
    got = [(w.rank, w.host, w.local_rank, w.node_rank) for w in plan.workers]
    assert got == [
        (0, "a", 0, 0),
        (1, "a", 1, 0),
        (2, "a", 2, 0),
        (3, "b", 0, 1),  # DeepSpeed's RANK % procs would say 3 % 2 = 1
        (4, "b", 1, 1),
        (5, "c", 0, 2),
    ]
    assert plan.world_size == 6
    b1 = plan.workers[4].env
    assert (b1["RANK"], b1["LOCAL_RANK"], b1["LOCAL_WORLD_SIZE"], b1["LOCAL_SIZE"]) == ("4", "1", "2", "2")
    assert (b1["NODE_RANK"], b1["GROUP_RANK"], b1["CROSS_RANK"], b1["CROSS_SIZE"]) == ("1", "1", "1", "3")
    assert b1["WORLD_SIZE"] == "6"


def test_include_keeps_named_slots_and_cuda_visible_devices_lists_them():
    plan = make_plan(_hosts("a slots=4\nb slots=4\n", include="b:1,3@a:2"), JOB)
    # hostfile order, not filter order; the node's slot list is its CUDA_VISIBLE_DEVICES
    assert [(n.host, n.slots) for n in plan.nodes] == [("a", (2,)), ("b", (1, 3))]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["2", "1,3", "1,3"]
    assert [w.env["LOCAL_RANK"] for w in plan.workers] == ["0", "0", "1"]


def test_exclude_drops_slots_and_empty_hosts():
    plan = make_plan(_hosts("a slots=2\nb slots=2\nc slots=1\n", exclude="a:0@c"), JOB)
    assert [(n.host, n.slots, n.node_rank) for n in plan.nodes] == [("a", (1,), 0), ("b", (0, 1), 1)]
    assert [w.rank for w in plan.workers] == [0, 1, 2]


def test_num_nodes_and_num_gpus_take_a_prefix():
    plan = make_plan(_hosts("a slots=4\nb slots=4\nc slots=4\n", num_nodes=2, num_gpus=2), JOB)
    assert [(n.host, n.slots) for n in plan.nodes] == [("a", (0, 1)), ("b", (0, 1))]


def test_env_of_every_worker():
    job = JobConfig(
        script="train.py",
        python="/py",
        master_addr="10.0.0.1",
        master_port=1234,
        job_id="job-7",
        max_restarts=3,
        user_env={"FOO": "bar"},
    )
    plan = make_plan([HostSlots("a", (0, 1))], job, attempt=2)
    env = plan.workers[1].env
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["DSLAUNCH_ATTEMPT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["DSLAUNCH_JOB_ID"] == env["TORCHELASTIC_RUN_ID"] == "job-7"
    assert env["FOO"] == "bar"
    # NCCL_NVLS_ENABLE is a node default (the node's own setting wins), OMP is computed by the agent
    assert dict(plan.nodes[0].env_defaults) == {"NCCL_NVLS_ENABLE": "0"}
    assert plan.nodes[0].omp_threads_auto
    assert "NCCL_NVLS_ENABLE" not in env and "OMP_NUM_THREADS" not in env


def test_user_settings_win_over_defaults():
    job = JobConfig(script="t.py", user_env={"NCCL_NVLS_ENABLE": "1", "OMP_NUM_THREADS": "4"})
    node = make_plan([HostSlots("a", (0, 1))], job).nodes[0]
    assert dict(node.env_defaults) == {}
    assert not node.omp_threads_auto
    assert node.workers[0].env["NCCL_NVLS_ENABLE"] == "1"
    # one worker on a node: nothing to divide, OMP is left alone
    assert not make_plan([HostSlots("a", (0,))], JOB).nodes[0].omp_threads_auto


def test_cpu_hosts_get_no_cuda_visible_devices():
    plan = make_plan([HostSlots("localhost", (0, 1, 2), gpus=False, local=True)], JOB)
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in plan.workers)


def test_labels_name_the_host_only_when_it_helps():
    one_local = make_plan([HostSlots("localhost", (0, 1), local=True)], JOB)
    assert [w.label for w in one_local.workers] == ["rank 0", "rank 1"]
    one_remote = make_plan([HostSlots("w1", (0,))], JOB)
    assert [w.label for w in one_remote.workers] == ["w1 rank 0"]
    two = make_plan([HostSlots("localhost", (0,), local=True), HostSlots("w1", (0,))], JOB)
    assert [w.label for w in two.workers] == ["localhost rank 0", "w1 rank 1"]


def test_worker_argv_forms():
    assert worker_argv(JOB, 3) == ("/py", "-u", "train.py", "--local_rank=3", "--lr", "0.1")
    mod = JobConfig(script="pkg.train", python="/py", module=True, no_local_rank=True)
    assert worker_argv(mod, 0) == ("/py", "-u", "-m", "pkg.train")
    exe = JobConfig(script="./run.sh", script_args=("x",), no_python=True)
    assert worker_argv(exe, 1) == ("./run.sh", "--local_rank=1", "x")


@pytest.mark.parametrize(
    ("job", "attempt", "message"),
    [
        (JobConfig(script="t.py", user_env={"RANK": "3"}), 0, "--env RANK=...: RANK is set by dslaunch"),
        (JobConfig(script="t.py", master_port=70000), 0, "--master_port 70000"),
        (JobConfig(script="t.py", module=True, no_python=True), 0, "--module and --no_python"),
        (JobConfig(script="t.py", max_restarts=1), 2, "attempt 2 is outside 0..1"),
    ],
)
def test_bad_jobs_are_refused(job, attempt, message):
    with pytest.raises(LaunchError, match=message.replace(".", r"\.")):
        make_plan([HostSlots("a", (0,))], job, attempt)


def test_agent_spec_shares_common_env_and_keeps_per_rank_env():
    plan = make_plan([HostSlots("a", (0, 1)), HostSlots("b", (0,))], JOB)
    spec = agent_spec(plan, plan.nodes[0], grace_period=3.0, lifeline=("parent",), log_dir="/l")
    assert spec["node_rank"] == 0 and spec["host"] == "a" and spec["lifeline"] == ["parent"]
    assert spec["env"]["WORLD_SIZE"] == "3" and "RANK" not in spec["env"]
    per_rank = [{"RANK": "0", "LOCAL_RANK": "0"}, {"RANK": "1", "LOCAL_RANK": "1"}]
    assert [w["env"] for w in spec["workers"]] == per_rank
    for w, planned in zip(spec["workers"], plan.nodes[0].workers, strict=True):
        assert {**spec["env"], **w["env"]} == dict(planned.env)
        assert w["argv"] == list(planned.argv)
    assert decode_spec_arg(encode_spec_arg(spec)) == spec


def test_protocol_lines_parse():
    assert parse_agent_line(b"12:hello: world\n") == OutputLine(12, b"hello: world")
    ev = parse_agent_line(b'@dslaunch {"ev":"exited","node":1,"rank":3,"code":7}\n')
    assert isinstance(ev, AgentEvent) and (ev.kind, ev.node, ev.data["code"]) == ("exited", 1, 7)
    assert parse_agent_line(b"Traceback (most recent call last):\n") == ForeignLine(
        b"Traceback (most recent call last):"
    )
    assert parse_agent_line(b"@dslaunch {not json") == ForeignLine(b"@dslaunch {not json")
