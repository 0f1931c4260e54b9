"""Checks of a hostfile's hosts, run from the head node: will each host run its share of the job?

For every host, in parallel: it answers over SSH, the interpreter exists there at the same absolute path,
torch and dslaunch have the same versions as here, it has at least as many GPUs as the hostfile gives it
slots, and its clock agrees with ours. One small Python program runs on each host and prints its facts as
JSON; everything is compared here.

This module does not know how SSH works: it takes a :data:`RunOnHost` function (``launcher.report.cli``
builds it from ``launcher.ssh.run``), so the same checks run over any transport.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from launcher.report.runner import CheckResult, Status, one_line_reason

SECTION = "hosts"
REMOTE_TIMEOUT_S = 60.0  # connect + a cold torch import on the host
CLOCK_SKEW_WARN_S = 2.0
_NO_PYTHON_RC = 102


class HostUnreachable(Exception):
    """The transport could not run the command on the host; ``str()`` is the cause and the fix, also
    kept apart (``cause``, ``fix``) so that hosts failing the same way can be shown as one."""

    def __init__(self, message: str, cause: str = "", fix: str = "") -> None:
        super().__init__(message)
        self.cause, self.fix = cause, fix


# (host, shell command, timeout seconds) -> (exit code, stdout, stderr). Raises HostUnreachable.
RunOnHost = Callable[[str, str, float], tuple[int, str, str]]


@dataclass(frozen=True)
class HostSpec:
    name: str
    slots: int


@dataclass(frozen=True)
class LocalFacts:
    """What every host is compared against: this machine."""

    python: str  # absolute interpreter path the hosts must have too
    python_version: str  # "3.11.7"
    torch: str | None  # None: torch does not import here (reported by the local checks)
    dslaunch: str
    gpus: int | None  # None: unknown here

    @classmethod
    def here(cls, python: str) -> LocalFacts:
        """Read without importing anything new: a hung torch import or driver must not hang this too."""
        import launcher
        from launcher.report.gpu import known_gpu_count

        torch = sys.modules.get("torch")
        torch_version = getattr(torch, "__version__", None)
        if torch_version is None:
            try:
                torch_version = importlib.metadata.version("torch")
            except importlib.metadata.PackageNotFoundError:
                torch_version = None
        return cls(
            python=python,
            python_version=platform.python_version(),
            torch=None if torch_version is None else str(torch_version),
            dslaunch=launcher.__version__,
            gpus=known_gpu_count(),
        )


# Runs on the host. Standard library only at the top; every import that can fail is reported, not raised.
# The time is taken last and the process exits at once, so the answer's arrival here lines up with it.
FACTS_PROGRAM = r"""
import json, os, socket, sys, time
facts = {"python": sys.version.split()[0], "executable": sys.executable, "hostname": socket.gethostname()}
try:
    import launcher
    facts["dslaunch"] = launcher.__version__
except Exception as e:
    facts["dslaunch_error"] = f"{type(e).__name__}: {e}"
try:
    import torch
    facts["torch"] = str(torch.__version__)
except Exception as e:
    facts["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import pynvml
    try:
        pynvml.nvmlInit()
        facts["gpus"] = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError_LibraryNotFound:
        facts["gpus"] = 0
except Exception as e:
    facts["gpus_error"] = f"{type(e).__name__}: {e}"
facts["time"] = time.time()
sys.stdout.write(json.dumps(facts) + "\n")
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown (a second with torch loaded) so the answer arrives now
"""


def facts_command(python: str) -> str:
    """The shell command run on each host; exits 102 when the interpreter is not there."""
    py = shlex.quote(python)
    program = shlex.quote(FACTS_PROGRAM)
    return f"command -v -- {py} >/dev/null 2>&1 || exit {_NO_PYTHON_RC}; exec {py} -c {program}"


def _result(host: str, name: str, status: Status, detail: str) -> CheckResult:
    return CheckResult(name=name, section=SECTION, status=status, detail=detail, host=host)


def _version_check(host: str, name: str, facts: dict[str, Any], ours: str | None) -> CheckResult:
    theirs = facts.get(name)
    if theirs is None:
        return _result(host, name, Status.FAIL, f"does not import there: {facts.get(name + '_error', '?')}")
    if ours is not None and theirs != ours:
        return _result(
            host, name, Status.FAIL, f"{name} {theirs} there but {ours} here: install the same version"
        )
    return _result(host, name, Status.OK, f"{name} {theirs}")


def _gpu_check(host: HostSpec, facts: dict[str, Any], local_gpus: int | None) -> CheckResult:
    gpus = facts.get("gpus")
    if gpus is None:
        return _result(
            host.name, "gpus", Status.WARNING, f"GPU count unknown: {facts.get('gpus_error', '?')}"
        )
    if gpus == 0:
        if local_gpus:
            return _result(
                host.name, "gpus", Status.WARNING, f"no GPU there (here: {local_gpus}): CPU + gloo"
            )
        return _result(host.name, "gpus", Status.OK, f"no GPU, {host.slots} CPU worker slot(s)")
    if gpus < host.slots:
        return _result(
            host.name, "gpus", Status.FAIL, f"{gpus} GPU(s) but the hostfile gives it slots={host.slots}"
        )
    spare = f" ({gpus - host.slots} unused)" if gpus > host.slots else ""
    return _result(host.name, "gpus", Status.OK, f"{gpus} GPU(s) for slots={host.slots}{spare}")


def _clock_check(host: str, remote_time: float, received: float) -> CheckResult:
    # The host stamps its time just before answering, so the gap is skew plus one-way latency.
    skew = remote_time - received
    detail = f"clock {skew:+.2f} s"
    if abs(skew) > CLOCK_SKEW_WARN_S:
        return _result(host, "clock", Status.WARNING, f"{detail} off: logs will not line up (run NTP/chrony)")
    return _result(host, "clock", Status.OK, detail)


@dataclass(frozen=True)
class HostAnswer:
    """What came back from one host, before comparing it with this machine."""

    host: HostSpec
    rc: int = -1
    out: str = ""
    err: str = ""
    seconds: float = 0.0
    received: float = 0.0  # time.time() here when the answer arrived
    unreachable: str | None = None  # why the command could not run at all
    cause: str = ""  # ... and its cause and fix apart (HostUnreachable's)
    fix: str = ""


def ask_host(host: HostSpec, run_on_host: RunOnHost, python: str) -> HostAnswer:
    """Run the facts program on one host; never raises."""
    started = time.perf_counter()
    try:
        rc, out, err = run_on_host(host.name, facts_command(python), REMOTE_TIMEOUT_S)
    except HostUnreachable as error:
        return HostAnswer(host, unreachable=str(error), cause=error.cause, fix=error.fix)
    except Exception as error:
        return HostAnswer(host, unreachable=one_line_reason(error))
    return HostAnswer(host, rc, out, err, time.perf_counter() - started, time.time())


def ask_hosts(
    hosts: Sequence[HostSpec], run_on_host: RunOnHost, python: str, max_parallel: int = 8
) -> list[HostAnswer]:
    """Ask every host in parallel (bounded: sshd drops bursts of more than 10 new connections)."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(hosts)))) as pool:
        return list(pool.map(lambda h: ask_host(h, run_on_host, python), hosts))


def _python_check(host: str, theirs: str, ours: str) -> CheckResult:
    if theirs.split(".")[:2] != ours.split(".")[:2]:
        # Pickled objects (object collectives, checkpoints' extra state) may not cross minor versions.
        return _result(host, "python", Status.WARNING, f"python {theirs} there but {ours} here")
    return _result(host, "python", Status.OK, f"python {theirs}")


def judge_host(answer: HostAnswer, local: LocalFacts) -> list[CheckResult]:
    """One host's checks from its answer; never raises."""
    name = answer.host.name
    if answer.unreachable is not None:
        failed = _result(name, "ssh", Status.FAIL, answer.unreachable)
        return [replace(failed, cause=answer.cause, fix=answer.fix)]
    reached = _result(name, "ssh", Status.OK, f"answered in {answer.seconds:.1f} s")
    if answer.rc == _NO_PYTHON_RC:
        missing = (
            f"no interpreter {local.python} there: install the same environment, or pass --remote_python"
        )
        return [reached, _result(name, "python", Status.FAIL, missing)]
    try:
        facts = json.loads(answer.out.strip().splitlines()[-1])
        return [
            reached,
            _python_check(name, facts["python"], local.python_version),
            _version_check(name, "torch", facts, local.torch),
            _version_check(name, "dslaunch", facts, local.dslaunch),
            _gpu_check(answer.host, facts, local.gpus),
            _clock_check(name, float(facts["time"]), answer.received),
        ]
    except (ValueError, IndexError, KeyError, TypeError):
        tail = (answer.err.strip().splitlines() or [answer.out.strip()[-200:] or "no output"])[-1]
        return [reached, _result(name, "python", Status.FAIL, f"{local.python} exited {answer.rc}: {tail}")]


def check_hosts(
    hosts: Sequence[HostSpec], run_on_host: RunOnHost, local: LocalFacts, max_parallel: int = 8
) -> list[CheckResult]:
    """Every check of every host, in hostfile order (``local.python`` is what runs there)."""
    answers = ask_hosts(hosts, run_on_host, local.python, max_parallel)
    return [result for answer in answers for result in judge_host(answer, local)]
