"""Durable, checksummed file writes: nothing becomes visible under its final name until it is on disk.

`DurableFile` writes to a hidden temporary name next to the target, counts bytes and a CRC-32 of what
it writes, and on `commit()` flushes, fsyncs, renames onto the final name and fsyncs the directory, so
after a crash a name either holds the complete file or does not exist. `file_crc32` re-reads a file to
check it against the recorded checksum.

`os_error_cause` turns the OSError of a refused write into words and a fix (ENOSPC, EROFS, EACCES/EPERM,
ENOTDIR/EEXIST, ...), so a save can fail with one line instead of a traceback.

`fault_point` is a test hook: with DSLAUNCH_CHECKPOINT_FAULT=<point> in the environment the process
stops at that point of a save (touching the file named by DSLAUNCH_CHECKPOINT_FAULT_MARKER, if set) and
sleeps until it is killed, so tests can SIGKILL a real process in the middle of writing a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

FAULT_ENV = "DSLAUNCH_CHECKPOINT_FAULT"
FAULT_MARKER_ENV = "DSLAUNCH_CHECKPOINT_FAULT_MARKER"
# in the order a save passes them (runtime.checkpoint.save and .commit say what each one follows)
FAULT_POINTS = ("start", "shard", "engine_state", "manifest", "commit", "swap", "latest", "cleanup")
_READ_CHUNK = 4 << 20


@dataclass(frozen=True)
class FileRecord:
    """What a finished file must look like on load."""

    name: str  # file name inside the tag directory (or the save directory for `latest`)
    size: int  # bytes
    crc32: int


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableFile:
    """A file written under a temporary name and renamed into place by `commit()`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file = open(self.tmp, "wb", buffering=0)  # noqa: SIM115 - closed in commit/abort
        self.size = 0
        self.crc32 = 0

    def write(self, data: Any) -> int:
        """Write a bytes-like object completely; returns its length."""
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        written = 0
        while written < len(view):
            written += self._file.write(view[written:])
        self.size += written
        return written

    def flush(self) -> None:
        """File-object protocol (torch.save calls it); writes are unbuffered already."""

    def commit(self) -> FileRecord:
        """fsync, rename onto the final name, fsync the directory."""
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return FileRecord(self.path.name, self.size, self.crc32)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()

    def __enter__(self) -> DurableFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


def write_text_durably(path: str | os.PathLike[str], text: str) -> FileRecord:
    with DurableFile(path) as out:
        out.write(text.encode("utf-8"))
        return out.commit()


def file_crc32(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(size, crc32) of a file's current contents."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


_FULL = (
    "free space there or pass another save_dir; overwriting a tag needs room for both copies until the new "
    "one is complete"
)
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the filesystem is full", _FULL),
    errno.EDQUOT: ("the disk quota is exceeded", _FULL),
    errno.EROFS: ("the filesystem is mounted read-only", "pass a save_dir on a writable filesystem"),
    errno.EACCES: (
        "permission denied",
        "make the folder writable for this user (chmod/chown), or pass another save_dir",
    ),
    errno.EPERM: (
        "operation not permitted",
        "an immutable or append-only folder? `lsattr -d` shows it, `chattr -i` lifts it; or pass another "
        "save_dir",
    ),
    errno.ENOTDIR: (
        "is a file, where a folder is needed",
        "remove or rename that file, or pass another save_dir",
    ),
    errno.EEXIST: (
        "is a file, where a folder is needed",
        "remove or rename that file, or pass another save_dir",
    ),
    errno.EISDIR: ("a folder stands where a file is needed", "remove or rename that folder"),
}


def os_error_cause(error: OSError) -> tuple[str, str]:
    """(what happened, with the errno's name; what to do) for an OSError raised by a checkpoint write."""
    name = errno.errorcode.get(error.errno or 0, "")
    fallback = (error.strerror or str(error), "check the folder named above")
    cause, hint = _CAUSES.get(error.errno or 0, fallback)
    text = f"{cause} ({name})" if name else cause
    if error.filename is None:
        return text, hint
    path = Path(os.fsdecode(error.filename))
    if error.errno in (errno.ENOTDIR, errno.EEXIST):  # name the file in the way, not the folder wanted
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        return f"{blocker} {text}", hint
    return f"{path}: {text}", hint


def fault_point(point: str) -> None:
    """Stop here forever when the test hook names this point (see the module docstring)."""
    if os.environ.get(FAULT_ENV) != point:
        return
    marker = os.environ.get(FAULT_MARKER_ENV)
    if marker:
        Path(marker).write_text(f"{os.getpid()} paused at {point}\n")
    while True:  # until the test kills us
        time.sleep(0.5)
