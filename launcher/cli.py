"""``dslaunch``: the command line. Parses DeepSpeed-compatible flags, resolves hosts, builds the plan,
picks a runner and hands over to the supervisor.

Everything that can be wrong with the command line, the hostfile or this machine is found here, before
anything starts, and reported as one line ``dslaunch: error: ...`` with exit code 2. What this machine
offers (GPUs, ``DS_ACCELERATOR=cpu``, a free rendezvous port) is decided in ``launcher.machine``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Sequence

import click

from launcher.errors import LaunchError
from launcher.hostfile import (
    HostEntry,
    Hostfile,
    SelectedHost,
    check_one_line_per_machine,
    read_hostfile,
    select_hosts,
)
from launcher.machine import (
    DEFAULT_MASTER_PORT,
    Devices,
    choose_master_port,
    default_slots,
    is_local_host,
    machine_keys,
    master_addr_problem,
    this_machine_devices,
)
from launcher.plan import HostSlots, JobConfig, make_plan
from launcher.runners import DEFAULT_MULTI_NODE, get_runner
from launcher.runners.base import RunnerOptions
from launcher.supervisor import SuperviseOptions, run_job

DEEPSPEED_HOSTFILE = "/job/hostfile"
THIS_MACHINE = "<this machine>"


def say(message: str) -> None:
    sys.stderr.write(f"dslaunch: {message}\n")
    sys.stderr.flush()


# -- hosts -----------------------------------------------------------------------------------------
def _resolve_hosts(
    hostfile: str | None, include: str, exclude: str, num_nodes: int | None, num_gpus: int | None
) -> tuple[list[HostSlots], str | None]:
    """Hosts with slots, plus a notice to print once (CPU workers) or None."""
    devices = this_machine_devices()
    gpus = devices.gpu_ids
    if hostfile is None and os.path.isfile(DEEPSPEED_HOSTFILE):
        hostfile = DEEPSPEED_HOSTFILE
        say(f"using the hostfile {DEEPSPEED_HOSTFILE} (pass --hostfile to choose another)")
    notice = None
    if hostfile is not None:
        hf = read_hostfile(hostfile)
    else:
        slots, notice = default_slots(devices, num_gpus)
        entry = HostEntry("localhost", "localhost", slots, 0, f"localhost slots={slots}")
        hf = Hostfile(THIS_MACHINE, (entry,))
    selected = select_hosts(hf, include=include, exclude=exclude, num_nodes=num_nodes, num_gpus=num_gpus)
    if len(selected) > 1:
        check_one_line_per_machine(hf.path, selected, machine_keys([s.host for s in selected]))
    hosts = []
    for sel in selected:
        if is_local_host(sel.host):
            hosts.append(_local_slots(sel, hf, devices))
            if not gpus and notice is None:
                notice = f"{devices.why_cpu}: starting {len(sel.slots)} CPU worker(s) on {sel.host}"
        else:
            # DS_ACCELERATOR travels to remote workers (launcher.envfwd): CPU workers there too.
            hosts.append(HostSlots(sel.host, sel.slots, gpus=not devices.cpu_forced, local=False))
    return hosts, notice


def _local_slots(sel: SelectedHost, hf: Hostfile, devices: Devices) -> HostSlots:
    gpus = devices.gpu_ids
    if not gpus:
        return HostSlots(sel.host, sel.slots, gpus=False, local=True)
    if max(sel.slots) >= len(gpus):
        where = f"{hf.path}:{sel.entry.line}: " if sel.entry.line else ""
        raise LaunchError(
            f"{where}{sel.host} uses slot {max(sel.slots)} but this machine has {len(gpus)} visible GPU(s)"
            + (f": {sel.entry.text!r}" if sel.entry.line else "")
        )
    if not all(g.isdigit() for g in gpus):
        # UUID or MIG names in CUDA_VISIBLE_DEVICES: keep the user's variable, pick by LOCAL_RANK.
        return HostSlots(sel.host, sel.slots, gpus=False, local=True)
    return HostSlots(sel.host, tuple(int(gpus[s]) for s in sel.slots), gpus=True, local=True)


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or not (key.replace("_", "a").isalnum() and not key[0].isdigit()):
            raise LaunchError(f"--env {item!r}: expected NAME=VALUE with NAME a variable name")
        env[key] = value
    return env


def _check_script(script: str, module: bool, no_python: bool) -> None:
    if module:
        return
    if no_python:
        if shutil.which(script) is None:
            raise LaunchError(f"{script!r} is not an executable file or a command on PATH (--no_python)")
    elif os.path.isdir(script):
        raise LaunchError(
            f"user_script {script!r} is a directory, not a script: name the .py file in it"
            " (or pass --module to run a package)"
        )
    elif not os.path.isfile(script):
        raise LaunchError(f"user_script {script!r} does not exist (working directory {os.getcwd()})")


# -- the command -----------------------------------------------------------------------------------
@click.command(
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
    epilog="Everything after USER_SCRIPT goes to the script, e.g. dslaunch --num_gpus 2 train.py --lr 3e-4",
)
@click.option(
    "-H", "--hostfile", default=None, metavar="PATH", help="'host slots=N' lines; default: this machine."
)
@click.option("-i", "--include", default="", metavar="FILTER", help="Use only these hosts/slots: h0@h1:0,2.")
@click.option("-e", "--exclude", default="", metavar="FILTER", help="Do not use these hosts/slots: h1:3.")
@click.option("--num_nodes", "--num-nodes", type=int, default=None, help="Use the first N hosts.")
@click.option(
    "--num_gpus",
    "--num-gpus",
    "--num_accelerators",
    "--num-accelerators",
    "num_gpus",
    type=int,
    default=None,
    help="Workers per host (slots 0..N-1); without GPUs (or with DS_ACCELERATOR=cpu), N CPU workers.",
)
@click.option("--master_addr", "--master-addr", default="", help="Rank 0's address (default: first host).")
@click.option(
    "--master_port",
    "--master-port",
    type=int,
    default=None,
    help=f"Rank 0's port (default {DEFAULT_MASTER_PORT}; on one machine a free one if that is busy).",
)
@click.option("--module", is_flag=True, help="USER_SCRIPT is a module: python -m USER_SCRIPT.")
@click.option("--no_python", "--no-python", is_flag=True, help="Run USER_SCRIPT directly, not with python.")
@click.option("--no_local_rank", "--no-local-rank", is_flag=True, help="Do not pass --local_rank=N.")
@click.option("--launcher", default=None, help="local, ssh, pdsh, openmpi, slurm (default: local or ssh).")
@click.option("--launcher_args", "--launcher-args", default="", help="Extra arguments for the launcher tool.")
@click.option("--log_dir", "--log-dir", default=None, metavar="DIR", help="Write DIR/rank_N.log per rank.")
@click.option("--max_restarts", "--max-restarts", type=int, default=0, show_default=True,
              help="After a failure, restart all workers up to N times (env DSLAUNCH_ATTEMPT).")  # fmt: skip
@click.option("--grace_period", "--grace-period", type=float, default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when stopping workers.")  # fmt: skip
@click.option("--env", "env_items", multiple=True, metavar="K=V", help="Set a variable for every worker.")
@click.option("--ssh_config", "--ssh-config", default=None, metavar="PATH",
              help="ssh_config for every SSH connection (default: ~/.ssh/config).")  # fmt: skip
@click.option("--ssh_port", "--ssh-port", type=int, default=None, help="SSH port of every host.")
@click.option("--remote_python", "--remote-python", default=None, metavar="PATH",
              help="Interpreter on remote hosts (default: this interpreter's path).")  # fmt: skip
@click.option("--accept_new_host_keys", "--accept-new-host-keys", is_flag=True,
              help="Record host keys missing from known_hosts (changed keys: refused).")  # fmt: skip
@click.argument("user_script")
@click.argument("user_args", nargs=-1, type=click.UNPROCESSED)
def cli(
    hostfile: str | None,
    include: str,
    exclude: str,
    num_nodes: int | None,
    num_gpus: int | None,
    master_addr: str,
    master_port: int | None,
    module: bool,
    no_python: bool,
    no_local_rank: bool,
    launcher: str | None,
    launcher_args: str,
    log_dir: str | None,
    max_restarts: int,
    grace_period: float,
    env_items: tuple[str, ...],
    ssh_config: str | None,
    ssh_port: int | None,
    remote_python: str | None,
    accept_new_host_keys: bool,
    user_script: str,
    user_args: tuple[str, ...],
) -> int:
    """Start USER_SCRIPT once per GPU (or slot) on this machine or on the hosts of a hostfile."""
    # DeepSpeed's "unset" is -1; accept it so existing command lines keep working.
    num_nodes = None if num_nodes == -1 else num_nodes
    num_gpus = None if num_gpus == -1 else num_gpus
    for flag, count in (("--num_gpus", num_gpus), ("--num_nodes", num_nodes)):
        if count is not None and count < 1:
            raise LaunchError(f"{flag} {count}: must be at least 1")
    if max_restarts < 0:
        raise LaunchError(f"--max_restarts {max_restarts}: must be 0 or more")
    if grace_period < 0:
        raise LaunchError(f"--grace_period {grace_period}: must be 0 or more")
    for flag, port_number in (("--master_port", master_port), ("--ssh_port", ssh_port)):
        if port_number is not None and not 1 <= port_number <= 65535:
            raise LaunchError(f"{flag} {port_number}: not a TCP port (1-65535)")
    if log_dir:
        _check_log_dir(log_dir)
    if module and no_python:
        raise LaunchError("--module and --no_python cannot be used together")
    try:
        extra_args = tuple(shlex.split(launcher_args))
    except ValueError as exc:
        raise LaunchError(f"--launcher_args {launcher_args!r}: {exc}") from None
    user_env = _parse_env(env_items)
    hosts, notice = _resolve_hosts(hostfile, include, exclude, num_nodes, num_gpus)
    single_local = len(hosts) == 1 and hosts[0].local
    runner_cls = get_runner(launcher or ("local" if single_local else DEFAULT_MULTI_NODE))
    runner = runner_cls(
        RunnerOptions(
            python=sys.executable,
            grace_period=grace_period,
            launcher_args=extra_args,
            env=user_env,
            extra={
                "ssh_config": ssh_config,
                "ssh_port": ssh_port,
                "remote_python": remote_python,
                "accept_new_host_keys": accept_new_host_keys,
            },
        )
    )
    if master_addr.startswith("[") and master_addr.endswith("]"):
        master_addr = master_addr[1:-1]  # [IPv6] as in the hostfile; torch's rendezvous wants it bare
    master_is_here = hosts[0].local or (bool(master_addr) and is_local_host(master_addr))
    if master_addr and hosts[0].local:  # rank 0 starts here: it must be able to serve the rendezvous
        problem = master_addr_problem(master_addr)
        if problem:
            raise LaunchError(
                f"--master_addr {master_addr}: rank 0 runs on this machine, but {problem}; the ranks would "
                "wait 30 minutes for a rendezvous nobody serves (leave --master_addr out on one machine)"
            )
    if not master_addr:
        master_addr = "127.0.0.1" if single_local else runner.master_addr(hosts[0].host)
    _check_script(user_script, module, no_python)
    port = choose_master_port(master_port, single_node=single_local, master_is_here=master_is_here)
    job = JobConfig(
        script=user_script,
        script_args=tuple(user_args),
        python=sys.executable,
        module=module,
        no_python=no_python,
        no_local_rank=no_local_rank,
        master_addr=master_addr,
        master_port=port.port,
        job_id=f"dsl-{os.urandom(4).hex()}",  # not secrets.token_hex: its import costs 10-20 ms
        max_restarts=max_restarts,
        cwd=os.getcwd(),
        user_env=user_env,
    )
    first = make_plan(hosts, job, 0)  # validates; attempt 0 uses it
    runner.check(first)
    for line in (notice, port.notice):  # said once everything is checked: an error comes alone
        if line:
            say(line)
    options = SuperviseOptions(grace_period=grace_period, log_dir=log_dir, max_restarts=max_restarts)
    return run_job(lambda a: first if a == 0 else make_plan(hosts, job, a), runner, options, say)


def _check_log_dir(log_dir: str) -> None:
    """--log_dir is created (or found writable) before any worker starts: a file in the way or a folder
    that cannot be made fails the launch in one line, not the head after the job started."""
    try:
        os.makedirs(log_dir, exist_ok=True)
    except FileExistsError:
        raise LaunchError(f"--log_dir {log_dir}: is a file, not a folder") from None
    except OSError as exc:
        raise LaunchError(f"--log_dir {log_dir}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise LaunchError(f"--log_dir {log_dir}: cannot write in it (permission denied)")


def main(argv: Sequence[str] | None = None) -> None:
    args = list(argv) if argv is not None else sys.argv[1:]
    if not args:
        cli.main(args=["--help"], prog_name="dslaunch", standalone_mode=False)
        sys.exit(2)
    try:
        code = cli.main(args=args, prog_name="dslaunch", standalone_mode=False)
    except click.ClickException as exc:
        say(f"error: {exc.format_message()}")
        code = exc.exit_code
    except click.exceptions.Abort:
        code = 130
    except LaunchError as exc:
        say(f"error: {exc}")
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
