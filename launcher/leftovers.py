"""Processes a job leaves behind: the node agent adopts them and ends them with the job.

A worker's process group is not all a job starts. A daemon made with ``setsid``, a double fork or
``Popen(start_new_session=True)`` leaves the group, and once its parent exits it is re-parented to the
machine's init: stopping the worker groups never reaches it, and on a GPU host it keeps its memory.
Two things bring such processes back:

* **subreaper.** The agent marks itself ``PR_SET_CHILD_SUBREAPER`` (Linux, through ``prctl``), so an
  orphan below it is re-parented to the agent, not to init: every process the job ever started stays a
  descendant of the agent for as long as it lives. The agent reaps the adopted ones that exit
  (:meth:`Leftovers.reap`), never a worker (``subprocess`` reaps those).
* **the tree.** What is below the agent is the job. :meth:`Leftovers.signal` sends a signal to each
  descendant that stopping the worker groups does not reach: outside every running worker's process
  group (escaped while its worker still runs), or in the group of a worker that already exited (it
  outlived its worker). It is called with the workers' SIGTERM and with their SIGKILL, so these processes
  get the same grace period. Those it signalled are the job's leftovers, counted for the summary.

The tree comes from ``/proc/<pid>/stat`` (parent, process group, state), read when the agent stops or
its workers are all gone, never in the steady loop. Elsewhere than Linux (no ``prctl``, no ``/proc``)
both are skipped and only the worker groups are stopped.

Imports only the standard library (``ctypes`` only when becoming a subreaper): the agent imports this
module on every node.
"""

from __future__ import annotations

import contextlib
import os

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
MAX_COMMANDS = 3  # command lines kept for the summary, beyond that only the count


def become_subreaper() -> bool:
    """Make orphans below this process its children (Linux); False where the kernel cannot."""
    if not os.path.isdir("/proc/self"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: str) -> tuple[int, int, str] | None:
    """(parent pid, process group, state) of one process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields we want follow the last ")".
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 3:
        return None
    return int(fields[1]), int(fields[2]), fields[0].decode()


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every live process below ``root`` (any depth): pid -> (process group, state). Zombies excluded."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[int, str]] = {}
    for entry in entries:
        st = _stat(entry)
        if st is not None:
            pid = int(entry)
            children.setdefault(st[0], []).append(pid)
            info[pid] = (st[1], st[2])
    found: dict[int, tuple[int, str]] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in found or pid not in info:
            continue
        if info[pid][1] != "Z":
            found[pid] = info[pid]
        todo.extend(children.get(pid, ()))
    return found


def command_line(pid: int) -> str:
    """A process's command line as one string ("" when it is gone or has none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    # One line, whatever the arguments hold (``python -c`` with a script of several lines).
    return " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())


class Leftovers:
    """The agent's side of processes that are not workers: reap the adopted, end the left behind."""

    __slots__ = ("commands", "ended", "root", "subreaper")

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.subreaper = False
        self.ended: set[int] = set()  # every pid signalled as a leftover
        self.commands: list[str] = []  # the first few of their command lines

    def adopt_orphans(self) -> None:
        """Become the subreaper of everything the workers start (call before starting them)."""
        self.subreaper = become_subreaper()

    def reap(self, worker_pids: set[int]) -> None:
        """Collect adopted children that exited; leave the workers' exits to ``subprocess``."""
        if not self.subreaper:
            return
        while True:
            try:  # WNOWAIT: look without reaping, so that a worker's status stays for its Popen
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None or info.si_pid in worker_pids:
                return  # nothing waitable, or a worker first: its Popen reaps it, the rest next time
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.si_pid, os.WNOHANG)

    def signal(self, sig: int, worker_pids: set[int], running_groups: set[int]) -> int:
        """Send ``sig`` to every descendant the worker groups' signal does not cover; how many there
        are. ``running_groups``: process groups of workers still running. ``sig`` 0 only counts."""
        alive = 0
        for pid, (pgid, _state) in descendants(self.root).items():
            if pid in worker_pids or pgid in running_groups:
                continue
            if sig:
                if pid not in self.ended:
                    self.ended.add(pid)
                    if len(self.commands) < MAX_COMMANDS:
                        self.commands.append(command_line(pid))
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    continue
            alive += 1
        return alive
