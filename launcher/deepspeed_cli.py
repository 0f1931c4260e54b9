"""The ``deepspeed`` command: dslaunch's launcher under DeepSpeed's name and flags.

DeepSpeed's launcher flags that ``dslaunch`` already has pass through unchanged. This module handles the
ones it does not (before the user script only; everything after the script is the script's):

- ``--enable_each_rank_log DIR``: ``--log_dir DIR`` (a log file per rank);
- ``--save_pid``: writes this launcher's pid to ``/tmp/<pid>.deepspeed`` (DeepSpeed's file) for the
  duration of the job;
- ``--force_multi``: the multi-node (ssh) runner even for one host;
- ``--bind_cores_to_rank`` / ``--bind_core_list``: each worker is pinned to its share of the cores
  (`launcher.core_binding`);
- ``--no_ssh_check``, ``--node_rank``-less single-node use and ``--venv_script`` / ``--comment`` /
  ``--account`` are accepted where they change nothing here, and said so;
- ``--autotuning``, ``--elastic_training``, ``--min_elastic_nodes``, ``--max_elastic_nodes`` and
  ``--no_ssh`` are refused with the reason and the nearest dslaunch option.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from launcher.errors import LaunchError

__all__ = ["DeepSpeedArgs", "main", "translate"]

# dslaunch flags that take a value: needed to find where the user script starts.
_VALUE_FLAGS = {
    "-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--num-nodes", "--num_gpus",
    "--num-gpus", "--num_accelerators", "--num-accelerators", "--master_addr", "--master-addr",
    "--master_port", "--master-port", "--launcher", "--launcher_args", "--launcher-args", "--log_dir",
    "--log-dir", "--max_restarts", "--max-restarts", "--grace_period", "--grace-period", "--env",
    "--ssh_config", "--ssh-config", "--ssh_port", "--ssh-port", "--remote_python", "--remote-python",
}  # fmt: skip

# Refused: (reason, what to use instead).
_REFUSED = {
    "--autotuning": (
        "DeepSpeed's autotuning is not supported by dslaunch",
        "set the batch size and ZeRO stage in the config; `ds_estimate` gives the memory of each choice",
    ),
    "--elastic_training": (
        "DeepSpeed's elastic training is not supported by dslaunch",
        "use --max_restarts N to restart a failed job at the same size",
    ),
    "--min_elastic_nodes": (
        "DeepSpeed's elastic training is not supported by dslaunch",
        "use --num_nodes N for a fixed size",
    ),
    "--max_elastic_nodes": (
        "DeepSpeed's elastic training is not supported by dslaunch",
        "use --num_nodes N for a fixed size",
    ),
    "--no_ssh": (
        "--no_ssh (start each node's workers by hand with --node_rank) is not supported by dslaunch",
        "let dslaunch reach the nodes over ssh, or use --launcher slurm/openmpi/pdsh",
    ),
}
_REFUSED_TAKES_VALUE = {"--autotuning", "--min_elastic_nodes", "--max_elastic_nodes"}
# Accepted, but they change nothing here: (takes a value, why).
_ACCEPTED_NO_EFFECT = {
    "--no_ssh_check": (False, "dslaunch checks hosts when it connects"),
    "--venv_script": (True, "workers use the launcher's interpreter (--remote_python to choose another)"),
    "--comment": (True, "a Slurm job comment; pass it with --launcher_args"),
    "--account": (True, "a Slurm account; pass it with --launcher_args"),
}


@dataclass
class DeepSpeedArgs:
    """The command line split into what dslaunch's CLI takes and what this module handles."""

    dslaunch_args: list[str] = field(default_factory=list)  # launcher flags for launcher.cli
    script_and_args: list[str] = field(default_factory=list)
    save_pid: bool = False
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    notes: list[str] = field(default_factory=list)


_HELP = """deepspeed: dslaunch's launcher under DeepSpeed's name. Besides dslaunch's flags (below):
  --bind_cores_to_rank          pin each worker to its block of this node's cores (OMP_NUM_THREADS = its size)
  --bind_core_list LIST         the cores to split, e.g. 0-7,16-23 (with --bind_cores_to_rank)
  --enable_each_rank_log DIR    a log file per rank in DIR (dslaunch's --log_dir)
  --save_pid                    write this launcher's pid to /tmp/<pid>.deepspeed while the job runs
  --force_multi                 the multi-node (ssh) runner even for one host
  refused: --autotuning, --elastic_training, --min/max_elastic_nodes, --no_ssh, --node_rank > 0
"""


def _split_flag(token: str) -> tuple[str, str | None]:
    if token.startswith("--") and "=" in token:
        name, value = token.split("=", 1)
        return name, value
    return token, None


def translate(argv: Sequence[str]) -> DeepSpeedArgs:
    """Split DeepSpeed's launcher command line (pure: no processes, no files)."""
    out = DeepSpeedArgs()
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("-") or token == "-":
            break  # the user script
        name, inline = _split_flag(token)
        canonical = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if canonical in _REFUSED:
            reason, instead = _REFUSED[canonical]
            raise LaunchError(f"{name}: {reason}; {instead}")
        takes_value = (
            canonical in ("--enable_each_rank_log", "--bind_core_list", "--node_rank")
            or _ACCEPTED_NO_EFFECT.get(canonical, (False, ""))[0]
            or (name in _VALUE_FLAGS and inline is None)
        )
        value = inline
        if takes_value and inline is None:
            if i + 1 >= len(args):
                raise LaunchError(f"{name} needs a value")
            i += 1
            value = args[i]
        _apply(out, token, name, canonical, value)
        i += 1
    out.script_and_args = args[i:]
    if out.bind_core_list is not None and not out.bind_cores_to_rank:
        raise LaunchError("--bind_core_list needs --bind_cores_to_rank (as in DeepSpeed)")
    return out


def _apply(out: DeepSpeedArgs, token: str, name: str, canonical: str, value: str | None) -> None:
    """Record one launcher flag (`value` is its value, or None for a switch)."""
    if canonical in _ACCEPTED_NO_EFFECT:
        why = _ACCEPTED_NO_EFFECT[canonical][1]
        shown = name if value is None else f"{name} {value}"
        out.notes.append(f"{shown}: accepted, no effect ({why})")
    elif canonical == "--enable_each_rank_log":
        out.dslaunch_args += ["--log_dir", str(value)]
    elif canonical == "--save_pid":
        out.save_pid = True
    elif canonical == "--force_multi":
        out.dslaunch_args += ["--launcher", "ssh"]
    elif canonical == "--bind_cores_to_rank":
        out.bind_cores_to_rank = True
    elif canonical == "--bind_core_list":
        out.bind_core_list = value
    elif canonical == "--node_rank":
        if value not in ("-1", "0"):
            raise LaunchError(
                f"--node_rank {value}: dslaunch starts every node from one command; run it once on the "
                "head node with a hostfile"
            )
    elif name in _VALUE_FLAGS:
        out.dslaunch_args += [token] if "=" in token else [token, str(value)]
    else:
        out.dslaunch_args.append(token)


def main(argv: Sequence[str] | None = None) -> None:
    from launcher import cli

    args = list(argv) if argv is not None else sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(_HELP, flush=True)  # then dslaunch's own flags
    try:
        parsed = translate(args)
        launch_args = parsed.dslaunch_args + _script_part(parsed)
    except LaunchError as exc:
        cli.say(f"error: {exc}")
        sys.exit(exc.exit_code)
    for note in parsed.notes:
        cli.say(note)
    pid_file = f"/tmp/{os.getpid()}.deepspeed" if parsed.save_pid else None
    if pid_file is not None:
        with open(pid_file, "w") as f:
            f.write(f"{os.getpid()}")
    try:
        cli.main(launch_args)
    finally:
        if pid_file is not None and os.path.exists(pid_file):
            os.remove(pid_file)


def _script_part(parsed: DeepSpeedArgs) -> list[str]:
    """The user script and its arguments; wrapped in the core binder when cores are bound."""
    if not parsed.bind_cores_to_rank:
        return parsed.script_and_args
    from launcher.core_binding import wrap_command

    return wrap_command(parsed.dslaunch_args, parsed.script_and_args, parsed.bind_core_list)
