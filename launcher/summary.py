"""The failure summary the head prints after a failed attempt. Pure: failures in, lines out.

Failed ranks are grouped by their error file's (kind, message) (``launcher.errorfile``), not by exit
code: a rank that wrote its error and was then caught by the stop's SIGTERM while exiting (exit code 143
instead of 2) still failed the same way as its peers; a group shows its first rank's exit code. A group
of several ranks is one line, ``ranks 0-3,5 failed the same way (exit code 2): <message>``, then its
hint; a user-input error (kind ``user_input``) needs nothing more, any other failure also shows the last
lines of the group's first rank. A failure without a message (a signal, ``sys.exit(7)``, a worker that
could not start, a lost agent) keeps the per-rank form: rank, host, exit code or signal, last lines. The
root cause (the first failure) comes first.

Root cause and consequences: when one rank dies, its peers fail in their next collective ("Connection
closed by peer" from gloo, "remote process exited" from NCCL, a broken pipe, a collective's timeout...),
and on another node such a failure may reach the head before the real one. :func:`arrange_failures`
makes the first failure that is *not* a lost peer (:func:`lost_peer`) the root cause, whatever the order
of arrival; the ranks that only lost their peer are listed after it as its consequences, one line per
cause, never as failures of their own.

Size: the tail shown is capped in bytes as well as in lines (:func:`cap_tail`): a rank whose last output
is one huge line without a newline (the agent cuts such a line into 64 KiB pieces) shows the start and
the end of it, and says how much was cut. A message or hint is shown cut to ``MAX_MESSAGE_BYTES`` the
same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from launcher.errorfile import USER_INPUT

MAX_OTHER_GROUPS = 4  # after the root cause: at most this many other groups, then a count
MAX_TAIL_BYTES = 4096  # the whole tail of the root cause, as printed
MAX_TAIL_LINE_BYTES = 400  # one line of it: the first and the last half are kept
MAX_MESSAGE_BYTES = 1000  # an error file's message or hint as shown (the error file keeps 4096 chars)

# Substrings (lower case) of what a rank says when it failed only because a peer was gone, and the words
# the summary uses for it. Looked for in the error file's message, else in the rank's last lines.
_LOST_PEER = (
    ("connection closed by remote peer", "Connection closed by remote peer"),
    ("connection closed by peer", "Connection closed by peer"),
    ("connection reset by peer", "Connection reset by peer"),
    ("remote process exited", "remote process exited"),
    ("ncclremoteerror", "ncclRemoteError"),
    ("communicator was aborted", "communicator aborted"),
    ("broken pipe", "Broken pipe"),
    ("watchdog caught collective operation timeout", "collective timed out"),
    ("timed out waiting", "timed out waiting for a peer"),
    ("failed to recv, got 0 bytes", "rendezvous store connection lost"),
)

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


def lost_peer(failure: Failure) -> str | None:
    """Why a failure is only a consequence of a peer's ("gloo: Connection closed by peer"), or None."""
    text = failure.message or "\n".join(failure.tail[-5:])
    low = text.lower()
    for needle, words in _LOST_PEER:
        if needle in low:
            backend = "NCCL" if "nccl" in low else "gloo" if "gloo" in low else "torch.distributed"
            return f"{backend}: {words}"
    return None


def aborted_in_shutdown(failure: Failure) -> bool:
    """Whether a rank aborted as its interpreter shut down: SIGABRT with C++'s "terminate called without
    an active exception" (a native thread still running at exit) among its last lines."""
    return "SIGABRT" in failure.how and any(
        "terminate called without an active exception" in line for line in failure.tail[-5:]
    )


# torch's gloo process group aborts this way in about 1 exit of 3 when a script ends without destroying
# it (measured: two ranks ending in a barrier, torch 2.13); runtime.initialize's group is guarded already.
_SHUTDOWN_ABORT_HINT = (
    "the rank aborted while its interpreter shut down, after its script had returned: a native thread "
    "(with gloo, the process group's worker) was still running. End the script with "
    "torch.distributed.destroy_process_group() after a last barrier"
)


def arrange_failures(failures: Sequence[Failure]) -> list[Failure]:
    """Failures in order of arrival -> the root cause first (the first that is not a lost peer, else
    the first), then the others in order. A later failure without a message that did not lose its peer
    is left out: it is most likely the stop's own doing."""
    if not failures:
        return []
    root = next((f for f in failures if lost_peer(f) is None), failures[0])
    rest = [f for f in failures if f is not root and (f.message or lost_peer(f) is not None)]
    return [root, *rest]


def _cut_line(line: str, limit: int) -> tuple[str, int]:
    """A line cut to its first and last ``limit // 2`` bytes, and how many bytes were cut."""
    data = line.encode(errors="replace")
    if len(data) <= limit:
        return line, 0
    half = limit // 2
    head = data[:half].decode(errors="ignore")
    tail = data[-half:].decode(errors="ignore")
    cut = len(data) - 2 * half
    return f"{head} [... {cut} bytes cut ...] {tail}", cut


def cap_tail(
    tail: Sequence[str], max_bytes: int = MAX_TAIL_BYTES, max_line: int = MAX_TAIL_LINE_BYTES
) -> tuple[list[str], int]:
    """The last lines that fit ``max_bytes``, each cut to ``max_line``; and how many bytes were left out."""
    kept: list[str] = []
    used = cut = 0
    full = False  # the budget is spent: every earlier line is cut whole (the tail stays contiguous)
    for line in reversed(tail):
        short, line_cut = _cut_line(line, max_line)
        size = len(short.encode(errors="replace")) + 1
        full = full or used + size > max_bytes
        if full:
            cut += len(line.encode(errors="replace")) + 1
            continue
        used += size
        kept.append(short)
        cut += line_cut
    return kept[::-1], cut


def _consequence_lines(root: Failure, consequences: Sequence[Failure]) -> list[str]:
    """One line per cause: which ranks only lost their peer, and whose failure that followed."""
    by_reason: dict[str, list[Failure]] = {}
    for f in consequences:
        by_reason.setdefault(lost_peer(f) or "", []).append(f)
    root_lost = lost_peer(root) is not None
    cause = "" if root_lost else f" -- a consequence of {_who(root)}'s failure"
    lines = []
    for reason, group in by_reason.items():
        ranks = [f.rank for f in group if f.rank is not None]
        who = f"rank {ranks[0]}: lost its" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}: lost their"
        lines.append(f"{who} peer ({reason}){cause}")
    return lines


def leftovers_line(ended: Sequence[tuple[str, int, Sequence[str]]]) -> str | None:
    """One line for the processes the agents ended as left behind by the job: (host, count, commands)."""
    total = sum(count for _, count, _ in ended)
    if not total:
        return None
    noun = "process" if total == 1 else "processes"
    where = ", ".join(f"{count} on {host}" for host, count, _ in ended if count)
    commands = [_cut_line(c, 120)[0] for _, _, cs in ended for c in cs][:3]
    shown = "; ".join(commands) + ("; ..." if total > len(commands) else "")
    return f"ended {total} {noun} left behind by the job ({where}): {shown}"


def _who(failure: Failure) -> str:
    return f"rank {failure.rank}" if failure.rank is not None else failure.what


# A memory address in a message ("<function f at 0x7f3a...>") differs per process: ranks that failed the
# same way must still fold into one line.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def group_failures(failures: Sequence[Failure]) -> list[list[Failure]]:
    """Failures grouped by (kind, message), in order of first appearance, memory addresses in the message
    ignored; no message: alone."""
    groups: dict[object, list[Failure]] = {}
    for i, f in enumerate(failures):
        key: object = (f.kind, _ADDRESS.sub("", f.message)) if f.message else i
        groups.setdefault(key, []).append(f)
    return list(groups.values())


def summary_lines(
    failures: Sequence[Failure], attempt: int, job_id: str, *, finished: Sequence[int] = ()
) -> list[str]:
    """The summary of a failed attempt; ``failures[0]`` is the root cause (see :func:`arrange_failures`),
    later failures that only lost their peer are its consequences. ``finished``: the ranks that had
    exited with code 0 before the first failure (when every failure only lost a peer, they are the
    peer: a rank that ended while the others still ran collectives with it)."""
    if not failures:
        return []
    lines: list[str] = []
    root = failures[0]
    consequences = [f for f in failures[1:] if lost_peer(f) is not None and f.message != root.message]
    apart = {id(f) for f in consequences}
    groups = group_failures([f for f in failures if id(f) not in apart])
    for index, group in enumerate(groups):
        if index > MAX_OTHER_GROUPS:
            rest = [f.rank for g in groups[index:] for f in g if f.rank is not None]
            lines.append(f"also: rank(s) {rank_ranges(rest)} failed in other ways (see their output or logs)")
            break
        first = group[0]
        ranks = [f.rank for f in group if f.rank is not None]
        if len(group) > 1:
            prefix = "" if index == 0 else "also: "
            message = _cut_line(first.message, MAX_MESSAGE_BYTES)[0]
            head = f"ranks {rank_ranges(ranks)} failed the same way (exit code {first.code}): {message}"
        else:
            prefix = "FAILED: " if index == 0 else "also: "
            message = _cut_line(first.message, MAX_MESSAGE_BYTES)[0]
            head = f"{first.what} {first.how}" + (f": {message}" if message else "")
        lines.append(prefix + head)
        if first.hint:
            lines.append(f"  hint: {_cut_line(first.hint, MAX_MESSAGE_BYTES)[0]}")
        if first.kind == USER_INPUT:
            continue  # the message and the hint are the whole story; the traceback is in the log
        if index == 0:
            lines.append(
                f"  the first failure of attempt {attempt} (job {job_id}); all other workers were stopped"
            )
            if first.tail:
                who = f"rank {first.rank}" if first.rank is not None else "the agent"
                tail, cut = cap_tail(first.tail)
                more = f" ({cut} more bytes cut; the whole output is above and in --log_dir)" if cut else ""
                lines.append(f"  last {len(tail)} line(s) of {who}{more}:")
                lines.extend(f"    {line}" for line in tail)
            if aborted_in_shutdown(first):
                lines.append(f"  hint: {_SHUTDOWN_ABORT_HINT}")
    if consequences:
        lines.extend(_consequence_lines(root, consequences))
    if lost_peer(root) is not None and finished:
        ranks = sorted(set(finished))
        who = f"rank {ranks[0]} had" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} had"
        lines.append(
            f"  hint: {who} already exited with code 0 while the others still ran collectives with "
            f"{'it' if len(ranks) == 1 else 'them'}: every rank must reach the same collectives (a branch "
            "on the rank, an early return or sys.exit(0), more data on some ranks than on others?)"
        )
    elif lost_peer(root) is not None:
        lines.append(
            "  hint: no rank failed by itself, each lost a peer: the first to go was likely killed from "
            "outside (the OOM killer, a host or network going down); see dmesg and each host's logs"
        )
    return lines
