"""Turning a Report into text: an aligned table for people, JSON for scripts.

The table fits one screen: one row per local check, and one row per remote host (its worst status, and
either a one-line summary or the reasons it is not OK). Hosts that fail the same way (one check, one
cause: 1000 hosts that refuse the connection) are one row naming a few of them and one fix row, as the
launcher's preflight prints them; the verdict names a few failed checks and counts the rest. JSON keeps
every check of every host. Colour is only for a terminal and only when NO_COLOR is unset
(https://no-color.org), so pasted bug reports and piped output stay plain.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import TextIO

from launcher.report.runner import CheckResult, Report, Status, worst

_COLOURS = {Status.OK: "32", Status.WARNING: "33", Status.FAIL: "1;31", Status.SKIP: "2"}
_HEADER = ("SECTION", "CHECK", "STATUS", "DETAIL")
HOSTS_SECTION = "hosts"


def use_colour(stream: TextIO) -> bool:
    return stream.isatty() and not os.environ.get("NO_COLOR")


def _paint(status: Status, width: int, colour: bool) -> str:
    padded = status.value.ljust(width)
    if not colour:
        return padded
    # Pad first, then colour: escape codes have no width on screen.
    return f"\033[{_COLOURS[status]}m{status.value}\033[0m" + padded[len(status.value) :]


NAMED = 3  # hosts (or failed checks) named in a folded row; the rest are counted


def _names(names: list[str]) -> str:
    more = f" ... and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


def _folded_row(group: list[CheckResult]) -> list[tuple[str, Status | None, str]]:
    """Hosts whose one failure has one cause: a row naming a few, an example's detail, and the fix."""
    first = group[0]
    detail = first.detail.removeprefix(f"{first.cause}: ").removesuffix(f" (fix: {first.fix})")
    hosts = _names([r.host or "?" for r in group])
    rows: list[tuple[str, Status | None, str]] = [
        (f"{len(group)} hosts", first.status, f"{first.name}: {hosts}: {first.cause} (e.g. {detail})")
    ]
    if first.fix:
        same = all(r.fix == first.fix for r in group)
        for_whom = "" if same else f" (for {first.host}; likewise for the others)"
        rows.append(("", None, f"fix{for_whom}: {first.fix}"))
    return rows


def _host_rows(results: Iterable[CheckResult]) -> list[tuple[str, Status | None, str]]:
    """Fold each remote host's checks into one row: the summary if all OK, else what is wrong; hosts
    failing the same way are folded into one row (see the module docstring)."""
    by_host: dict[str, list[CheckResult]] = {}
    for result in results:
        by_host.setdefault(result.host or "?", []).append(result)
    rows: list[tuple[str, Status | None, str]] = []
    folded: dict[tuple[str, str], list[CheckResult]] = {}
    for host, host_results in by_host.items():
        status = worst(r.status for r in host_results)
        bad = [r for r in host_results if r.status is not Status.OK]
        if len(bad) == 1 and bad[0].cause:
            key = (bad[0].name, bad[0].cause)
            if key not in folded:
                rows.append((host, None, ""))  # the place of the group, filled in below
                folded[key] = []
            folded[key].append(bad[0])
            continue
        if status is Status.OK:
            detail = ", ".join(r.detail for r in host_results)
        else:
            detail = "; ".join(f"{r.name}: {r.detail}" for r in bad)
        rows.append((host, status, detail))
    out: list[tuple[str, Status | None, str]] = []
    groups = iter(folded.values())
    for row in rows:
        if row[1] is not None:
            out.append(row)
            continue
        group = next(groups)
        if len(group) == 1:
            only = group[0]
            out.append((row[0], only.status, f"{only.name}: {only.detail}"))
        else:
            out.extend(_folded_row(group))
    return out


def verdict(report: Report) -> str:
    """The one line that answers "will my job run here, and if not, why"."""
    warned = [
        r.host + ":" + r.name if r.host else r.name for r in report.results if r.status is Status.WARNING
    ]
    warnings = f"{len(warned)} warning(s): {_names(warned)}" if warned else "no warnings"
    if report.ready:
        return f"READY: no check failed, {warnings}."
    failed = [r.host + ":" + r.name if r.host else r.name for r in report.failed]
    return f"NOT READY: {len(failed)} check(s) failed: {_names(failed)} (see FAIL rows); {warnings}."


def render_table(report: Report, colour: bool = False) -> str:
    local = [(r.section, r.name, r.status, r.detail) for r in report.results if r.host is None]
    remote = [(HOSTS_SECTION, *row) for row in _host_rows(r for r in report.results if r.host is not None)]
    rows = local + remote
    section_width = max(len(_HEADER[0]), *(len(row[0]) for row in rows))
    name_width = max(len(_HEADER[1]), *(len(row[1]) for row in rows))
    status_width = max(len(s.value) for s in Status)

    def line(section: str, name: str, status: str, detail: str) -> str:
        return f"{section.ljust(section_width)}  {name.ljust(name_width)}  {status}  {detail}".rstrip()

    def painted(status: Status | None) -> str:
        return " " * status_width if status is None else _paint(status, status_width, colour)

    lines = [
        f"dslaunch {report.version} environment report for {report.hostname} ({report.seconds:.1f} s)",
        "",
        line(_HEADER[0], _HEADER[1], _HEADER[2].ljust(status_width), _HEADER[3]),
    ]
    previous_section = None
    for section, name, status, detail in rows:
        shown = section if section != previous_section else ""
        previous_section = section
        lines.append(line(shown, name, painted(status), detail))
    lines += ["", verdict(report)]
    return "\n".join(lines) + "\n"


def render_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2) + "\n"
