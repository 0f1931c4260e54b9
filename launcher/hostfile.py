"""Hostfiles and host filters: which hosts a job may use, with how many slots, in which order.

Hostfile format (DeepSpeed/MPI style), one host per line, line order = rank order::

    # comment lines and blank lines are ignored
    worker-0 slots=8
    worker-1 slots=4   # a comment after an entry is fine

A host is ``[user@]name[:port]``: ``name`` a DNS name, an IPv4 address or an ssh_config ``Host`` alias
(letters, digits, ``.-_``), or an IPv6 address in brackets (``[::1]``, ``[fe80::1%eth0]:2222``,
``user@[::1]:22``, as OpenSSH writes them in known_hosts); the user and SSH port optional. Filters name a
host by ``name`` alone, an IPv6 address with its brackets (``--include [::1]:0,1``): ``@`` and ``:`` are
filter separators, so a name may appear on one line only. ``slots=0`` is allowed (the host is listed but
gets no workers).

Filters (DeepSpeed syntax): ``NAME[:SLOT[,SLOT...]][@NAME[:SLOTS]...]``, e.g. ``worker-0@worker-1:0,2``.
``--include`` keeps only what it names (a bare name keeps all of the host's slots); ``--exclude`` drops
what it names (a bare name drops the host). ``--num_nodes N`` keeps the first N hosts; ``--num_gpus N``
keeps slots 0..N-1 of every host. Filters and counts do not combine.

Every problem raises ``HostfileError`` naming the file, the line and the offending text; nothing here
starts anything. Two lines naming one machine (``localhost`` and ``127.0.0.1``, a name and its address)
are refused by ``check_one_line_per_machine``, given what identifies each host's machine (resolved by
``launcher.machine.machine_keys``: this module does no I/O).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.errors import HostfileError

_HOST = re.compile(
    r"(?:(?P<user>[A-Za-z0-9_.\-]+)@)?(?P<name>[A-Za-z0-9_.\-]+|\[[^\]@\s]+\])(?::(?P<port>\d+))?"
)
_FLAG_USAGE = "expected NAME[:SLOT,...][@NAME...]"


@dataclass(frozen=True)
class HostEntry:
    host: str  # as written: [user@]name[:port], what runners connect to
    name: str  # the bare name, what filters use (an IPv6 address with its brackets)
    slots: int
    line: int  # 1-based line number in the hostfile (0 for a synthesized entry)
    text: str  # the line as written


@dataclass(frozen=True)
class Hostfile:
    path: str
    entries: tuple[HostEntry, ...]

    def find(self, name: str) -> HostEntry | None:
        return next((e for e in self.entries if e.name == name), None)


@dataclass(frozen=True)
class SelectedHost:
    """A host that takes part in the job, and the slot ids it uses (sorted)."""

    host: str  # [user@]name[:port] as in the hostfile
    slots: tuple[int, ...]
    entry: HostEntry


def _parse_slots(value: str) -> int | None:
    return int(value) if value.isdigit() else None


def _bad_host(host: str) -> str | None:
    """Why a host token is not ``[user@]name[:port]``, or None when it is."""
    match = _HOST.fullmatch(host)
    if match is None:
        if host.count(":") > 1 and "[" not in host:
            return f"bad host {host!r}: write an IPv6 address in brackets, e.g. [{host}] or [{host}]:22"
        return f"bad host {host!r} (expected [user@]name[:port])"
    name = match["name"]
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return f"bad host {host!r}: {name} is not an IPv6 address (brackets are for IPv6 only)"
    if match["port"] is not None and not 0 < int(match["port"]) < 65536:
        return f"port {match['port']} is not a TCP port (1-65535)"
    return None


def split_host(host: str) -> tuple[str | None, str, int | None]:
    """A hostfile host ``[user@]name[:port]`` -> (user, name, port), an IPv6 name without brackets.
    Raises ValueError for a host that :func:`parse_hostfile` would refuse."""
    why = _bad_host(host)
    if why:
        raise ValueError(why)
    match = _HOST.fullmatch(host)
    assert match is not None
    name = match["name"].strip("[]")
    return match["user"], name, int(match["port"]) if match["port"] else None


def parse_hostfile(text: str, path: str) -> Hostfile:
    entries: list[HostEntry] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        tokens = content.split()
        host = tokens[0]
        why = f"bad host {host!r} (expected [user@]name[:port])" if host.startswith("slots=") else None
        why = why or _bad_host(host)
        if why:
            raise HostfileError(path, number, line, why)
        match = _HOST.fullmatch(host)
        assert match is not None
        name = match["name"]
        if len(tokens) == 1:
            raise HostfileError(path, number, line, "missing 'slots=N' after the host name")
        if not tokens[1].startswith("slots="):
            raise HostfileError(
                path, number, line, f"expected 'slots=N' after the host name, got {tokens[1]!r}"
            )
        if len(tokens) > 2:
            raise HostfileError(path, number, line, f"unexpected {tokens[2]!r} after 'slots=N'")
        slots = _parse_slots(tokens[1][len("slots=") :])
        if slots is None:
            raise HostfileError(path, number, line, "slots must be a non-negative integer")
        previous = next((e for e in entries if e.name == name), None)
        if previous is not None:
            raise HostfileError(
                path, number, line, f"host {name!r} is already listed on line {previous.line}"
            )
        entries.append(HostEntry(host, name, slots, number, line))
    if not entries:
        raise HostfileError(path, 0, "", "no hosts in the hostfile (expected lines like 'worker-0 slots=8')")
    return Hostfile(path, tuple(entries))


def check_one_line_per_machine(
    path: str, selected: Sequence[SelectedHost], keys: Mapping[str, frozenset[str]]
) -> None:
    """Refuse two selected hosts that are one machine (``keys``: host -> what identifies its machine,
    from ``launcher.machine.machine_keys``): both would be nodes with LOCAL_RANK 0, on the same GPUs."""
    seen: dict[str, SelectedHost] = {}
    for sel in selected:
        for key in sorted(keys.get(sel.host, ())):
            first = seen.setdefault(key, sel)
            if first is not sel:
                what = key.rsplit(":", 1)[0]
                a, b = first.entry, sel.entry
                raise HostfileError(
                    path,
                    b.line,
                    b.text,
                    f"{b.name!r} is the same machine as {a.name!r} on line {a.line} ({path}:{a.line}: "
                    f"{a.text!r}; both are {what}), so both would start at LOCAL_RANK 0 on the same "
                    f"devices: list each machine once, with all its slots on one line",
                )


def read_hostfile(path: str) -> Hostfile:
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors) is not a host
            text = f.read()
    except OSError as exc:
        raise HostfileError(path, 0, "", f"cannot read the hostfile ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise HostfileError(path, 0, "", "the hostfile is not UTF-8 text") from None
    return parse_hostfile(text, path)


def parse_filter(text: str, flag: str, hostfile: Hostfile) -> dict[str, tuple[int, ...] | None]:
    """``NAME[:SLOTS]@...`` -> {name: sorted slot ids, or None for the whole host}, checked against
    the hostfile."""
    result: dict[str, tuple[int, ...] | None] = {}
    path = hostfile.path
    where = f"{flag} {text!r}"
    for part in text.split("@"):
        if part.startswith("["):  # an IPv6 address: its colons are not the slot separator
            end = part.find("]") + 1
            name, rest = (part[:end], part[end:]) if end else (part, "")
            colon, slot_text = rest[:1], rest[1:]
            if rest and colon != ":":
                raise HostfileError(path, 0, "", f"{where}: bad host {part!r} ({_FLAG_USAGE})")
        else:
            name, colon, slot_text = part.partition(":")
        if not name:
            raise HostfileError(path, 0, "", f"{where}: empty host name ({_FLAG_USAGE})")
        entry = hostfile.find(name)
        if entry is None:
            known = ", ".join(e.name for e in hostfile.entries)
            raise HostfileError(
                hostfile.path, 0, "", f"{where}: host {name!r} is not in the hostfile ({known})"
            )
        if name in result:
            raise HostfileError(
                hostfile.path, entry.line, entry.text, f"{where}: host {name!r} is named twice"
            )
        if not colon:
            result[name] = None
            continue
        slots: list[int] = []
        for item in slot_text.split(","):
            slot = _parse_slots(item)
            if slot is None:
                raise HostfileError(
                    path, entry.line, entry.text, f"{where}: slot {item!r} is not a slot number"
                )
            if slot >= entry.slots:
                have = f"slots 0-{entry.slots - 1}" if entry.slots else "no slots"
                raise HostfileError(
                    hostfile.path,
                    entry.line,
                    entry.text,
                    f"{where}: host {name!r} has no slot {slot} ({have})",
                )
            if slot in slots:
                raise HostfileError(
                    hostfile.path, entry.line, entry.text, f"{where}: slot {slot} is named twice"
                )
            slots.append(slot)
        result[name] = tuple(sorted(slots))
    return result


def select_hosts(
    hostfile: Hostfile,
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> tuple[SelectedHost, ...]:
    """Apply the filters and counts to the hostfile; hosts that end with no slots are dropped."""
    path = hostfile.path
    if include and exclude:
        raise HostfileError(
            path, 0, "", f"--include {include!r} and --exclude {exclude!r} cannot be combined"
        )
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        flag = "--include" if include else "--exclude"
        count = "--num_nodes" if num_nodes is not None else "--num_gpus"
        raise HostfileError(path, 0, "", f"{count} cannot be combined with {flag} {include or exclude!r}")
    entries = hostfile.entries
    chosen = [(e, tuple(range(e.slots))) for e in entries]
    if include:
        wanted = parse_filter(include, "--include", hostfile)
        chosen = [(e, s if (w := wanted[e.name]) is None else w) for e, s in chosen if e.name in wanted]
    elif exclude:
        dropped = parse_filter(exclude, "--exclude", hostfile)
        chosen = [
            (e, () if (d := dropped[e.name]) is None else tuple(x for x in s if x not in d))
            if e.name in dropped
            else (e, s)
            for e, s in chosen
        ]
    if num_nodes is not None:
        if num_nodes < 1:
            raise HostfileError(path, 0, "", f"--num_nodes {num_nodes}: must be at least 1")
        if num_nodes > len(entries):
            raise HostfileError(
                path, 0, "", f"--num_nodes {num_nodes}: the hostfile lists only {len(entries)} host(s)"
            )
        chosen = chosen[:num_nodes]
    if num_gpus is not None:
        if num_gpus < 1:
            raise HostfileError(path, 0, "", f"--num_gpus {num_gpus}: must be at least 1")
        for e, _ in chosen:
            if num_gpus > e.slots:
                raise HostfileError(
                    path, e.line, e.text, f"--num_gpus {num_gpus}: host {e.name!r} has only {e.slots} slot(s)"
                )
        chosen = [(e, tuple(range(num_gpus))) for e, _ in chosen]
    selected = tuple(SelectedHost(e.host, s, e) for e, s in chosen if s)
    if not selected:
        empty = [e for e, _ in chosen if e.slots == 0]
        if empty:  # the line to change is the one with slots=0
            more = f" (so do {len(empty) - 1} more host(s))" if len(empty) > 1 else ""
            raise HostfileError(
                path,
                empty[0].line,
                empty[0].text,
                f"no slots left to run on: host {empty[0].name!r} has slots=0{more}; set slots=N (N >= 1)",
            )
        flag = f"--exclude {exclude!r}" if exclude else f"--include {include!r}" if include else ""
        what = flag or "the hostfile"
        raise HostfileError(path, 0, "", f"no slots left to run on after {what}")
    return selected
