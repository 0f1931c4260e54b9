"""The SSH runner: one node agent per host over one paramiko channel, the channel being its lifeline.

Per host, one SSH connection (opened and checked in parallel by ``launcher.ssh.preflight`` before anything
starts, reused for every restart attempt) and, per attempt, one session channel running

    cd -- <cwd> && exec <python> -m launcher.agent

without a pty (a pty would merge streams, rewrite newlines and SIGHUP the agent's workers on its own
terms). The node spec, environment included, is the first line written to the channel's stdin: JSON
carries any value intact and needs neither sshd's ``AcceptEnv`` nor shell quoting. The channel's stdin
stays open for the life of the job: when the head exits, is SIGKILLed or loses the network path, sshd
closes the agent's stdin and the agent stops its workers (and only its workers: every stop is scoped to
the process groups the agent started, never a ``pkill`` pattern).

Hosts that are this machine (``localhost``, its own name) run their agent as a local subprocess, like the
local runner, so a hostfile may mix the head with remote hosts without an sshd on the head.

Options (``RunnerOptions.extra``): ``ssh_config``, ``ssh_port``, ``accept_new_host_keys``,
``remote_python`` (interpreter on the remote hosts; default the head's, which must then exist at the same
path everywhere), ``forward_env`` (default true; see ``launcher.envfwd``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import paramiko

from launcher import envfwd, ssh
from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import AgentHandle, Runner, RunnerOptions
from launcher.runners.local import LocalRunner

AGENT_MODULE = "launcher.agent"
_LOST = 255  # what OpenSSH's client returns when the connection died; no exit status came back


def is_local_host(host: str) -> bool:
    """Whether a hostfile name means this machine (then no SSH is needed)."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names


def _primary_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # UDP connect: picks a route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def settings_from_options(options: RunnerOptions) -> ssh.SSHSettings:
    extra = options.extra
    cfg = extra.get("ssh_config")
    port = extra.get("ssh_port")
    return ssh.SSHSettings(
        config_path=Path(cfg) if cfg else None,
        port=int(port) if port else None,
        accept_new_host_keys=bool(extra.get("accept_new_host_keys", False)),
    )


def remote_command(cwd: str, python: str) -> str:
    """The shell command that becomes the agent on a host (run by the user's login shell there)."""
    return f"cd -- {shlex.quote(cwd)} && exec {shlex.quote(python)} -m {AGENT_MODULE}"


def remote_spec(
    spec: Mapping[str, Any], forwarded: Mapping[str, str], python: str, head_python: str
) -> dict[str, Any]:
    """A node spec for a remote host: forwarded variables under the plan's, and the remote interpreter
    in place of the head's where a worker runs the head's."""
    workers = [
        {**w, "argv": [python if a == head_python and i == 0 else a for i, a in enumerate(w["argv"])]}
        for w in spec["workers"]
    ]
    return {**spec, "env": {**forwarded, **spec["env"]}, "workers": workers}


def forwarded_env(options: RunnerOptions, plan: JobPlan) -> envfwd.ForwardedEnv:
    """What remote workers get from this environment and the env files; says so on stderr, by name."""
    if not options.extra.get("forward_env", True) or all(is_local_host(n.host) for n in plan.nodes):
        return envfwd.ForwardedEnv({}, {})
    fwd = envfwd.collect_from_process(Path(plan.cwd) if plan.cwd else None)
    if fwd.values:
        sys.stderr.write(f"dslaunch: remote workers also get {fwd.describe()}\n")
    return fwd


class SSHAgentHandle(AgentHandle):
    """One remote agent on one session channel."""

    def __init__(self, conn: ssh.Connection, chan: paramiko.Channel, node_rank: int, name: str) -> None:
        self.conn = conn
        self.chan = chan  # holding it keeps the remote agent's stdin (its lifeline) open
        self.node_ranks = (node_rank,)
        self.name = name
        self._out = chan.makefile("rb")
        self._lock = threading.Lock()

    def readline(self) -> bytes:
        try:
            return self._out.readline()
        except (OSError, EOFError, paramiko.SSHException):
            return b""

    def _command(self, line: bytes) -> None:
        with self._lock, contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            if not self.chan.closed:
                self.chan.sendall(line)

    def stop(self) -> None:
        self._command(b"stop\n")

    def kill(self) -> None:
        self._command(b"kill\n")

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.chan.status_event.wait(timeout):
            return None
        rc = self.chan.exit_status
        return _LOST if rc < 0 else rc

    def close(self) -> None:
        # Closing the channel closes the agent's stdin: an agent still running stops its workers.
        with self._lock, contextlib.suppress(Exception):
            self.chan.close()


class SSHRunner(Runner):
    name: ClassVar[str] = "ssh"
    lifeline: ClassVar[tuple[str, ...]] = ("stdin", "parent")

    def __init__(self, options: RunnerOptions) -> None:
        super().__init__(options)
        self.settings = settings_from_options(options)
        self.remote_python = str(options.extra.get("remote_python") or options.python)
        self.conns: dict[str, ssh.Connection] = {}
        self.forwarded: envfwd.ForwardedEnv | None = None

    # -- before anything starts -----------------------------------------------------------------
    def connect(self, hosts: Sequence[str], cwd: str | None = None) -> dict[str, ssh.Connection]:
        """Preflight every remote host (parallel, all-or-nothing) and keep the connections."""
        remote = [h for h in hosts if not is_local_host(h) and h not in self.conns]
        if remote:
            check = ssh.RemoteCheck(cwd or os.getcwd(), self.remote_python, AGENT_MODULE)
            try:
                self.conns.update(ssh.preflight(remote, self.settings, check))
            except ssh.PreflightError as e:
                raise LaunchError(str(e)) from None
        return self.conns

    def master_addr(self, first_host: str) -> str:
        """An address of the first host that every other host can reach.

        A remote first host: the address our connection reached it on, as the host itself reports it
        (SSH_CONNECTION), i.e. a routable address even behind a jump host; the connection made for it is
        the one the job then uses. This machine as first host: the address of the interface that its
        default route leaves by (no packet is sent), else its name.
        """
        if not is_local_host(first_host):
            return ssh.master_address(self.connect([first_host])[first_host])
        return _primary_address()

    def check(self, plan: JobPlan) -> None:
        self.forwarded = forwarded_env(self.options, plan)
        self.connect([n.host for n in plan.nodes], plan.cwd)

    # -- start --------------------------------------------------------------------------------------
    def _reconnect_if_lost(self, host: str, cwd: str) -> ssh.Connection:
        conn = self.conns[host]
        transport = conn.client.get_transport()
        if transport is None or not transport.is_active():  # lost between restart attempts
            conn.close()
            del self.conns[host]
            self.connect([host], cwd)
            conn = self.conns[host]
        return conn

    def _start_remote(self, spec: dict[str, Any], cwd: str) -> SSHAgentHandle:
        host = spec["host"]
        conn = self._reconnect_if_lost(host, cwd)
        fwd = self.forwarded.values if self.forwarded else {}
        payload = json.dumps(remote_spec(spec, fwd, self.remote_python, self.options.python))
        try:
            transport = conn.client.get_transport()
            assert transport is not None
            chan = transport.open_session(timeout=30)
            chan.set_combine_stderr(True)  # an agent traceback or a shell error reaches the user
            chan.exec_command(remote_command(cwd, self.remote_python))
            chan.sendall(payload.encode() + b"\n")
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise LaunchError(f"{conn.target}: could not start the agent: {e}") from None
        return SSHAgentHandle(conn, chan, spec["node_rank"], host)

    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        if self.forwarded is None:
            self.check(plan)
        cwd = plan.cwd or os.getcwd()
        local = [s for s in specs if is_local_host(s["host"])]
        remote = [s for s in specs if not is_local_host(s["host"])]
        handles: list[AgentHandle] = []
        errors: list[str] = []
        with ThreadPoolExecutor(max_workers=max(1, min(self.settings.max_parallel, len(remote)))) as pool:
            futures = [pool.submit(self._start_remote, s, cwd) for s in remote]
            for f in futures:
                try:
                    handles.append(f.result())
                except LaunchError as e:
                    errors.append(str(e))
        if not errors and local:
            handles += LocalRunner(self.options).launch(plan, local)
        if errors:
            for h in handles:
                h.close()
            raise LaunchError("\n".join(errors))
        return sorted(handles, key=lambda h: h.node_ranks[0])

    def close(self) -> None:
        """Close every connection (the supervisor's end of job)."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
