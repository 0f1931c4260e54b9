"""known_hosts files: read once per launch, every bad line reported with its file, number and a fix.

paramiko's ``SSHClient.load_host_keys`` parses the whole file again for every connection and fails on a
corrupt line with a bare ``UnicodeDecodeError`` (binary garbage) or ``InvalidHostKey`` (a truncated
base64 key), which reached users as ``connection lost: UnicodeDecodeError ...``. Here each file is
parsed once (cached by path, size and modification time, so a key recorded by ``accept-new`` or a file
edited between attempts is read again) and a line that cannot be a host key raises
:class:`KnownHostsError` naming the file, the line number, what is wrong and what to do.

What is skipped, as OpenSSH does: blank and ``#`` lines, key types paramiko cannot use (e.g. security
keys), and marker lines (``@cert-authority``, ``@revoked``: paramiko supports neither).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import threading
from dataclasses import dataclass

from launcher.sshlib import paramiko


@dataclass(frozen=True)
class KnownHostsError(Exception):
    """A line of a known_hosts file that cannot be read. ``str()`` says which, why and the fix."""

    path: str
    line: int
    text: str
    reason: str

    def __str__(self) -> str:
        shown = self.text if len(self.text) <= 80 else self.text[:77] + "..."
        return f"{self.path} line {self.line}: {self.reason}: {shown!r}"

    def hint(self, host: str = "HOST") -> str:
        """What to do; ``host`` as known_hosts names the host being connected to."""
        return (
            f"remove or fix line {self.line} of {self.path} (sed -i '{self.line}d' {self.path}); if it "
            f"is {host}'s entry, ssh-keygen -f {self.path} -R '{host}' removes it, then record the key "
            f"again (ssh-keyscan, or --accept_new_host_keys)"
        )


@dataclass
class HostKeyFile:
    """One parsed file: plain host names indexed, hashed ones (``|1|salt|hmac``) checked per lookup."""

    plain: dict[str, dict[str, paramiko.PKey]]
    hashed: list[tuple[str, str, paramiko.PKey]]  # (hashed name, key type, key)

    def lookup(self, name: str) -> dict[str, paramiko.PKey]:
        found = dict(self.plain.get(name, {}))
        for hashed, keytype, key in self.hashed:
            if hmac.compare_digest(paramiko.HostKeys.hash_host(name, hashed), hashed):
                found[keytype] = key
        return found


_cache: dict[str, tuple[tuple[int, int, int], HostKeyFile]] = {}
_lock = threading.Lock()  # connections to many hosts look keys up at once


def load(path: str) -> HostKeyFile:
    """The host keys of one file (none when it does not exist). Raises :class:`KnownHostsError`."""
    try:
        st = os.stat(path)
    except OSError:
        return HostKeyFile({}, [])
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        hit = _cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        keys = parse(path)
        _cache[path] = (stamp, keys)
        return keys


def parse(path: str) -> HostKeyFile:
    """Read one known_hosts file; a later line replaces an earlier one's key of the same type."""
    out = HostKeyFile({}, [])
    with open(path, "rb") as f:
        data = f.read()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace").strip()
            raise KnownHostsError(path, number, text, "not text (binary garbage in the file)") from None
        if not line or line.startswith(("#", "@")):
            continue
        fields = line.split()
        if len(fields) < 3:
            raise KnownHostsError(path, number, line, "expected 'HOSTS KEYTYPE BASE64-KEY'")
        names, keytype, blob = fields[:3]
        try:
            data_bytes = base64.b64decode(blob, validate=True)
        except (binascii.Error, ValueError):
            raise KnownHostsError(path, number, line, "the key is not valid base64 (cut short?)") from None
        try:
            key = paramiko.PKey.from_type_string(keytype, data_bytes)
            # paramiko pads a short key with zero bytes instead of failing: a cut key reads as another
            intact = key.asbytes() == data_bytes
        except paramiko.UnknownKeyType:
            continue  # a key type paramiko does not use (e.g. sk-ssh-ed25519@openssh.com)
        except Exception:  # the bytes do not parse as that key type
            intact = False
        if not intact:
            raise KnownHostsError(path, number, line, f"the {keytype} key is damaged (cut short or edited?)")
        for name in names.split(","):
            if name.startswith("|1|"):
                out.hashed.append((name, key.get_name(), key))
            else:
                out.plain.setdefault(name, {})[key.get_name()] = key
    return out


def lookup(name: str, system_files: tuple[str, ...], user_files: tuple[str, ...]) -> dict | None:
    """The keys known for ``name`` (``host`` or ``[host]:port``): {keytype: PKey}, or None.

    The same order as paramiko's client: the system files decide when they know the host at all,
    else the user files; a later file replaces an earlier one's key of the same type.
    """
    for files in (system_files, user_files):
        found: dict = {}
        for path in files:
            found.update(load(path).lookup(name))
        if found:
            return found
    return None
