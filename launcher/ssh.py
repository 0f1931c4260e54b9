"""SSH to the job's hosts: settings, connections, host-key policy, remote commands, preflight, typed errors.

This module owns every SSH connection dslaunch makes. One settings object (:class:`SSHSettings`) feeds every
call, so a port, user, key or known_hosts file given once applies to the preflight, to MASTER_ADDR discovery
and to the agents alike (DeepSpeed used a different code path for each and lost ``--ssh_port`` on some).

What a user gets that ``ssh host hostname >/dev/null 2>&1`` does not give:

- settings from the user's ssh_config (HostName, Port, User, IdentityFile, IdentitiesOnly,
  UserKnownHostsFile, GlobalKnownHostsFile, ConnectTimeout, ProxyCommand, ProxyJump) via paramiko.SSHConfig,
  with ``--ssh_config`` and ``--ssh_port`` overriding;
- host keys checked against known_hosts; an unknown or changed key is refused with the fingerprint seen and
  the exact command that fixes it. Trusting new keys is an explicit opt-in (``accept_new_host_keys``), which
  records them in the user's known_hosts like OpenSSH's ``StrictHostKeyChecking accept-new``;
- every failure as :class:`SSHHostError` naming the host, a :class:`Cause`, the underlying message and a
  hint.

known_hosts files are read through ``launcher.known_hosts`` (once per launch, bad lines reported with file and
line); paramiko comes from ``launcher.sshlib``. ``launcher.preflight`` builds on this to check every host
before a job starts. ds_report and the runners
reuse :func:`resolve`, :func:`connect` and :func:`run`.
"""

from __future__ import annotations

import base64
import enum
import errno
import getpass
import hashlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from launcher import known_hosts
from launcher.sshlib import enable_match_exec, paramiko, uses_match_exec

# paramiko's transport thread logs every failed handshake with a traceback; with no handler configured
# Python would print those on the user's terminal. Our typed errors carry the cause instead.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_MAX_PARALLEL = 8  # below sshd's MaxStartups 10, so a burst of connects is never dropped
_RETRIES_ON_BANNER = 3  # a dropped burst (MaxStartups) or a busy server answers "banner" errors


class Cause(enum.Enum):
    """Why a host could not be used. The value is the short phrase shown to the user."""

    CONFIG = "bad ssh settings"
    DNS = "host name does not resolve"
    REFUSED = "connection refused"
    TIMEOUT = "connection timed out"
    UNREACHABLE = "network unreachable"
    NO_SSH_SERVER = "no SSH server answered"
    UNKNOWN_HOST_KEY = "unknown host key"
    HOST_KEY_CHANGED = "host key changed"
    AUTH = "authentication failed"
    PROXY = "proxy failed"
    NO_PYTHON = "python not found on host"
    NO_PROJECT = "project not found on host"
    COMMAND = "remote command failed"
    DISCONNECTED = "connection lost"


class SSHHostError(Exception):
    """A host could not be reached or used. ``str()`` is a complete message for the user."""

    def __init__(self, host: str, cause: Cause, detail: str, hint: str = "") -> None:
        self.host, self.cause, self.detail, self.hint = host, cause, detail, hint
        msg = f"{host}: {cause.value}: {detail}"
        super().__init__(msg + (f"\n    fix: {hint}" if hint else ""))


@dataclass(frozen=True)
class SSHSettings:
    """What the user chose about SSH (flags); per-host values come from ssh_config via :func:`resolve`."""

    config_path: Path | None = None  # --ssh_config; None: ~/.ssh/config when it exists
    port: int | None = None  # --ssh_port: overrides every host's Port
    accept_new_host_keys: bool = False  # trust-on-first-use, recorded in known_hosts; never the default
    connect_timeout: float = 10.0  # used when ssh_config has no ConnectTimeout
    max_parallel: int = DEFAULT_MAX_PARALLEL


@dataclass(frozen=True)
class HostTarget:
    """One host's resolved connection parameters."""

    alias: str  # the name in the hostfile
    hostname: str  # what we connect to (ssh_config HostName)
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()  # user files; new keys are recorded in the first
    global_known_hosts_files: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    proxy_command: str | None = None
    proxy_jump: str | None = None

    @property
    def known_hosts_key(self) -> str:
        """How known_hosts names this host (OpenSSH and paramiko agree)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def __str__(self) -> str:
        name = f"[{self.hostname}]" if ":" in self.hostname else self.hostname  # IPv6: as OpenSSH writes it
        return f"{self.alias} ({self.user}@{name}:{self.port})"


def _split_host(host: str) -> tuple[str | None, str, int | None]:
    """``[user@]name[:port]`` -> (user, name, port); an IPv6 name is written ``[addr]`` or ``[addr]:port``
    (returned without brackets: what paramiko connects to) or bare ``addr`` (port from the settings)."""
    user, _, rest = host.rpartition("@")
    name, port_text = rest, None
    if rest.startswith("["):
        inner, closed, after = rest[1:].partition("]")
        if not closed or not inner or (after and not after.startswith(":")):
            raise SSHHostError(
                host, Cause.CONFIG, f"bad host {host!r}", "write an IPv6 address as [ADDR] or [ADDR]:PORT"
            )
        name, port_text = inner, (after[1:] if after else None)
    elif rest.count(":") == 1:  # not an IPv6 literal
        name, _, port_text = rest.partition(":")
    if port_text is not None and not port_text.isdigit():
        raise SSHHostError(
            host, Cause.CONFIG, f"bad port {port_text!r} in host {host!r}", "use host or host:PORT"
        )
    return user or None, name, int(port_text) if port_text is not None else None


def load_ssh_config(settings: SSHSettings) -> paramiko.SSHConfig:
    """The user's ssh_config (``--ssh_config``, else ~/.ssh/config when it exists). Parse it once per
    launch and hand it to :func:`resolve`: every host then reuses it."""
    path = settings.config_path
    if path is None:
        default = Path("~/.ssh/config").expanduser()
        if not default.is_file():
            return paramiko.SSHConfig()
        path = default
    elif not Path(path).is_file():
        raise SSHHostError(
            "(all hosts)", Cause.CONFIG, f"ssh config file not found: {path}", "check --ssh_config"
        )
    try:
        text = Path(path).read_text()
        if uses_match_exec(text):
            enable_match_exec()
        return paramiko.SSHConfig.from_text(text)
    except Exception as e:  # paramiko raises ConfigParseError, ValueError, ... on bad lines
        raise SSHHostError("(all hosts)", Cause.CONFIG, f"cannot parse {path}: {e}") from e


def resolve(host: str, settings: SSHSettings, config: paramiko.SSHConfig | None = None) -> HostTarget:
    """A hostfile name (``[user@]name[:port]``) -> connection parameters, ssh_config and flags applied."""
    cfg = load_ssh_config(settings) if config is None else config
    user, name, port = _split_host(host)
    o = cfg.lookup(name)

    def files(key: str, default: str) -> tuple[str, ...]:
        value = o.get(key, default)
        items = value if isinstance(value, list) else value.split()
        return tuple(os.path.expanduser(v) for v in items if v.lower() != "none")

    try:
        port = port or settings.port or int(o.get("port", 22))
        timeout = float(o.get("connecttimeout", settings.connect_timeout))
    except ValueError as e:
        raise SSHHostError(host, Cause.CONFIG, f"bad Port or ConnectTimeout in ssh config: {e}") from e
    jump = o.get("proxyjump")
    return HostTarget(
        alias=host,
        hostname=o.get("hostname", name),
        port=port,
        user=user or o.get("user") or getpass.getuser(),
        identity_files=files("identityfile", ""),
        identities_only=o.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=files("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2"),
        global_known_hosts_files=files("globalknownhostsfile", "/etc/ssh/ssh_known_hosts"),
        connect_timeout=timeout,
        proxy_command=o.get("proxycommand") if o.get("proxycommand", "none").lower() != "none" else None,
        proxy_jump=jump if jump and jump.lower() != "none" else None,
    )


# --- host keys -------------------------------------------------------------------------------------------


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _UnknownHostKey(Exception):
    def __init__(self, key: paramiko.PKey) -> None:
        super().__init__(key.get_name())
        self.key = key


_known_hosts_lock = threading.Lock()  # preflight threads may record several new keys at once


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys, or (opt-in) record them in the user's known_hosts like ``accept-new``.

    A *changed* key never reaches this policy: paramiko raises BadHostKeyException for it, whatever the
    policy, so accept-new can never overwrite a recorded key.
    """

    def __init__(self, target: HostTarget, accept_new: bool) -> None:
        self.target, self.accept_new = target, accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise _UnknownHostKey(key)
        if not self.target.known_hosts_files:
            raise _UnknownHostKey(key)
        path = Path(self.target.known_hosts_files[0])
        with _known_hosts_lock:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{self.target.known_hosts_key} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


# --- connect ---------------------------------------------------------------------------------------------


def connect(host: str | HostTarget, settings: SSHSettings) -> paramiko.SSHClient:
    """Open an authenticated connection or raise :class:`SSHHostError` with the real cause and a fix."""
    target = host if isinstance(host, HostTarget) else resolve(host, settings)
    for attempt in range(_RETRIES_ON_BANNER):
        try:
            return _connect_once(target, settings)
        except SSHHostError as e:
            if e.cause is not Cause.NO_SSH_SERVER or attempt == _RETRIES_ON_BANNER - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _connect_once(t: HostTarget, settings: SSHSettings) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    try:  # each file parsed once per launch; the client gets only this host's keys
        known = known_hosts.lookup(
            t.known_hosts_key, t.global_known_hosts_files, tuple(reversed(t.known_hosts_files))
        )
    except known_hosts.KnownHostsError as e:
        hint = e.hint(t.known_hosts_key)
        raise SSHHostError(str(t), Cause.CONFIG, f"bad known_hosts line: {e}", hint) from None
    for keytype, key in (known or {}).items():
        client.get_host_keys().add(t.known_hosts_key, keytype, key)
    client.set_missing_host_key_policy(_HostKeyPolicy(t, settings.accept_new_host_keys))
    keys = [f for f in t.identity_files if os.path.isfile(f)]
    sock = None
    try:
        if t.proxy_jump:
            sock = _jump_channel(t, t.proxy_jump, settings)
        elif t.proxy_command:
            sock = paramiko.ProxyCommand(t.proxy_command)
        client.connect(
            t.hostname,
            port=t.port,
            username=t.user,
            key_filename=keys or None,
            allow_agent=not t.identities_only,
            look_for_keys=not t.identities_only,
            timeout=t.connect_timeout,
            banner_timeout=t.connect_timeout,
            auth_timeout=t.connect_timeout,
            sock=sock,
        )
    except Exception as e:
        # "No existing session" and the like hide the real story: the server never said its banner
        # (paramiko gives up negotiating at the connect timeout and then fails to authenticate).
        transport = client.get_transport()
        silent = transport is not None and not getattr(transport, "remote_version", "?")
        client.close()
        if silent and isinstance(e, paramiko.SSHException):
            e = paramiko.SSHException(f"no SSH protocol banner within {t.connect_timeout:g}s")
        raise _explain(t, e) from e
    if sock is not None:
        client._dslaunch_jump = getattr(sock, "_dslaunch_client", None)  # keep the jump host open
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(15)  # notice a dead network path, not only a closed socket
    return client


def _jump_channel(t: HostTarget, proxy_jump: str, settings: SSHSettings) -> paramiko.Channel:
    jump_target = resolve(proxy_jump.split(",")[0], settings)
    jump = connect(jump_target, settings)
    transport = jump.get_transport()
    assert transport is not None
    try:
        chan = transport.open_channel("direct-tcpip", (t.hostname, t.port), ("127.0.0.1", 0))
    except Exception as e:
        jump.close()
        raise SSHHostError(str(t), Cause.PROXY, f"jump host {jump_target} could not reach it: {e}") from e
    chan._dslaunch_client = jump
    return chan


def _explain(t: HostTarget, e: BaseException) -> SSHHostError:
    """Turn whatever paramiko or the socket layer raised into a typed error with a fix."""
    host, kh = str(t), (t.known_hosts_files or ("~/.ssh/known_hosts",))[0]
    if isinstance(e, SSHHostError):
        return e
    if isinstance(e, _UnknownHostKey):
        return SSHHostError(
            host,
            Cause.UNKNOWN_HOST_KEY,
            f"{t.known_hosts_key} is not in {' or '.join(t.known_hosts_files) or 'any known_hosts file'} "
            f"(it offered {e.key.get_name()} {fingerprint(e.key)})",
            f"check that fingerprint with the host's admin, then record it: "
            f"ssh-keyscan -p {t.port} {t.hostname} >> {kh}   "
            f"(or rerun with --accept_new_host_keys to trust keys seen for the first time)",
        )
    if isinstance(e, paramiko.BadHostKeyException):
        return SSHHostError(
            host,
            Cause.HOST_KEY_CHANGED,
            f"it offered {e.key.get_name()} {fingerprint(e.key)} but known_hosts has "
            f"{e.expected_key.get_name()} {fingerprint(e.expected_key)}: the host was reinstalled, or "
            f"someone is intercepting the connection",
            f"if you know why the key changed: ssh-keygen -f {kh} -R '{t.known_hosts_key}' "
            f"and connect again (accepting new keys never replaces a changed one)",
        )
    if isinstance(e, paramiko.AuthenticationException):
        tried = ", ".join(t.identity_files) or "ssh-agent and ~/.ssh/id_*"
        return SSHHostError(
            host,
            Cause.AUTH,
            f"{t.user}@{t.hostname} refused the keys tried ({tried}): {e}",
            f"add the public key to ~{t.user}/.ssh/authorized_keys on {t.alias} "
            f"(ssh-copy-id -p {t.port} {t.user}@{t.hostname}) or set User/IdentityFile in ssh_config",
        )
    if isinstance(e, socket.gaierror):
        return SSHHostError(
            host,
            Cause.DNS,
            f"{t.hostname!r}: {e.strerror or e}",
            "fix the name in the hostfile, add a HostName for it in ssh_config, or use its IP address",
        )
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        codes = {getattr(x, "errno", None) for x in e.errors.values()}
        if codes <= {errno.ECONNREFUSED}:
            return SSHHostError(
                host,
                Cause.REFUSED,
                f"nothing listens on {t.hostname} port {t.port}",
                "start sshd there, or set the right port (Port in ssh_config, --ssh_port, host:PORT)",
            )
        e = next(iter(e.errors.values()))
    if isinstance(e, paramiko.ssh_exception.ProxyCommandFailure):
        return SSHHostError(host, Cause.PROXY, str(e), "check ProxyCommand in ssh_config")
    if isinstance(e, TimeoutError):
        return SSHHostError(
            host,
            Cause.TIMEOUT,
            f"no answer from {t.hostname}:{t.port} within {t.connect_timeout:g}s",
            f"check the address and that a firewall lets port {t.port} through",
        )
    if isinstance(e, OSError) and e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNREFUSED):
        cause = Cause.REFUSED if e.errno == errno.ECONNREFUSED else Cause.UNREACHABLE
        return SSHHostError(host, cause, f"{t.hostname}:{t.port}: {e.strerror}")
    if isinstance(e, paramiko.SSHException) and "banner" in str(e).lower():
        return SSHHostError(
            host,
            Cause.NO_SSH_SERVER,
            f"{t.hostname}:{t.port} accepted TCP but sent no SSH greeting: {e}",
            "check that the port is sshd's; a busy sshd drops bursts of connections (MaxStartups)",
        )
    if isinstance(e, OSError) and e.filename:
        return SSHHostError(host, Cause.CONFIG, f"{e.strerror}: {e.filename}")
    return SSHHostError(host, Cause.DISCONNECTED, f"{type(e).__name__}: {e}")


# --- remote commands -------------------------------------------------------------------------------------


def run(
    host: str | HostTarget,
    command: str,
    settings: SSHSettings,
    timeout: float = 30.0,
    client: paramiko.SSHClient | None = None,
) -> tuple[int, str, str]:
    """Run a shell command on a host; return (exit code, stdout, stderr). Connection problems raise
    :class:`SSHHostError`; a non-zero exit code is returned, not raised. -1: killed by a signal."""
    target = host if isinstance(host, HostTarget) else resolve(host, settings)
    own = client is None
    c = connect(target, settings) if client is None else client
    try:
        transport = c.get_transport()
        if transport is None or not transport.is_active():
            raise SSHHostError(str(target), Cause.DISCONNECTED, "connection closed")
        chan = transport.open_session(timeout=timeout)
        chan.settimeout(timeout)
        chan.exec_command(command)
        chan.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        while not (chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready()):
            if time.monotonic() > deadline:
                chan.close()
                raise SSHHostError(
                    str(target), Cause.COMMAND, f"{command!r} still running after {timeout:g}s"
                )
            if chan.recv_ready():
                out += chan.recv(65536)
            elif chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            else:
                time.sleep(0.01)
        rc = chan.recv_exit_status()
        chan.close()
        return rc, out.decode(errors="replace"), err.decode(errors="replace")
    except (paramiko.SSHException, OSError) as e:
        raise SSHHostError(str(target), Cause.DISCONNECTED, f"{type(e).__name__}: {e}") from e
    finally:
        if own:
            c.close()
