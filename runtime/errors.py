"""Errors in what the user gave us, and how an uncaught one ends a worker: one line, a hint, exit code 2.

`UserError` marks an error whose cause is the user's input (a config key, a data file, a damaged
checkpoint, the launcher's variables): the message says what is wrong and `hint` what to do, so a
traceback adds nothing for the user. The runtime's input errors (ConfigError, DataError, CheckpointError,
TensorFileError, DistEnvError, ...) derive from it and keep their older bases (ValueError, RuntimeError),
so ``except ValueError`` in user code still catches them.
`UnsupportedFeature` (a NotImplementedError) names a DeepSpeed feature dslaunch lacks and the nearest
alternative; any part may raise it (`runtime.deepspeed_api.unsupported` adds compat's stand-ins).

`import runtime` installs `excepthook`. For an uncaught exception it writes the worker's error file when
TORCHELASTIC_ERROR_FILE names one (torch's format, plus our "kind" and "hint", which dslaunch reads to
fold identical failures of many ranks into one line). For a UserError it then ends the process with exit
code 2 and prints, under dslaunch (DSLAUNCH_ERROR_FILE set: the launcher prints the summary), nothing;
elsewhere ``error: <message>`` and ``hint: <hint>`` on stderr, labelled with the rank when the job has
several. DSLAUNCH_TRACEBACK=1 adds the full traceback to the console; dslaunch's per-rank log files get it
from the error file. Any other exception gets Python's usual traceback.

A layer that raises inside a pipeline stage reaches the hook wrapped by torch.distributed.pipelining
(``RuntimeError: [Stage 1] failed to run forward: args: ...``); `root_cause` unwraps it, so the error file
names the user's own exception (``ValueError: bad shape in my layer (in pipeline stage 1, forward)``) and a
UserError raised there still ends with its one line and exit code 2.

torch's `init_process_group` labels this process's output with ``[rankN]:`` in two places: it wraps
`sys.excepthook` in a hook that starts every line of a traceback with it, and it hands the rank to c10's
C++ logger, which starts every warning and log line with it. Under dslaunch, whose agent already labels
each line ``[rank N]``, that doubled the label (``[rank 1] [rank1]: Traceback ...``); the wrapper would
also swallow a UserError's lines (it captures them and prints them only after the hook returns, which our
``SystemExit`` skips). `release_torch_rank_prefix` undoes both after the process group is created.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

USER_ERROR_EXIT_CODE = 2
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torch's name; dslaunch sets it, and torchrun does
DSLAUNCH_ERROR_FILE_ENV = "DSLAUNCH_ERROR_FILE"  # set by dslaunch: it prints the failure summary
DSLAUNCH_JOB_ENV = "DSLAUNCH_JOB_ID"  # set by dslaunch for every worker: its agent labels every line
TRACEBACK_ENV = "DSLAUNCH_TRACEBACK"

HookFn = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


class UserError(Exception):
    """An error in the user's input. The message says what is wrong; `hint` says what to do (may be "")."""

    hint: str = ""

    def __init__(self, *args: object, hint: str | None = None) -> None:
        super().__init__(*args)
        if hint is not None:
            self.hint = hint


class UnsupportedFeature(NotImplementedError):
    """A DeepSpeed feature that dslaunch does not implement. ``feature`` names it, ``alternative`` says
    what to use instead. (Any part may refuse such a feature, so the error sits here, at the bottom;
    `runtime.deepspeed_api.unsupported` keeps the name, with the stand-ins compat's modules use.)"""

    def __init__(self, feature: str, alternative: str) -> None:
        self.feature = feature
        self.alternative = alternative
        super().__init__(f"DeepSpeed's {feature} is not supported by dslaunch; {alternative}")


def unsupported(feature: str, alternative: str) -> NoReturn:
    raise UnsupportedFeature(feature, alternative)


def one_line(error: BaseException, *, with_type: bool = False) -> str:
    """The error's message on one line (a multi-line message joined with "; ")."""
    text = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if with_type:
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text or type(error).__name__


# torch.distributed.pipelining re-raises whatever a stage's layer raised as a RuntimeError of its own
# ("[Stage 1] failed to run forward: args: ...", "Failed to run stage backward ...") chained to the original
_PIPELINE_WRAPPER = re.compile(r"\s*(?:\[Stage (\d+)\]\s*)?failed to run (forward|stage backward)", re.I)


def root_cause(error: BaseException) -> tuple[BaseException, str]:
    """The exception the user's code raised behind torch's pipeline-stage wrappers, and where ("pipeline
    stage 1, forward"; "" when `error` is not such a wrapper). Other chains are the user's and stay."""
    where = ""
    while isinstance(error, RuntimeError) and error.__cause__ is not None:
        match = _PIPELINE_WRAPPER.match(str(error))
        if match is None:
            break
        if not where:
            stage = f"pipeline stage {match[1]}" if match[1] else "a pipeline stage"
            where = f"{stage}, {'forward' if match[2].lower() == 'forward' else 'backward'}"
        error = error.__cause__
    return error, where


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def error_record(error: BaseException, callstack: str) -> dict[str, Any]:
    """The error file's content: torch's layout (what torchelastic's `record` writes) plus kind and hint.
    The message is the root cause's (see `root_cause`), with where it happened; the callstack keeps the
    whole chain."""
    error, where = root_cause(error)
    user = isinstance(error, UserError)
    message = one_line(error, with_type=not user) + (f" (in {where})" if where else "")
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": callstack,
                "timestamp": str(int(time.time())),
                "kind": "user_input" if user else "exception",
                "hint": getattr(error, "hint", "") if user else "",
            },
        }
    }


def write_error_file(error: BaseException, callstack: str) -> None:
    """Write the record to TORCHELASTIC_ERROR_FILE, if set; never raises (the worker is failing already)."""
    path = os.environ.get(ERROR_FILE_ENV, "").strip()
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(error_record(error, callstack), out)
    except OSError as problem:
        print(f"runtime: cannot write the error file {path}: {problem}", file=sys.stderr, flush=True)


def _rank_label() -> str:
    """The label "[rank N] " when the job has several ranks and nothing else labels our lines, else ""."""
    if os.environ.get(DSLAUNCH_JOB_ENV):  # dslaunch's agent labels every line already
        return ""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
    return f"[rank {rank}] " if world.strip().isdigit() and int(world) > 1 else ""


def _labelled(write: Callable[[], None], label: str) -> str:
    """What `write` prints to sys.stderr, every line starting with `label`."""
    import io

    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        write()
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = saved
    return "".join(label + line if line.strip() else line for line in text.splitlines(keepends=True))


class ExceptHook:
    """`sys.excepthook` for runtime scripts: error file, then a UserError's line or the chained hook."""

    def __init__(self, chained: HookFn) -> None:
        self.chained = chained  # the hook that was installed before us (Python's own, usually)

    def __call__(self, etype: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        callstack = "".join(traceback.format_exception(etype, error, tb))
        write_error_file(error, callstack)
        label = _rank_label()
        root, where = root_cause(error)
        if isinstance(root, UserError):  # raised inside a pipeline stage: still the user's one line
            error = root
        if not isinstance(error, UserError):
            if label and not _is_torch_prefixer(self.chained):
                sys.stderr.write(_labelled(lambda: self.chained(etype, error, tb), label))
                sys.stderr.flush()
            else:
                self.chained(etype, error, tb)
            return
        lines = []
        if _flag(TRACEBACK_ENV):
            lines.append(callstack.rstrip("\n"))
        if not os.environ.get(DSLAUNCH_ERROR_FILE_ENV):
            lines.append(f"{label}error: {one_line(error)}" + (f" (in {where})" if where else ""))
            hint = getattr(error, "hint", "")
            if hint:
                lines.append(f"{label}hint: {hint}")
        # called by torch's wrapper (a group made without runtime.init_distributed): sys.stderr is its
        # buffer, which it would print only after we return, so write to the process's own stderr
        stream = sys.__stderr__ if _is_torch_prefixer(sys.excepthook) and sys.__stderr__ else sys.stderr
        if lines:
            stream.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        stream.flush()
        # SystemExit raised by the hook ends the interpreter normally (atexit handlers, flushed files)
        # with this code instead of the 1 of an uncaught exception.
        raise SystemExit(USER_ERROR_EXIT_CODE)


_installed: ExceptHook | None = None


def install_excepthook() -> ExceptHook:
    """Install the runtime's hook (once); it chains to the hook it replaces."""
    global _installed
    if _installed is None:
        _installed = ExceptHook(sys.excepthook)
        sys.excepthook = _installed
    return _installed


def _is_torch_prefixer(hook: Any) -> bool:
    return getattr(hook, "__name__", "") == "_distributed_excepthook" and str(
        getattr(hook, "__module__", "")
    ).startswith("torch.distributed")


def release_torch_rank_prefix() -> None:
    """Take off the ``[rankN]:`` labels that torch's init_process_group adds (see the module docstring).

    Under dslaunch both go (the agent labels lines). Elsewhere the C++ logger keeps its label, and the
    excepthook wrapper goes only when it wraps our hook, which labels with the rank itself (a UserError's
    lines included, which the wrapper would lose); a hook of the user's keeps torch's wrapper.
    """
    under_dslaunch = bool(os.environ.get(DSLAUNCH_JOB_ENV))
    if under_dslaunch:
        c10d = getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)
        set_global_rank = getattr(c10d, "_set_global_rank", None)
        if set_global_rank is not None:
            set_global_rank(-1)  # the C++ logger's label; it is used for nothing else
    hook = sys.excepthook
    if not _is_torch_prefixer(hook):
        return
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=False))
    inner = cells.get("old_hook")
    if inner is None:
        return  # a torch that builds the wrapper differently: leave it
    wrapped = inner.cell_contents
    if under_dslaunch or wrapped is _installed:
        sys.excepthook = wrapped
