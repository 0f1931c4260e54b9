"""What the node agent (launcher.agent) keeps of each worker process, and the two small helpers its loop
uses on them: a Popen return code as a shell exit code, and a whole write to a file descriptor.

Imports only the standard library and launcher.errorfile: the agent imports this on every node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from launcher.errorfile import WorkerError

# `typing` would cost the agent ~10 ms at start; type checkers take this name as True and see the import
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO

__all__ = ["Worker", "exit_code_of", "write_all"]


def exit_code_of(returncode: int) -> tuple[int, str | None]:
    """Popen returncode -> (shell-style exit code, signal name or None)."""
    if returncode >= 0:
        return returncode, None
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return 128 + signum, name


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd`, however many writes a pipe or a non-blocking stdout takes."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # an inherited non-blocking stdout: wait a little and retry
            time.sleep(0.001)
            continue
        view = view[n:]


class Worker:
    """One worker process as the agent tracks it: its ranks, output pipe and partial line, log file,
    and the error file it left."""

    __slots__ = (
        "error",
        "error_path",
        "exited",
        "fd",
        "local_rank",
        "log",
        "partial",
        "pid",
        "prefix",
        "proc",
        "rank",
    )

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.prefix = b"%d:" % rank
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.fd = -1
        self.partial = b""
        self.log: IO[bytes] | None = None
        self.exited = False
        self.error_path = ""
        self.error: WorkerError | None = None  # what its error file held, once it exited non-zero

    def pipe(self) -> IO[bytes]:
        """The read end of the worker's output (every worker starts with stdout=PIPE)."""
        if self.proc is None or self.proc.stdout is None:
            raise RuntimeError(f"rank {self.rank} has no output pipe")
        return self.proc.stdout
