"""Preflight: every host checked before anything starts, and the checked connections kept for the job.

:func:`preflight` connects to all hosts in parallel with bounded concurrency and runs a probe on each:
change to the
job's working directory, find the interpreter, import the launcher, report the host's name and the
address our connection reached it on. All-or-nothing: one failing host fails the preflight, with every
failing host's own cause (:class:`launcher.ssh.SSHHostError`) in :class:`PreflightError`.

Concurrency: stock sshd drops bursts of more than 10 unauthenticated connections (MaxStartups 10:30:100),
but each sshd counts only its own. So at most ``SSHSettings.max_parallel`` connections are in flight to one
*first hop* (the host's own sshd, or the jump host or proxy every connection passes; :class:`HopLimit`),
and up to ``MAX_CONNECTING`` hosts connect at once: 1000 hosts that time out take a few timeouts, not
1000 / 8 of them.

With ``RemoteCheck.call`` the probe then *becomes* the named function (the node agent), so that checking
a host and starting its agent cost one session and one interpreter start (:func:`start_checked`).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from launcher.ssh import Cause, HostTarget, SSHHostError, SSHSettings, connect, load_ssh_config, resolve
from launcher.sshlib import paramiko

MAX_CONNECTING = 64  # hosts connecting at once (threads); each first hop still sees at most max_parallel


def first_hop(target: HostTarget) -> str:
    """The sshd that a connection to ``target`` reaches first: its jump host, its proxy, or its own."""
    if target.proxy_jump:
        return "jump " + target.proxy_jump.split(",")[0]
    if target.proxy_command:
        return "proxy"  # every ProxyCommand likely passes one bastion: count them together
    return f"{target.hostname}:{target.port}"


class HopLimit:
    """At most ``per_hop`` connections in flight to one first hop (sshd's MaxStartups is per server)."""

    def __init__(self, per_hop: int) -> None:
        self.per_hop = max(1, per_hop)
        self._sems: dict[str, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def slot(self, target: HostTarget) -> Iterator[None]:
        hop = first_hop(target)
        with self._lock:
            sem = self._sems.setdefault(hop, threading.BoundedSemaphore(self.per_hop))
        with sem:
            yield


def pool_size(hosts: int) -> int:
    """Threads for connecting to ``hosts`` hosts."""
    return max(1, min(MAX_CONNECTING, hosts))


@dataclass(frozen=True)
class RemoteCheck:
    """What must exist on each host for the job: the working directory, interpreter and a module.

    ``call``: a function of ``module`` that the checked process then becomes (``module.call([])``, its
    return value the exit code), so that the check and the real work share one session and one
    interpreter start; the SSH runner uses it to start the node agent right away.
    """

    cwd: str
    python: str
    module: str = "launcher.agent"
    call: str | None = None


@dataclass
class Connection:
    """An open, checked connection to one host (reused by the runner that starts the agent)."""

    target: HostTarget
    client: paramiko.SSHClient
    hostname: str = ""  # the host's own name (``hostname`` there)
    address: str = ""  # the host's address on the connection we made (SSH_CONNECTION), for MASTER_ADDR
    python_version: str = ""
    # With RemoteCheck.call: the session now running ``module.call`` and its output after the probe line.
    session: tuple[paramiko.Channel, paramiko.ChannelFile] | None = None

    def close(self) -> None:
        if self.session is not None:
            self.session[0].close()
            self.session = None
        self.client.close()
        jump = getattr(self.client, "_dslaunch_jump", None)
        if jump is not None:
            jump.close()


PROBE_MARK = b"@dslaunch-probe "

# Run with -S: the agent needs only the standard library, and site's work (every .pth file, e.g. the
# finder of an editable install) costs a remote interpreter more than the agent's own imports. When the
# module is not on the bare path (the working directory, PYTHONPATH), site.main() adds what -S left out
# and the import is tried again, so it resolves exactly as without -S.
_PROBE = r"""
import json, os, sys
def load():
    return __import__(sys.argv[1], fromlist=["_"])
try:
    try:
        mod = load()
    except ImportError:
        import site
        site.main()
        mod = load()
except Exception as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(103)
conn = os.environ.get("SSH_CONNECTION", "").split()
info = {"hostname": os.uname().nodename, "address": conn[2] if len(conn) == 4 else "",
        "python": sys.version.split()[0]}
print("@dslaunch-probe " + json.dumps(info), flush=True)
if len(sys.argv) > 2:
    os._exit(getattr(mod, sys.argv[2])([]))
"""


def probe_command(check: RemoteCheck) -> str:
    """Shell command that checks a host for the job; exit 101 no cwd, 102 no python, 103 no module."""
    cwd, py = shlex.quote(check.cwd), shlex.quote(check.python)
    call = f" {shlex.quote(check.call)}" if check.call else ""
    return (
        f"cd -- {cwd} 2>/dev/null || exit 101; "
        f"command -v -- {py} >/dev/null 2>&1 || exit 102; "
        f"exec {py} -S -c {shlex.quote(_PROBE)} {shlex.quote(check.module)}{call}"
    )


def _probe_failure(host: str, check: RemoteCheck, rc: int, err: str) -> SSHHostError:
    err = err.strip()[-300:]
    cause, detail, hint = {
        101: (Cause.NO_PROJECT, f"working directory {check.cwd} does not exist there",
              "use the same path on every host (shared filesystem or identical checkout)"),
        102: (Cause.NO_PYTHON, f"no interpreter {check.python} there",
              "install the same environment at the same path, or pass --remote_python"),
        103: (Cause.NO_PROJECT, f"{check.python} cannot import {check.module}: {err}",
              "install dslaunch into that interpreter on every host (pip install -e <checkout>)"),
    }.get(rc, (Cause.COMMAND, f"probe exited {rc}: {err}", ""))  # fmt: skip
    return SSHHostError(host, cause, detail, hint)


def start_checked(conn: Connection, check: RemoteCheck, timeout: float = 60.0) -> None:
    """Run the probe on an open connection; fill in the host's facts. With ``check.call`` the session
    stays open in ``conn.session``, now running the called function; otherwise it is closed.
    Raises :class:`SSHHostError` (the connection stays open)."""
    host = str(conn.target)
    chan: paramiko.Channel | None = None
    try:
        transport = conn.client.get_transport()
        if transport is None or not transport.is_active():
            raise SSHHostError(host, Cause.DISCONNECTED, "connection closed")
        chan = transport.open_session(timeout=timeout)
        chan.set_combine_stderr(True)  # a traceback or shell error is part of the story
        chan.settimeout(timeout)
        chan.exec_command(probe_command(check))
        stream = chan.makefile("rb")
        before: list[bytes] = []
        while True:
            line = stream.readline()
            if line.startswith(PROBE_MARK):
                break
            if not line:  # the probe ended without its line: a failure, told by the exit code
                rc = chan.recv_exit_status()
                chan.close()
                raise _probe_failure(host, check, rc, b"".join(before).decode(errors="replace"))
            before.append(line)
    except TimeoutError:
        if chan is not None:
            chan.close()
        raise SSHHostError(
            host,
            Cause.COMMAND,
            f"the probe did not answer within {timeout:g}s",
            "check that `ssh <host> true` returns at once: a shell startup file that waits (~/.bashrc "
            "running a tool that blocks, such as pyenv rehash behind a stale lock) or an overloaded host "
            "holds every remote command",
        ) from None
    except (paramiko.SSHException, OSError, EOFError) as e:
        raise SSHHostError(host, Cause.DISCONNECTED, f"{type(e).__name__}: {e}") from e
    chan.settimeout(None)
    try:
        info = json.loads(line[len(PROBE_MARK) :])
    except ValueError:
        chan.close()
        raise SSHHostError(host, Cause.COMMAND, f"unexpected probe output {line[:200]!r}") from None
    conn.hostname, conn.address, conn.python_version = info["hostname"], info["address"], info["python"]
    if check.call:
        conn.session = (chan, stream)
    else:
        chan.close()


def check_host(conn_target: HostTarget, settings: SSHSettings, check: RemoteCheck | None) -> Connection:
    """Connect to one host and, with ``check``, verify the job can run there. Raises SSHHostError."""
    conn = Connection(conn_target, connect(conn_target, settings))
    if check is not None:
        try:
            start_checked(conn, check)
        except SSHHostError:
            conn.close()
            raise
    return conn


class PreflightError(Exception):
    """One or more hosts failed the preflight; nothing was started. ``errors`` holds one per host.

    The message folds hosts that failed for the same cause (1000 hosts down are one line and one fix,
    not 2000 lines): see :func:`folded_lines`."""

    def __init__(self, errors: list[SSHHostError]) -> None:
        self.errors = errors
        lines = [f"{len(errors)} host(s) failed the SSH preflight; nothing was started:"]
        lines += folded_lines(errors)
        super().__init__("\n".join(lines))


NAMED_HOSTS = 3  # hosts named in a folded line; the rest are counted


def folded_lines(errors: list[SSHHostError]) -> list[str]:
    """Per-host errors -> the lines that show them, one group per cause in order of first appearance.

    A cause with one host keeps that host's own line and fix. A cause with several hosts is one line,
    ``hosts a, b, c ... and 997 more: connection refused``, with the first host's detail as an example
    unless every host has the same detail, then one fix line (the first host's, said so when the fixes
    differ by host, e.g. a known_hosts command naming the host)."""
    groups: dict[Cause, list[SSHHostError]] = {}
    for e in errors:
        groups.setdefault(e.cause, []).append(e)
    lines: list[str] = []
    for cause, group in groups.items():
        first = group[0]
        if len(group) == 1:
            lines.append(f"  {first}")
            continue
        names = ", ".join(e.host.split()[0] for e in group[:NAMED_HOSTS])  # the name, not "(user@addr)"
        more = f" ... and {len(group) - NAMED_HOSTS} more" if len(group) > NAMED_HOSTS else ""
        same_detail = all(e.detail == first.detail for e in group)
        detail = first.detail if same_detail else f"e.g. {first.detail}"
        lines.append(f"  hosts {names}{more}: {cause.value} ({detail})")
        if first.hint:
            same_hint = all(e.hint == first.hint for e in group)
            for_whom = "" if same_hint else f" (for {first.host.split()[0]}; likewise for the others)"
            lines.append(f"    fix{for_whom}: {first.hint}")
    return lines


def preflight(
    hosts: list[str], settings: SSHSettings, check: RemoteCheck | None = None
) -> dict[str, Connection]:
    """Connect to and check every host in parallel; return open connections by host name.

    All-or-nothing: if any host fails, every connection is closed and :class:`PreflightError` lists each
    failing host with its cause (hosts in hostfile order).
    """
    try:
        config = load_ssh_config(settings)
        targets = {h: resolve(h, settings, config) for h in hosts}
    except SSHHostError as e:
        raise PreflightError([e]) from e
    results: dict[str, Connection | SSHHostError] = {}
    limit = HopLimit(settings.max_parallel)

    def one(h: str) -> None:
        try:
            with limit.slot(targets[h]):
                results[h] = check_host(targets[h], settings, check)
        except SSHHostError as e:
            results[h] = e
        except Exception as e:  # never lose a host's failure to a thread
            results[h] = SSHHostError(str(targets[h]), Cause.DISCONNECTED, f"{type(e).__name__}: {e}")

    with ThreadPoolExecutor(max_workers=pool_size(len(hosts))) as pool:
        list(pool.map(one, hosts))
    errors = [r for h in hosts if isinstance(r := results[h], SSHHostError)]
    conns = {h: r for h in hosts if isinstance(r := results[h], Connection)}
    if errors:
        for c in conns.values():
            c.close()
        raise PreflightError(errors)
    return conns


def master_address(conn: Connection) -> str:
    """An address of this host that the other hosts can reach: the one our SSH connection landed on
    (what the host itself reports in SSH_CONNECTION), else its HostName resolved here."""
    if conn.address:
        return conn.address
    try:
        # an IPv4 or IPv6 sockaddr: its first item is the address text
        return str(socket.getaddrinfo(conn.target.hostname, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError:
        return conn.target.hostname
