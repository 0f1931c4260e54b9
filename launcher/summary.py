"""The failure summary the head prints after a failed attempt. Pure: failures in, lines out.

Failed ranks are grouped by their error file's (kind, message) (``launcher.errorfile``), not by exit
code: a rank that wrote its error and was then caught by the stop's SIGTERM while exiting (exit code 143
instead of 2) still failed the same way as its peers; a group shows its first rank's exit code. A group
of several ranks is one line, ``ranks 0-3,5 failed the same way (exit code 2): <message>``, then its
hint; a user-input error (kind ``user_input``) needs nothing more, any other failure also shows the last
lines of the group's first rank. A failure without a message (a signal, ``sys.exit(7)``, a worker that
could not start, a lost agent) keeps the per-rank form: rank, host, exit code or signal, last lines. The
root cause (the first failure) comes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from launcher.errorfile import USER_INPUT

MAX_OTHER_GROUPS = 4  # after the root cause: at most this many other groups, then a count

_SIGNAL_HINTS = {
    "SIGKILL": "out of memory? (see `dmesg` or the cgroup's memory.events)",
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted (a C++ exception or assertion, e.g. in NCCL or CUDA)",
    "SIGBUS": "bus error (often /dev/shm too small in a container)",
}


@dataclass(frozen=True)
class Failure:
    """One failed worker (or agent) of an attempt."""

    code: int
    what: str  # "rank 2 (local rank 2) on localhost" or "the agent on worker1"
    how: str  # "exited with code 7", "was killed by SIGKILL (exit code 137)", ...
    rank: int | None
    tail: tuple[str, ...]
    message: str = ""  # from the worker's error file: one line
    hint: str = ""
    kind: str = ""  # "user_input", "exception", or "" without an error file
    traceback: str = ""


def status_text(code: int, signame: str | None) -> str:
    """How a worker ended, in words."""
    if signame:
        hint = _SIGNAL_HINTS.get(signame)
        return f"was killed by {signame} (exit code {code})" + (f"; {hint}" if hint else "")
    return f"exited with code {code}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """Sorted ranks as ranges: [0, 1, 2, 3, 5, 7, 8] -> "0-3,5,7-8"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r != run[-1] + 1:
            out.append(_run_text(run))
            run = []
        run.append(r)
    if run:
        out.append(_run_text(run))
    return ",".join(out)


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def group_failures(failures: Sequence[Failure]) -> list[list[Failure]]:
    """Failures grouped by (kind, message), in order of first appearance; no message: alone."""
    groups: dict[object, list[Failure]] = {}
    for i, f in enumerate(failures):
        key: object = (f.kind, f.message) if f.message else i
        groups.setdefault(key, []).append(f)
    return list(groups.values())


def summary_lines(failures: Sequence[Failure], attempt: int, job_id: str) -> list[str]:
    """The summary of a failed attempt; ``failures[0]`` is the root cause."""
    if not failures:
        return []
    lines: list[str] = []
    groups = group_failures(failures)
    for index, group in enumerate(groups):
        if index > MAX_OTHER_GROUPS:
            rest = [f.rank for g in groups[index:] for f in g if f.rank is not None]
            lines.append(f"also: rank(s) {rank_ranges(rest)} failed in other ways (see their output or logs)")
            break
        first = group[0]
        ranks = [f.rank for f in group if f.rank is not None]
        if len(group) > 1:
            prefix = "" if index == 0 else "also: "
            head = f"ranks {rank_ranges(ranks)} failed the same way (exit code {first.code}): {first.message}"
        else:
            prefix = "FAILED: " if index == 0 else "also: "
            head = f"{first.what} {first.how}" + (f": {first.message}" if first.message else "")
        lines.append(prefix + head)
        if first.hint:
            lines.append(f"  hint: {first.hint}")
        if first.kind == USER_INPUT:
            continue  # the message and the hint are the whole story; the traceback is in the log
        if index == 0:
            lines.append(
                f"  the first failure of attempt {attempt} (job {job_id}); all other workers were stopped"
            )
            if first.tail:
                who = f"rank {first.rank}" if first.rank is not None else "the agent"
                lines.append(f"  last {len(first.tail)} line(s) of {who}:")
                lines.extend(f"    {line}" for line in first.tail)
    return lines
