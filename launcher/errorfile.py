"""The worker error file: how a worker that dies of an exception tells the launcher what happened.

The node agent gives every worker a fresh path in a private directory of its node, under two names:
``DSLAUNCH_ERROR_FILE`` (ours) and ``TORCHELASTIC_ERROR_FILE`` (torch's, so a script decorated with
``torch.distributed.elastic.multiprocessing.errors.record`` reports through it too). The runtime's
exception hook writes it in torch's format, plus two fields of ours (``kind``, ``hint``)::

    {"message": {"message": "<one line>",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<unix s>",
                               "kind": "user_input" | "exception", "hint": "<hint>"}}}

When the worker exits non-zero the agent reads the file with ``read_error_file``, which tolerates a
missing, empty or malformed file (the failure is then reported as before: exit code and last lines).
The private directory (``make_error_dir``) and the block a failed worker's traceback adds to its log
(``traceback_block``) live here too. Imports only the standard library: the node agent imports this
module on every node.
"""

from __future__ import annotations

import json
import os

ERROR_FILE_VARS = ("DSLAUNCH_ERROR_FILE", "TORCHELASTIC_ERROR_FILE")
USER_INPUT = "user_input"  # the kind of an error in the user's input: one line and a hint, no traceback
MAX_MESSAGE = 4096  # a message is meant to be one line; keep a runaway one from flooding the summary
# The traceback travels to the head inside one protocol line; stay within what every transport (pdsh,
# mpirun) already carries for worker output (launcher.agent.MAX_LINE, 64 KiB). The end is what matters.
MAX_TRACEBACK = 60 * 1024


class WorkerError:
    """What one worker's error file says (not a dataclass: importing ``dataclasses`` costs the agent 9 ms)."""

    __slots__ = ("hint", "kind", "message", "traceback")

    def __init__(self, message: str, hint: str = "", kind: str = "exception", traceback: str = "") -> None:
        self.message = message  # one line
        self.hint = hint
        self.kind = kind
        self.traceback = traceback

    def __eq__(self, other: object) -> bool:
        fields = self.__slots__
        return isinstance(other, WorkerError) and all(getattr(self, k) == getattr(other, k) for k in fields)

    def __repr__(self) -> str:
        return f"WorkerError({self.message!r}, hint={self.hint!r}, kind={self.kind!r})"


def error_file_env(path: str) -> dict[str, str]:
    """The variables that point a worker at its error file."""
    return dict.fromkeys(ERROR_FILE_VARS, path)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def parse_error_file(data: bytes) -> WorkerError | None:
    """The error in a file's bytes, or None when they hold no usable message."""
    try:
        doc = json.loads(data.decode("utf-8", errors="replace"))
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    body = doc.get("message")
    if isinstance(body, str):  # torch writes a bare string for some failures
        body = {"message": body}
    if not isinstance(body, dict):
        return None
    message = _text(body.get("message")).strip()
    if not message:
        return None
    extra = body.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    # One line: the summary folds ranks by message, and a traceback belongs in the log, not here.
    first_line = message.splitlines()[0][:MAX_MESSAGE]
    return WorkerError(
        message=first_line,
        hint=_text(extra.get("hint")).strip()[:MAX_MESSAGE],  # a hint too is one line, not a flood
        kind=_text(extra.get("kind")) or "exception",
        traceback=_tail(_text(extra.get("py_callstack"))),
    )


def _tail(traceback: str) -> str:
    if len(traceback) <= MAX_TRACEBACK:
        return traceback
    return f"[... {len(traceback) - MAX_TRACEBACK} characters cut ...]\n" + traceback[-MAX_TRACEBACK:]


def read_error_file(path: str) -> WorkerError | None:
    """The error a worker left at ``path``; None when there is none or it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(16 * MAX_TRACEBACK)
    except OSError:
        return None
    return parse_error_file(data)


def make_error_dir() -> str | None:
    """A fresh directory only this user can read, for the workers' error files (None if none can be made)."""
    base = os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, f"dslaunch-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(path, 0o700)
    except OSError:
        return None
    return path


def traceback_block(traceback: str) -> bytes:
    """How a worker's traceback from its error file is appended to its log file."""
    body = traceback if traceback.endswith("\n") else traceback + "\n"
    return b"--- dslaunch: traceback from the worker's error file ---\n" + body.encode(errors="replace")
