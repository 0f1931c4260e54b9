"""``accelerate launch`` with DeepSpeed on dslaunch through the `deepspeed` compat package, as Accelerate's
users run it (the real ``accelerate`` command; on one machine it starts the workers through torchrun and
hands them DeepSpeed's settings in ACCELERATE_* variables):

    accelerate launch --config_file zero3.yaml accelerate_loop.py                  (2 processes, ZeRO-3)
    accelerate launch --use_deepspeed --num_processes 1 --zero_stage 2 ... loop.py (1 process, ZeRO-2)

on CPU (DS_ACCELERATOR=cpu, gloo). The loss of every step and the trained model's loss over the data set
equal the same loop without DeepSpeed: Accelerate's CPU DDP under torchrun for 2 processes, and one plain
process for 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist import free_port
from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "tests" / "scripts" / "accelerate_loop.py"
CONFIG = REPO / "tests" / "configs" / "accelerate" / "zero3.yaml"
BIN = Path(sys.executable).parent


def test_accelerate_launch_with_deepspeed_matches_ddp(tmp_path: Path) -> None:
    # CPU workers: Accelerate chooses its device itself, so a GPU host hides its GPUs
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    accelerate = [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port())]
    fixed = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    commands = {
        "z3-2": [*accelerate, "--config_file", str(CONFIG), str(SCRIPT)],
        "ddp-2": [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                  str(SCRIPT), "--zero_stage", "0"],
        "z2-1": [*accelerate[:2], "--main_process_port", str(free_port()), "--use_deepspeed", *fixed,
                 "--num_processes", "1", "--zero_stage", "2", "--gradient_clipping", "1.0",
                 "--gradient_accumulation_steps", "1", str(SCRIPT)],
        "plain-1": [sys.executable, str(SCRIPT), "--zero_stage", "0"],
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [*command, "--out", f"{name}.json"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, command in commands.items()
    }
    runs = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, output[-4000:]
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())

    for ds, ref, world, stage in (("z3-2", "ddp-2", 2, 3), ("z2-1", "plain-1", 1, 2)):
        got, want = runs[ds], runs[ref]
        assert got["type"] == "DistributedType.DEEPSPEED", got
        assert (got["num_processes"], got["zero_stage"]) == (world, stage)
        assert want["zero_stage"] == 0 and want["num_processes"] == world
        assert len(got["losses"]) == len(want["losses"]) == 5 * 2 // world
        for a, b in zip(got["losses"], want["losses"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (ds, got["losses"], want["losses"])
        assert abs(got["final_loss"] - want["final_loss"]) <= 1e-5 * want["final_loss"], (ds, got, want)
        assert want["final_loss"] < want["initial_loss"] - 0.5  # it trained


def test_accelerates_multi_node_deepspeed_command_and_env_file_are_understood(tmp_path: Path) -> None:
    """On several machines `accelerate launch` starts `deepspeed --hostfile ... --no_local_rank --launcher
    pdsh ...` itself and writes its environment to ./.deepspeed_env: Accelerate's own code builds both here
    (no processes), and our `deepspeed` command accepts every flag and reads every line of the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env
    from accelerate.utils.environment import convert_dict_to_env_variables

    from launcher import cli, envfwd
    from launcher.deepspeed_cli import translate

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=2\nworker-2 slots=2\n")
    argv = ["--use_deepspeed", "--num_machines", "2", "--num_processes", "4", "--zero_stage", "3",
            "--deepspeed_hostfile", str(hostfile), "--main_process_ip", "worker-1", "--machine_rank", "0",
            "--main_process_port", str(free_port()), "--mixed_precision", "bf16", "--dynamo_backend", "no",
            "train.py", "--lr", "1e-4"]  # fmt: skip
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    args.deepspeed_fields_from_accelerate_config = ""
    command, env = prepare_deepspeed_cmd_env(args)
    assert command[0] == "deepspeed"
    parsed = translate(command[1:])
    assert parsed.script_and_args == ["train.py", "--lr", "1e-4"]
    with cli.cli.make_context("deepspeed", [*parsed.dslaunch_args, *parsed.script_and_args]) as ctx:
        given = ctx.params
    assert (given["hostfile"], given["launcher"], given["num_gpus"]) == (str(hostfile), "pdsh", 2)
    assert given["no_local_rank"] and given["master_addr"] == "worker-1"

    (tmp_path / ".deepspeed_env").write_text("".join(convert_dict_to_env_variables(env)))
    forwarded = envfwd.collect({}, tmp_path, tmp_path / "nohome").values
    assert forwarded["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert forwarded["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert forwarded["ACCELERATE_MIXED_PRECISION"] == "bf16"
