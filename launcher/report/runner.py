"""Running environment checks so that one broken part never hides the rest of the report.

A check is a small function that answers ``(Status, detail)``. The runner owns everything that can go wrong
around it: an exception becomes a FAIL carrying the exception's one-line reason, a check that does not
answer within its timeout (a hung driver, a wedged NFS mount) becomes a FAIL and is abandoned on a daemon
thread, and a check whose prerequisite failed is skipped instead of failing again with the same cause.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
_MAX_REASON_CHARS = 300


class Status(enum.Enum):
    """How a check came out. Only FAIL makes the report (and ``ds_report``'s exit status) fail."""

    OK = "OK"
    # Works, but something will likely cost the user time or performance.
    WARNING = "WARNING"
    # A job started here will not run, or will not run as configured.
    FAIL = "FAIL"
    # Not run: not applicable on this machine, or a check it depends on did not pass.
    SKIP = "SKIP"


# What a check function returns: one answer, or (for checks that enumerate things, like GPUs)
# one named answer per thing.
Outcome = tuple[Status, str]
NamedOutcome = tuple[str, Status, str]
CheckFn = Callable[[], Outcome | list[NamedOutcome]]

# Worst first; used to fold several answers into one.
_SEVERITY = {Status.FAIL: 3, Status.WARNING: 2, Status.SKIP: 1, Status.OK: 0}


def worst(statuses: Iterable[Status]) -> Status:
    return max(statuses, key=_SEVERITY.__getitem__, default=Status.OK)


@dataclass(frozen=True)
class Check:
    name: str
    section: str
    fn: CheckFn
    # Names of earlier checks that must not FAIL or SKIP for this one to be worth running.
    needs: tuple[str, ...] = ()
    # None: the runner's default. Importing torch cold from a network filesystem can take long.
    timeout_s: float | None = None


@dataclass(frozen=True)
class CheckResult:
    name: str
    section: str
    status: Status
    detail: str
    # None for this machine; the hostfile's host name for remote checks.
    host: str | None = None
    seconds: float = 0.0
    # A failure's cause in words that hosts failing the same way share ("connection refused"), and its
    # fix: the table shows such hosts as one row and one fix. Empty: the detail is the whole story.
    cause: str = ""
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "section": self.section,
            "status": self.status.value,
            "detail": self.detail,
            "host": self.host,
            "seconds": round(self.seconds, 3),
        }
        return out | ({"cause": self.cause, "fix": self.fix} if self.cause else {})


class CheckTimeout(Exception):
    pass


def one_line_reason(error: BaseException) -> str:
    """``TypeName: first line of the message``, short enough for one row of the report."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    if len(reason) > _MAX_REASON_CHARS:
        reason = reason[: _MAX_REASON_CHARS - 3] + "..."
    return reason


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, name: str = "check") -> Any:
    """Run ``fn`` on a daemon thread; raise its exception, or CheckTimeout if it has not returned in time.

    A thread cannot be killed, so a timed-out call keeps running in the background; being a daemon it
    never keeps the process alive.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # re-raised in the caller's thread, which decides
            box["error"] = error

    thread = threading.Thread(target=target, name=f"ds_report-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CheckTimeout(f"no answer after {timeout_s:g} s (hung driver or filesystem?); abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _normalise(check: Check, answer: Any) -> list[NamedOutcome]:
    """Accept ``(Status, str)`` or ``[(name, Status, str), ...]``; anything else is the check's bug."""
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], Status):
        return [(check.name, answer[0], str(answer[1]))]
    if (
        isinstance(answer, list)
        and answer
        and all(isinstance(item, tuple) and len(item) == 3 and isinstance(item[1], Status) for item in answer)
    ):
        return [(str(name), status, str(detail)) for name, status, detail in answer]
    raise TypeError(f"check returned {answer!r}, expected (Status, detail) or [(name, Status, detail)]")


def run_check(check: Check, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[CheckResult]:
    """Run one check; never raises (except KeyboardInterrupt in the calling thread)."""
    limit = check.timeout_s if check.timeout_s is not None else timeout_s
    start = time.perf_counter()
    try:
        answer = call_with_timeout(check.fn, limit, check.name)
        outcomes = _normalise(check, answer)
    except (Exception, SystemExit) as error:  # a library's sys.exit() must not end the report
        outcomes = [(check.name, Status.FAIL, one_line_reason(error))]
    seconds = time.perf_counter() - start
    return [
        CheckResult(name=name, section=check.section, status=status, detail=detail, seconds=seconds)
        for name, status, detail in outcomes
    ]


def run_checks(checks: Sequence[Check], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[CheckResult]:
    """Run checks in order (later checks reuse what earlier ones imported), honouring ``needs``."""
    results: list[CheckResult] = []
    outcome: dict[str, Status] = {}
    # Why a check was skipped, so that its dependents name the root cause ("needs torch FAIL"), not it.
    skipped_because: dict[str, str] = {}
    for check in checks:
        causes: list[str] = []
        for need in check.needs:
            status = outcome.get(need, Status.SKIP)
            if status is Status.FAIL or status is Status.SKIP:
                cause = skipped_because.get(need, f"needs {need} {status.value}")
                if cause not in causes:
                    causes.append(cause)
        if causes:
            skipped_because[check.name] = ", ".join(causes)
            check_results = [
                CheckResult(check.name, check.section, Status.SKIP, "skipped: " + ", ".join(causes))
            ]
        else:
            check_results = run_check(check, timeout_s)
        outcome[check.name] = worst(r.status for r in check_results)
        results.extend(check_results)
    return results


@dataclass(frozen=True)
class Report:
    """Everything one ``ds_report`` run found, local checks first, then remote hosts in hostfile order."""

    results: tuple[CheckResult, ...]
    hostname: str
    version: str
    seconds: float

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status is Status.FAIL)

    @property
    def ready(self) -> bool:
        return not self.failed

    def counts(self) -> dict[str, int]:
        return {s.value: sum(r.status is s for r in self.results) for s in Status}

    def to_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "hostname": self.hostname,
            "dslaunch_version": self.version,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "checks": [r.to_json() for r in self.results],
        }
