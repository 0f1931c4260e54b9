"""Turning a Report into text: an aligned table for people, JSON for scripts.

The table fits one screen: one row per local check, and one row per remote host (its worst status, and
either a one-line summary or the reasons it is not OK). JSON keeps every check of every host. Colour is
only for a terminal and only when NO_COLOR is unset (https://no-color.org), so pasted bug reports and
piped output stay plain.
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


def _host_rows(results: Iterable[CheckResult]) -> list[tuple[str, Status, str]]:
    """Fold each remote host's checks into one row: the summary if all OK, else what is wrong."""
    by_host: dict[str, list[CheckResult]] = {}
    for result in results:
        by_host.setdefault(result.host or "?", []).append(result)
    rows = []
    for host, host_results in by_host.items():
        status = worst(r.status for r in host_results)
        if status is Status.OK:
            detail = ", ".join(r.detail for r in host_results)
        else:
            detail = "; ".join(f"{r.name}: {r.detail}" for r in host_results if r.status is not Status.OK)
        rows.append((host, status, detail))
    return rows


def verdict(report: Report) -> str:
    """The one line that answers "will my job run here, and if not, why"."""
    warned = [
        r.host + ":" + r.name if r.host else r.name for r in report.results if r.status is Status.WARNING
    ]
    warnings = f"{len(warned)} warning(s): {', '.join(warned)}" if warned else "no warnings"
    if report.ready:
        return f"READY: no check failed, {warnings}."
    failed = [r.host + ":" + r.name if r.host else r.name for r in report.failed]
    return f"NOT READY: {len(failed)} check(s) failed: {', '.join(failed)} (see FAIL rows); {warnings}."


def render_table(report: Report, colour: bool = False) -> str:
    local = [(r.section, r.name, r.status, r.detail) for r in report.results if r.host is None]
    remote = [(HOSTS_SECTION, *row) for row in _host_rows(r for r in report.results if r.host is not None)]
    rows = local + remote
    section_width = max(len(_HEADER[0]), *(len(row[0]) for row in rows))
    name_width = max(len(_HEADER[1]), *(len(row[1]) for row in rows))
    status_width = max(len(s.value) for s in Status)

    def line(section: str, name: str, status: str, detail: str) -> str:
        return f"{section.ljust(section_width)}  {name.ljust(name_width)}  {status}  {detail}".rstrip()

    lines = [
        f"dslaunch {report.version} environment report for {report.hostname} ({report.seconds:.1f} s)",
        "",
        line(_HEADER[0], _HEADER[1], _HEADER[2].ljust(status_width), _HEADER[3]),
    ]
    previous_section = None
    for section, name, status, detail in rows:
        shown = section if section != previous_section else ""
        previous_section = section
        lines.append(line(shown, name, _paint(status, status_width, colour), detail))
    lines += ["", verdict(report)]
    return "\n".join(lines) + "\n"


def render_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2) + "\n"
