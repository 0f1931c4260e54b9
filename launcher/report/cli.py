"""``ds_report``: is this environment (and every host of a hostfile) ready to run a dslaunch job?

Exit status: 0 when no check failed (warnings allowed), 1 when any check failed, 2 for bad usage.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import click

from launcher import __version__
from launcher.report.checks import local_checks
from launcher.report.remote import (
    HostAnswer,
    HostSpec,
    HostUnreachable,
    LocalFacts,
    RunOnHost,
    ask_hosts,
    judge_host,
)
from launcher.report.render import render_json, render_table, use_colour
from launcher.report.runner import DEFAULT_TIMEOUT_S, Report, one_line_reason, run_checks


def ssh_runner(ssh_config: Path | None = None, ssh_port: int | None = None) -> RunOnHost:
    """Run commands on hosts with the launcher's own SSH code (same ssh_config, known_hosts, causes)."""
    try:
        from launcher import ssh
    except ImportError as error:  # paramiko missing or broken: every host says why
        reason = f"cannot use SSH from here: {one_line_reason(error)}"

        def unavailable(host: str, command: str, timeout: float) -> tuple[int, str, str]:
            raise HostUnreachable(reason)

        return unavailable

    settings = ssh.SSHSettings(config_path=ssh_config, port=ssh_port)
    try:
        config = ssh.load_ssh_config(settings)
    except ssh.SSHHostError as error:
        raise click.BadParameter(error.detail, param_hint="--ssh_config") from None

    def run_on_host(host: str, command: str, timeout: float) -> tuple[int, str, str]:
        try:
            return ssh.run(ssh.resolve(host, settings, config), command, settings, timeout=timeout)
        except ssh.SSHHostError as error:
            hint = f" (fix: {error.hint})" if error.hint else ""
            message = f"{error.cause.value}: {error.detail}{hint}"
            raise HostUnreachable(message, error.cause.value, error.hint) from error

    return run_on_host


def read_hosts(hostfile: str) -> list[HostSpec]:
    from launcher.errors import HostfileError
    from launcher.hostfile import read_hostfile

    try:
        # entry.host keeps a user@ and :port from the hostfile, which the connection needs
        return [HostSpec(entry.host, entry.slots) for entry in read_hostfile(hostfile).entries]
    except HostfileError as error:
        raise click.BadParameter(str(error), param_hint="--hostfile") from None


def build_report(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    hosts: list[HostSpec] | None = None,
    run_on_host: RunOnHost | None = None,
    remote_python: str | None = None,
) -> Report:
    """Run every local check and, with ``hosts``, ask every host at the same time, then compare."""
    begin = time.perf_counter()
    python = remote_python or sys.executable
    answers: list[HostAnswer] = []
    asking = None
    if hosts:
        if run_on_host is None:
            raise ValueError("hosts given without a way to run commands on them")
        asking = threading.Thread(
            target=lambda: answers.extend(ask_hosts(hosts, run_on_host, python)),
            name="ds_report-hosts",
            daemon=True,
        )
        asking.start()
    with warnings.catch_warnings():
        # Library warnings would interleave with the table; checks that care record their own.
        warnings.simplefilter("ignore")
        results = run_checks(local_checks(), timeout_s)
    if asking is not None:
        asking.join()
        local = LocalFacts.here(python)
        results += [r for answer in answers for r in judge_host(answer, local)]
    return Report(tuple(results), socket.gethostname(), __version__, time.perf_counter() - begin)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON (every check of every host) instead of a table."
)
@click.option(
    "--hostfile",
    type=click.Path(dir_okay=False),
    help="Also check every host of this hostfile over SSH: reachable, same python path, same torch and "
    "dslaunch versions, enough GPUs for its slots, clock.",
)
@click.option(
    "--remote_python",
    metavar="PATH",
    help="Interpreter to run on the hosts. Default: this one's absolute path, as the launcher does.",
)
@click.option(
    "--ssh_config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="ssh_config file for the hosts. Default: ~/.ssh/config when it exists.",
)
@click.option(
    "--ssh_port", type=click.IntRange(1, 65535), help="SSH port for every host (overrides ssh_config)."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds a local check may take before it is reported as FAIL (importing torch and "
    "initialising CUDA get more).",
)
def main(
    as_json: bool,
    hostfile: str | None,
    remote_python: str | None,
    ssh_config: Path | None,
    ssh_port: int | None,
    timeout_s: float,
) -> None:
    """Check that this machine (and a hostfile's hosts) can run dslaunch jobs.

    Versions, GPUs, backends, memory, /dev/shm, and features tried for real (fused CPU AdamW, fp16/bf16,
    a gloo all_reduce). Paste the table into bug reports.

    \b
    Exit status: 0 nothing FAILed (warnings allowed), 1 a check FAILed, 2 bad usage.
    """
    hosts = read_hosts(hostfile) if hostfile is not None else None
    run_on_host = ssh_runner(ssh_config, ssh_port) if hosts else None
    report = build_report(timeout_s, hosts, run_on_host, remote_python)
    text = render_json(report) if as_json else render_table(report, colour=use_colour(sys.stdout))
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `ds_report | head`: the reader left; the exit status still tells
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0 if report.ready else 1)
