"""The SSH runner: one node agent per host over one paramiko channel, the channel being its lifeline.

Per host, one SSH connection, reused for every restart attempt, and per attempt one session channel,
without a pty (a pty would merge streams, rewrite newlines and SIGHUP the agent's workers on its own
terms). The session runs ``launcher.preflight.probe_command``: change to the head's working directory
(exit 101 if missing), find the interpreter (102), import ``launcher.agent`` (103), report the host's
facts on one line, then become the agent (``launcher.agent.main``), which waits for its spec. So the
preflight and the agent's start are one step, every host in parallel, and a job starts only once every
host has an agent waiting; if one host fails, the waiting agents are released and nothing has started
anywhere.

The node spec, environment included, is the first line written to the channel's stdin: JSON
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
import ipaddress
import json
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

from launcher import envfwd, preflight, ssh
from launcher.errors import LaunchError
from launcher.plan import JobPlan
from launcher.runners.base import AgentHandle, Runner, RunnerOptions
from launcher.runners.local import LocalRunner
from launcher.sshlib import paramiko

AGENT_MODULE = "launcher.agent"
_LOST = 255  # what OpenSSH's client returns when the connection died; no exit status came back


def is_local_host(host: str) -> bool:
    """Whether a hostfile name means this machine (then no SSH is needed)."""
    names = {"localhost", "127.0.0.1", "::1", "[::1]", socket.gethostname(), socket.getfqdn()}
    return host in names


def _primary_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))  # UDP connect: picks a route, sends nothing
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def _routable_address(hostname: str) -> str | None:
    """``hostname`` as an IP address if it is one, or if it resolves here to a non-loopback address."""
    try:
        return str(ipaddress.ip_address(hostname))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addrs = [str(i[4][0]) for i in infos]
    good = [a for a in addrs if not ipaddress.ip_address(a).is_loopback]
    return good[0] if good else None


def settings_from_options(options: RunnerOptions) -> ssh.SSHSettings:
    extra = options.extra
    cfg = extra.get("ssh_config")
    port = extra.get("ssh_port")
    return ssh.SSHSettings(
        config_path=Path(cfg) if cfg else None,
        port=int(port) if port else None,
        accept_new_host_keys=bool(extra.get("accept_new_host_keys", False)),
    )


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

    def __init__(
        self, conn: preflight.Connection, chan: paramiko.Channel, stream: Any, node_rank: int, name: str
    ) -> None:
        self.conn = conn
        self.chan = chan  # holding it keeps the remote agent's stdin (its lifeline) open
        self.node_ranks = (node_rank,)
        self.name = name
        self._out = stream
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
        self.conns: dict[str, preflight.Connection] = {}
        self.forwarded: envfwd.ForwardedEnv | None = None
        self._ssh_config: paramiko.SSHConfig | None = None  # parsed once, for every host

    def ssh_config(self) -> paramiko.SSHConfig:
        """The user's ssh_config, read on first use. Raises SSHHostError."""
        if self._ssh_config is None:
            self._ssh_config = ssh.load_ssh_config(self.settings)
        return self._ssh_config

    def resolve(self, host: str) -> ssh.HostTarget:
        """A host's connection parameters. Raises SSHHostError."""
        return ssh.resolve(host, self.settings, self.ssh_config())

    # -- before anything starts -----------------------------------------------------------------
    def _agent_check(self, cwd: str | None) -> preflight.RemoteCheck:
        return preflight.RemoteCheck(cwd or os.getcwd(), self.remote_python, AGENT_MODULE, call="main")

    def connect(self, hosts: Sequence[str], cwd: str | None = None) -> dict[str, preflight.Connection]:
        """Preflight remote hosts not connected yet (parallel, all-or-nothing) and keep the connections."""
        todo = [h for h in hosts if not is_local_host(h) and h not in self.conns]
        if todo:
            check = preflight.RemoteCheck(cwd or os.getcwd(), self.remote_python, AGENT_MODULE)
            try:
                self.conns.update(preflight.preflight(todo, self.settings, check))
            except preflight.PreflightError as e:
                raise LaunchError(str(e)) from None
        return self.conns

    def prepare(self, hosts: Sequence[str], cwd: str | None) -> None:
        """Give every remote host a checked session whose agent waits for its spec on stdin.

        Connecting, checking the host and starting the agent are one step per host, all hosts in
        parallel (bounded per first hop, as stock sshd drops bursts: ``preflight.HopLimit``).
        All-or-nothing: if a host fails, every waiting agent is released (its stdin closes before a spec
        arrived: it exits without starting anything).
        """
        check = self._agent_check(cwd)
        todo = [h for h in hosts if not is_local_host(h) and not (h in self.conns and self.conns[h].session)]
        errors: dict[str, ssh.SSHHostError] = {}
        limit = preflight.HopLimit(self.settings.max_parallel)
        if todo:
            try:
                self.ssh_config()  # once, before the threads
            except ssh.SSHHostError as e:
                raise LaunchError(str(preflight.PreflightError([e]))) from None

        def one(host: str) -> None:
            try:
                conn = self.conns.get(host)
                transport = conn.client.get_transport() if conn else None
                if conn is not None and transport is not None and transport.is_active():
                    preflight.start_checked(conn, check)
                    return
                if conn is not None:  # lost between restart attempts: connect again
                    conn.close()
                target = self.resolve(host)
                with limit.slot(target):
                    self.conns[host] = preflight.check_host(target, self.settings, check)
            except ssh.SSHHostError as e:
                errors[host] = e
            except Exception as e:  # never lose a host's failure to a thread
                errors[host] = ssh.SSHHostError(host, ssh.Cause.DISCONNECTED, f"{type(e).__name__}: {e}")

        if todo:
            with ThreadPoolExecutor(max_workers=preflight.pool_size(len(todo))) as pool:
                list(pool.map(one, todo))
        if errors:
            self.release()
            raise LaunchError(str(preflight.PreflightError([errors[h] for h in todo if h in errors])))

    def release(self) -> None:
        """Close the sessions of agents still waiting for a spec."""
        for conn in self.conns.values():
            if conn.session is not None:
                conn.session[0].close()
                conn.session = None

    def master_addr(self, first_host: str) -> str:
        """An address of the first host that every other host can reach.

        A remote first host: its ssh_config HostName if that is an IP address or resolves here to a
        non-loopback one (no connection needed); otherwise (a proxy or jump host in between, a name only
        the cluster resolves) the address our SSH connection reached it on, as the host itself reports it
        (SSH_CONNECTION). This machine as first host: the address of the interface that its default
        route leaves by (no packet is sent), else its name.
        """
        if is_local_host(first_host):
            return _primary_address()
        try:
            target = self.resolve(first_host)
        except ssh.SSHHostError as e:
            raise LaunchError(str(e)) from None
        if not (target.proxy_jump or target.proxy_command):
            addr = _routable_address(target.hostname)
            if addr:
                return addr
        return preflight.master_address(self.connect([first_host])[first_host])

    def check(self, plan: JobPlan) -> None:
        self.forwarded = forwarded_env(self.options, plan)
        self.prepare([n.host for n in plan.nodes], plan.cwd)

    # -- start --------------------------------------------------------------------------------------
    def launch(self, plan: JobPlan, specs: Sequence[dict[str, Any]]) -> list[AgentHandle]:
        if self.forwarded is None:
            self.forwarded = forwarded_env(self.options, plan)
        cwd = plan.cwd or os.getcwd()
        local = [s for s in specs if is_local_host(s["host"])]
        remote = [s for s in specs if not is_local_host(s["host"])]
        self.prepare([s["host"] for s in remote], cwd)  # restarts: new agents on the same connections
        handles: list[AgentHandle] = []
        errors: list[str] = []
        for spec in remote:  # each agent is up and waiting: sending its spec is all that is left
            conn = self.conns[spec["host"]]
            assert conn.session is not None
            chan, stream = conn.session
            conn.session = None
            payload = remote_spec(spec, self.forwarded.values, self.remote_python, self.options.python)
            try:
                chan.sendall(json.dumps(payload, separators=(",", ":")).encode() + b"\n")
            except (paramiko.SSHException, OSError, EOFError) as e:
                errors.append(f"{conn.target}: could not start the agent: {e}")
                chan.close()
                continue
            handles.append(SSHAgentHandle(conn, chan, stream, spec["node_rank"], spec["host"]))
        if not errors and local:
            handles += LocalRunner(self.options).launch(plan, local)
        if errors:
            for h in handles:
                h.close()
            raise LaunchError("\n".join(errors))
        return sorted(handles, key=lambda h: h.node_ranks[0])

    def close(self) -> None:
        """Close every connection (the supervisor calls this once, after the last attempt)."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
