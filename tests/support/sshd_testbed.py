"""A testbed of real sshd servers on loopback addresses, one per fake host.

Host i (1-based, named ``worker{i}``) is an OpenSSH server listening on ``127.0.0.{i+1}`` on a free port,
with its own ed25519 host key. The testbed writes, under its directory:

    client_key, client_key.pub   the key the tests log in with (authorized on every host)
    authorized_keys, known_hosts the server side and client side of that trust
    ssh_config                   ``Host workerN`` blocks (HostName, Port, User, IdentityFile, known_hosts)
    hostfile                     ``workerN slots=S`` lines for dslaunch
    hosts                        an /etc/hosts where worker1..N resolve to their addresses
    workerN/                     sshd_config, host key, sshd.log, pid of the host's root process

Isolation: where the machine allows it (root with CAP_SYS_ADMIN), each sshd runs as PID 1 of its own PID, UTS
and mount namespace (``unshare``), with hostname ``workerN`` and the testbed's hosts file bind-mounted over
/etc/hosts. A host's processes can then be listed exactly, its hostname differs from the head's, and stopping
the host kills everything started on it, even double-forked orphans. Elsewhere it falls back to "plain" mode
(sshd in the root namespaces) and says so in ``Testbed.notice``.

Use it from pytest through the fixtures in conftest.py, or from the shell (benchmarks, manual poking):

    python tests/support/sshd_testbed.py start DIR [--hosts N] [--slots S] [--isolate ns|plain]
    python tests/support/sshd_testbed.py status DIR
    python tests/support/sshd_testbed.py stop DIR

Facts this module relies on were verified on these machines: /work/shared/research/ssh_testbed.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
STATE_FILE = "testbed.json"


class TestbedUnavailable(RuntimeError):
    """This machine cannot run the testbed (not root, no sshd); the message says why."""

    __test__ = False


def unavailable_reason() -> str | None:
    """Why the testbed cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the sshd testbed needs root (sshd must read its host keys and log users in)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found: run scripts/install_system_deps.sh (installs openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found: install openssh-client"
    return None


@dataclass(frozen=True)
class Host:
    """One fake host: its ssh_config alias, the address and port its sshd listens on, and its files."""

    name: str
    address: str
    port: int
    dir: Path

    @property
    def host_key_pub(self) -> Path:
        return self.dir / "host_key.pub"

    @property
    def sshd_config(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def log(self) -> Path:
        return self.dir / "sshd.log"


@dataclass(frozen=True)
class Proc:
    """A process seen from the head: host-side pid and its command line (argv joined by spaces)."""

    pid: int
    cmdline: str


@dataclass
class Testbed:
    """A running set of fake hosts. Built by :func:`start`; :meth:`stop` ends every process it started."""

    __test__ = False  # not a pytest test class, despite the name

    dir: Path
    hosts: list[Host]
    slots: int
    isolated: bool
    user: str = "root"
    notice: str = ""
    _popen: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    # --- files -------------------------------------------------------------------------------------------
    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def client_key(self) -> Path:
        return self.dir / "client_key"

    @property
    def hostfile(self) -> Path:
        return self.dir / "hostfile"

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in testbed {self.dir} (hosts: {', '.join(self.names)})")

    def env(self) -> dict[str, str]:
        """DSL_* variables naming the testbed's files (what ``env.sh`` exports)."""
        return {
            "DSL_SSH_CONFIG": str(self.ssh_config),
            "DSL_SSH_KEY": str(self.client_key),
            "DSL_KNOWN_HOSTS": str(self.known_hosts),
            "DSL_HOSTFILE": str(self.hostfile),
        }

    def write_hostfile(self, path: Path, slots: int | None = None, hosts: list[str] | None = None) -> Path:
        """Write a hostfile for some hosts (default all) with ``slots`` each (default the testbed's)."""
        s = self.slots if slots is None else slots
        path.write_text("".join(f"{n} slots={s}\n" for n in (hosts or self.names)))
        return path

    def write_ssh_config(
        self, path: Path, *, known_hosts: Path | None = None, identity: Path | None = None
    ) -> Path:
        """Write an ssh_config for the same hosts, optionally with another known_hosts or client key.

        Tests use it to present an unknown host key (empty known_hosts) or a key the hosts do not accept.
        """
        path.write_text(
            _ssh_config_text(
                self.hosts, self.user, identity or self.client_key, known_hosts or self.known_hosts
            )
        )
        return path

    # --- running commands on hosts ---------------------------------------------------------------------
    def ssh_argv(self, name: str, command: str) -> list[str]:
        """argv for OpenSSH's client running ``command`` on host ``name`` with the testbed's config."""
        return ["ssh", "-F", str(self.ssh_config), name, command]

    def run(self, name: str, command: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
        """Run a shell command on a host over ssh and return the completed process (text mode)."""
        return subprocess.run(
            self.ssh_argv(name, command),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def spawn_detached(self, name: str, argv: list[str]) -> int:
        """Start a long-lived process on a host that outlives the ssh session; returns its host-side pid.

        The process is put in its own session (setsid) so that nothing ssh does touches it, like a job a
        colleague started earlier. Tests use it to prove that stopping a dslaunch job leaves others alone.
        """
        marker = f"dsl-detached-{os.getpid()}-{time.monotonic_ns()}"
        quoted = " ".join(_shquote(a) for a in argv)
        r = self.run(
            name,
            f"DSL_DETACHED={marker} setsid nohup {quoted} </dev/null >/dev/null 2>&1 & echo started",
        )
        if r.returncode != 0:
            raise RuntimeError(f"spawn on {name} failed (rc {r.returncode}): {r.stderr.strip()}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for p in _all_procs():
                if _environ_has(p.pid, f"DSL_DETACHED={marker}"):
                    return p.pid
            time.sleep(0.05)
        raise RuntimeError(f"process started on {name} did not appear: {argv}")

    # --- processes -------------------------------------------------------------------------------------
    def processes(self, name: str) -> list[Proc]:
        """Processes running on a host, excluding its sshd listener (host-side pids).

        Namespace mode: every process in the host's PID namespace, exact. Plain mode: the sshd's
        descendants only, so a process that escaped the tree (double fork) is not seen here; use
        :func:`find_processes` with a marker to search the whole machine.
        """
        host = self.host(name)
        root = _read_pid(host.dir / "pid")
        if root is None:
            return []
        if self.isolated:
            ns = _read_text(host.dir / "pidns")
            procs = [p for p in _all_procs() if ns and _pidns(p.pid) == ns]
            init = _ns_init(root)
            return [p for p in procs if p.pid != init]
        return [p for p in _all_procs() if p.pid in _descendants(root)]

    def cpu_seconds(self, name: str) -> float:
        """CPU seconds spent on a host so far by its sshd and every process it reaped.

        The host's sshd is the root of everything that runs there (namespace mode: PID 1, which also
        reaps orphans), so its own time plus its children's (``cutime``/``cstime``, counted when a parent
        waits) is the host's CPU use. Read it once the host is idle (``processes`` empty) for exact sums.
        """
        root = _read_pid(self.host(name).dir / "pid")
        if root is None:
            return 0.0
        sshd = _ns_init(root) if self.isolated else root
        try:
            fields = Path(f"/proc/{sshd}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        # after the ")": state is field 3 of stat(5), so utime..cstime (fields 14-17) sit at 11..14 here
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def hostname_of(self, name: str) -> str:
        """The hostname a process on this host sees (``workerN`` when isolated, the head's otherwise)."""
        return name if self.isolated else socket.gethostname()

    # --- lifecycle -------------------------------------------------------------------------------------
    def stop_host(self, name: str) -> None:
        """Stop one host's sshd and, in namespace mode, every process on that host."""
        host = self.host(name)
        pid = _read_pid(host.dir / "pid")
        if pid is not None and str(host.dir) in _cmdline(pid):
            pidns = _read_text(host.dir / "pidns") if self.isolated else ""
            victims = [pid] if self.isolated else [*sorted(_descendants(pid)), pid]
            for v in victims:
                _kill(v, signal.SIGKILL)
            popen = self._popen.pop(name, None)
            if popen is not None:
                popen.wait(timeout=10)
            _wait_gone(victims, pidns if self.isolated else "")
        (host.dir / "pid").unlink(missing_ok=True)

    def start_host(self, name: str) -> None:
        """(Re)start one host's sshd with its current files and wait until it accepts connections."""
        host = self.host(name)
        if _read_pid(host.dir / "pid") is not None:
            self.stop_host(name)
        self._popen[name] = _launch(host, self.isolated)
        (host.dir / "pid").write_text(f"{self._popen[name].pid}\n")
        _wait_listening(host, self._popen[name])
        if self.isolated:
            (host.dir / "pidns").write_text(_pidns(_ns_init(self._popen[name].pid)) + "\n")

    def regenerate_host_key(self, name: str) -> None:
        """Give a host a new host key and restart it: known_hosts now holds a stale key for it."""
        host = self.host(name)
        for f in (host.dir / "host_key", host.host_key_pub):
            f.unlink(missing_ok=True)
        keygen(host.dir / "host_key", f"{name}-rotated")
        self.start_host(name)

    def stop(self) -> None:
        """Stop every host. Idempotent."""
        for h in self.hosts:
            self.stop_host(h.name)

    def save(self) -> None:
        state = {
            "hosts": [[h.name, h.address, h.port] for h in self.hosts],
            "slots": self.slots,
            "isolated": self.isolated,
            "user": self.user,
        }
        (self.dir / STATE_FILE).write_text(json.dumps(state) + "\n")

    @classmethod
    def load(cls, directory: Path) -> Testbed:
        """Re-open a testbed started earlier (e.g. by the command line) from its directory."""
        state = json.loads((directory / STATE_FILE).read_text())
        hosts = [Host(n, a, int(p), directory / n) for n, a, p in state["hosts"]]
        return cls(directory, hosts, int(state["slots"]), bool(state["isolated"]), state["user"])


# --- start -----------------------------------------------------------------------------------------------


def start(
    directory: Path,
    n_hosts: int = 2,
    slots: int = 2,
    isolate: str = "ns",
    sshd_extra: str = "",
) -> Testbed:
    """Create keys and configs under ``directory`` and start ``n_hosts`` sshd servers.

    ``isolate``: "ns" (PID/UTS/mount namespace per host, falling back to plain with a notice) or "plain".
    ``sshd_extra``: extra sshd_config lines (e.g. "MaxSessions 64"); by default the stock limits apply
    (MaxStartups 10:30:100, MaxSessions 10, no AcceptEnv) so that tests meet what real servers do.
    """
    reason = unavailable_reason()
    if reason:
        raise TestbedUnavailable(reason)
    if not 1 <= n_hosts <= 250:
        raise ValueError(f"n_hosts must be 1..250, got {n_hosts}")
    directory = directory.resolve()
    if " " in str(directory):
        raise ValueError(f"testbed directory must not contain spaces (sshd_config paths): {directory}")
    directory.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)

    notice = ""
    isolated = isolate == "ns"
    if isolated:
        why = _namespaces_unavailable()
        if why:
            isolated = False
            notice = f"sshd testbed: namespaces unavailable ({why}); hosts run in plain mode"

    client_key = directory / "client_key"
    if not client_key.exists():
        keygen(client_key, "dslaunch-testbed-client")
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())

    hosts = []
    for i in range(1, n_hosts + 1):
        address = f"127.0.0.{i + 1}"
        hdir = directory / f"worker{i}"
        hdir.mkdir(exist_ok=True)
        if not (hdir / "host_key").exists():
            keygen(hdir / "host_key", f"worker{i}")
        hosts.append(Host(f"worker{i}", address, _free_port(address), hdir))

    tb = Testbed(directory, hosts, slots, isolated, notice=notice)
    _write_files(tb, sshd_extra)
    tb.save()
    try:
        for h in hosts:
            tb._popen[h.name] = _launch(h, isolated)
            (h.dir / "pid").write_text(f"{tb._popen[h.name].pid}\n")
        for h in hosts:
            _wait_listening(h, tb._popen[h.name])
            if isolated:
                (h.dir / "pidns").write_text(_pidns(_ns_init(tb._popen[h.name].pid)) + "\n")
    except BaseException:
        tb.stop()
        raise
    return tb


def _write_files(tb: Testbed, sshd_extra: str) -> None:
    kh = []
    for h in tb.hosts:
        keytype, keyb64 = h.host_key_pub.read_text().split()[:2]
        kh.append(f"[{h.address}]:{h.port},[{h.name}]:{h.port} {keytype} {keyb64}\n")
        h.sshd_config.write_text(
            "\n".join(
                [
                    f"Port {h.port}",
                    f"ListenAddress {h.address}",
                    f"HostKey {h.dir / 'host_key'}",
                    f"AuthorizedKeysFile {tb.dir / 'authorized_keys'}",
                    f"PidFile {h.dir / 'sshd.pid'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    # The testbed's files live in a world-readable tmp dir; StrictModes would refuse them.
                    "StrictModes no",
                    "UsePAM no",
                    "PrintMotd no",
                    "LogLevel VERBOSE",
                    sshd_extra,
                    "",
                ]
            )
        )
        (h.dir / "init.sh").write_text(
            "#!/bin/sh\n# PID 1 of this host's namespaces: own hostname and /etc/hosts, then sshd.\nset -e\n"
            f"hostname {h.name}\nmount --bind {tb.dir / 'hosts'} /etc/hosts\n"
            f"exec {SSHD} -D -f {h.sshd_config} -E {h.log}\n"
        )
    tb.known_hosts.write_text("".join(kh))
    tb.write_ssh_config(tb.ssh_config)
    tb.write_hostfile(tb.hostfile)
    (tb.dir / "hosts").write_text(
        "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in tb.hosts)
    )
    (tb.dir / "env.sh").write_text("".join(f"export {k}={v}\n" for k, v in tb.env().items()))


def _ssh_config_text(hosts: list[Host], user: str, identity: Path, known_hosts: Path) -> str:
    blocks = [f"Host {h.name}\n    HostName {h.address}\n    Port {h.port}\n" for h in hosts]
    common = (
        "Host *\n"
        f"    User {user}\n"
        f"    IdentityFile {identity}\n"
        "    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {known_hosts}\n"
        "    GlobalKnownHostsFile /dev/null\n"
        "    StrictHostKeyChecking yes\n"
        "    BatchMode yes\n"
        "    ConnectTimeout 5\n"
        "    LogLevel ERROR\n"
    )
    return "".join(blocks) + common


def _launch(host: Host, isolated: bool) -> subprocess.Popen:
    log = open(host.dir / "launch.log", "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        if isolated:
            argv = [
                "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child=SIGKILL",
                "/bin/sh", str(host.dir / "init.sh"),
            ]  # fmt: skip
        else:
            argv = [SSHD, "-D", "-f", str(host.sshd_config), "-E", str(host.log)]
        # Own session: Ctrl-C in the terminal running pytest must not reach the hosts before teardown.
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    finally:
        log.close()


def _wait_listening(host: Host, popen: subprocess.Popen, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = _tail(host.dir / "launch.log") + _tail(host.log)
            raise RuntimeError(f"sshd for {host.name} exited with {popen.returncode}:\n{tail}")
        try:
            with socket.create_connection((host.address, host.port), timeout=0.5) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"sshd for {host.name} not listening on {host.address}:{host.port} after {timeout}s")


def _namespaces_unavailable() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare binary"
    try:
        r = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "/bin/sh", "-c", "hostname probe"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"unshare exited {r.returncode}")


def keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# --- /proc helpers ---------------------------------------------------------------------------------------


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _environ_has(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _pidns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def _ns_init(unshare_pid: int) -> int:
    """Host-side pid of the namespace's PID 1 (unshare's only child), or 0 if it is gone."""
    kids = _children(unshare_pid)
    return kids[0] if kids else 0


def _descendants(pid: int) -> set[int]:
    seen: set[int] = set()
    todo = [pid]
    while todo:
        for c in _children(todo.pop()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _all_procs() -> list[Proc]:
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = _cmdline(int(entry))
            if cmd:  # kernel threads and zombies have an empty cmdline
                procs.append(Proc(int(entry), cmd))
    return procs


def find_processes(marker: str) -> list[Proc]:
    """Every live process on this machine whose command line contains ``marker`` (any namespace)."""
    me = os.getpid()
    return [p for p in _all_procs() if marker in p.cmdline and p.pid != me]


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_gone(pids: list[int], pidns: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _cmdline(p)]
        if pidns:
            alive += [p.pid for p in _all_procs() if _pidns(p.pid) == pidns]
        if not alive:
            return
        time.sleep(0.02)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) + "\n"
    except OSError:
        return ""


def _shquote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# --- command line ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fake hosts for dslaunch: real sshd servers on 127.0.0.x.")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start N hosts (writes ssh_config, known_hosts, hostfile, env.sh)")
    s.add_argument("dir", type=Path)
    s.add_argument("--hosts", type=int, default=2)
    s.add_argument("--slots", type=int, default=2)
    s.add_argument("--isolate", choices=["ns", "plain"], default="ns")
    s.add_argument("--sshd-extra", default="", help="extra sshd_config lines")
    for name in ("status", "stop"):
        sub.add_parser(name).add_argument("dir", type=Path)
    a = p.parse_args(argv)
    try:
        if a.cmd == "start":
            tb = start(a.dir, a.hosts, a.slots, a.isolate, a.sshd_extra.replace("\\n", "\n"))
            if tb.notice:
                print(tb.notice, file=sys.stderr)
            print(
                f"started {len(tb.hosts)} hosts ({'ns' if tb.isolated else 'plain'}); source {tb.dir}/env.sh"
            )
            return 0
        tb = Testbed.load(a.dir.resolve())
        if a.cmd == "stop":
            tb.stop()
            return 0
        bad = 0
        for h in tb.hosts:
            r = tb.run(h.name, "hostname", timeout=10)
            ok = r.returncode == 0
            bad += not ok
            state = f"up {r.stdout.strip()}" if ok else f"DOWN {r.stderr.strip()}"
            print(f"{h.name} {h.address}:{h.port} {state}")
        return 1 if bad else 0
    except (TestbedUnavailable, RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"sshd_testbed: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
