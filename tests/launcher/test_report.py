"""ds_report: the real command on this machine (JSON, table, colour, exit codes), the check runner's
handling of raising and hung checks, a broken torch install, and hostfile checks against real sshd hosts."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher import __version__
from launcher.report import Check, CheckResult, Report, Status, run_checks
from launcher.report.remote import HostAnswer, HostSpec, LocalFacts, judge_host
from launcher.report.render import render_table, use_colour
from tests.support.sshd_testbed import Testbed

REPORT_TIMEOUT_S = 120
STATUSES = {s.value for s in Status}
# Present on every machine; a GPU machine has gpu0, gpu1, ... instead of "gpus".
EXPECTED = {
    "python", "torch", "dslaunch", "paramiko", "deepspeed", "driver", "cuda", "backends", "cpu", "memory",
    "shm", "hostname", "env", "pinned_memory", "cpu_adamw_fused", "fp16", "bf16", "gloo", "ssh", "pdsh",
    "mpirun", "srun",
}  # fmt: skip
HOST_CHECKS = ["ssh", "python", "torch", "dslaunch", "gpus", "clock"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ds_report() -> list[str]:
    """The installed console script next to this interpreter, as users run it."""
    script = Path(sys.executable).parent / "ds_report"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from launcher.report import main; main()"]


def run_report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | (env or {})
    return subprocess.run(
        [*_ds_report(), *args],
        capture_output=True,
        text=True,
        timeout=REPORT_TIMEOUT_S,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )


def by_name(report: dict, host: str | None = None) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"] if c["host"] == host}


# --- this machine ------------------------------------------------------------------------------------


def test_json_report_has_every_check_and_no_fail_on_a_healthy_machine() -> None:
    begin = time.perf_counter()
    proc = run_report("--json")
    wall = time.perf_counter() - begin
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    checks = by_name(report)
    missing = EXPECTED - set(checks)
    assert not missing, f"checks missing from the report: {missing}"
    assert "gpus" in checks or "gpu0" in checks
    for check in report["checks"]:
        assert set(check) >= {"name", "section", "status", "detail", "host"}
        assert check["status"] in STATUSES and check["detail"], check
    assert report["ready"] is True and report["counts"]["FAIL"] == 0
    assert [c for c in report["checks"] if c["status"] == "FAIL"] == []
    # The facts a bug report needs, about this very interpreter.
    import torch

    assert sys.executable in checks["python"]["detail"]
    assert str(torch.__version__) in checks["torch"]["detail"]
    assert checks["dslaunch"]["detail"].startswith(__version__)
    assert checks["gloo"]["status"] == "OK"
    assert checks["cpu_adamw_fused"]["status"] == "OK"
    if not torch.cuda.is_available():
        # A CPU machine is a supported place to run, not a broken GPU machine.
        assert checks["gpus"] == checks["gpus"] | {
            "status": "OK",
            "detail": "no GPU: workers will use CPU + gloo",
        }
        assert checks["pinned_memory"]["status"] == "SKIP"
        assert "not applicable" in checks["pinned_memory"]["detail"]
    # ~3 s on an idle 2-core machine; generous here because other tests may share the cores.
    assert wall < 20, f"ds_report took {wall:.1f} s"


def test_table_is_aligned_plain_when_piped_and_ends_with_the_verdict() -> None:
    proc = run_report()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "\x1b[" not in out, "colour codes in piped output"
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SECTION"))
    status_col, detail_col = lines[header].index("STATUS"), lines[header].index("DETAIL")
    rows = lines[header + 1 : lines.index("", header)]
    assert len(rows) >= len(EXPECTED)
    for row in rows:
        status = row[status_col:detail_col].strip()
        assert status in STATUSES, f"status column misaligned in {row!r}"
        assert row[detail_col - 1] == " " and row[detail_col] != " ", f"detail column misaligned in {row!r}"
    assert lines[-1].startswith("READY: no check failed")
    assert lines[0].startswith(f"dslaunch {__version__} environment report for ")


def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        _ds_report(),
        stdout=follower,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "NO_COLOR"},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=REPORT_TIMEOUT_S) == 0
    coloured = b"".join(chunks).decode()
    assert "\x1b[32mOK\x1b[0m" in coloured
    assert "READY: no check failed" in ANSI.sub("", coloured)

    # The same decision for a terminal with NO_COLOR set (https://no-color.org), and for a pipe.
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.delenv("NO_COLOR", raising=False)
        assert use_colour(terminal)
        monkeypatch.setenv("NO_COLOR", "1")
        assert not use_colour(terminal)
    os.close(leader)
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.delenv("NO_COLOR")
        assert not use_colour(pipe)
    os.close(read_end)


def test_broken_torch_is_a_fail_with_its_reason_not_a_traceback(tmp_path: Path) -> None:
    # Broken installs, shadowing the real packages: torch's shared library is missing, and so is NVML's
    # Python binding.
    for package, error in [
        ("torch", "libtorch_cpu.so: cannot open shared object file (simulated)"),
        ("pynvml", "No module named 'pynvml' (simulated)"),
    ]:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError({error!r})\n")
    proc = run_report("--json", env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    report = json.loads(proc.stdout)
    checks = by_name(report)
    assert checks["torch"]["status"] == "FAIL"
    assert (
        checks["torch"]["detail"]
        == "ImportError: libtorch_cpu.so: cannot open shared object file (simulated)"
    )
    # Everything that needs torch says so once instead of failing again; the rest still reports.
    for name in ("cuda", "backends", "cpu_adamw_fused", "fp16", "bf16", "gloo"):
        assert checks[name]["status"] == "SKIP", checks[name]
    assert checks["cuda"]["detail"] == "skipped: needs torch FAIL"
    assert checks["gloo"]["detail"] == "skipped: needs torch FAIL"  # the root cause, not "needs backends"
    for name in ("python", "dslaunch", "cpu", "memory", "shm"):
        assert checks[name]["status"] == "OK", checks[name]
    # Without NVML nobody can say whether there are GPUs: a warning, not "no GPU".
    assert (
        checks["driver"]["status"] == "WARNING"
        and "nvidia-ml-py does not import" in checks["driver"]["detail"]
    )
    assert checks["gpus"]["status"] == "SKIP"
    assert report["ready"] is False and report["counts"]["FAIL"] == 1

    table = run_report(env={"PYTHONPATH": str(tmp_path)})
    assert table.returncode == 1
    assert table.stdout.splitlines()[-1].startswith("NOT READY: 1 check(s) failed: torch")


def test_bad_usage_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    missing = run_report("--hostfile", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert f"{tmp_path / 'nope'}: cannot read the hostfile (No such file or directory)" in missing.stderr
    bad = tmp_path / "hostfile"
    bad.write_text("worker-0 slots=8\nworker-1 slots=four\n")
    malformed = run_report("--hostfile", str(bad))
    assert malformed.returncode == 2
    assert f"{bad}:2: slots must be a non-negative integer" in malformed.stderr
    assert run_report("--timeout", "-1").returncode == 2
    for proc in (missing, malformed):
        assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_many_hosts_failing_the_same_way_are_one_row_and_one_fix(tmp_path: Path) -> None:
    # 12 names that never resolve (RFC 6761's .invalid), through the real SSH code: one row per cause as
    # the launcher's preflight prints them. It used to print 12 rows with the same fix each, and a verdict
    # naming all 12.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"node{i}.invalid slots=1\n" for i in range(12)))
    proc = run_report("--hostfile", str(hostfile), env={"NO_COLOR": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    hosts = proc.stdout[proc.stdout.index("\nhosts ") + 1 :].splitlines()
    assert re.fullmatch(
        r"hosts +12 hosts +FAIL +ssh: node0\.invalid, node1\.invalid, node2\.invalid \.\.\. and 9 more: "
        r"host name does not resolve \(e\.g\. 'node0\.invalid': .*\)",
        hosts[0],
    ), hosts[0]
    assert re.fullmatch(r" +fix: fix the name in the hostfile, .*", hosts[1]), hosts[1]
    assert hosts[3].startswith(
        "NOT READY: 12 check(s) failed: node0.invalid:ssh, node1.invalid:ssh, node2.invalid:ssh ... and 9 "
        "more (see FAIL rows)"
    )


# --- the check runner (in process) ---------------------------------------------------------------------


def test_a_raising_check_is_a_fail_with_its_one_line_reason() -> None:
    def disk_on_fire() -> tuple[Status, str]:
        raise OSError("disk on fire\nsecond line nobody needs")

    def wrong_answer() -> tuple[Status, str]:
        return "fine"  # type: ignore[return-value]

    results = run_checks(
        [
            Check("ok", "t", lambda: (Status.OK, "fine")),
            Check("boom", "t", disk_on_fire),
            Check("after_boom", "t", lambda: (Status.OK, "never runs"), needs=("boom",)),
            Check("garbage", "t", wrong_answer),
            Check("exit", "t", lambda: sys.exit(3)),
        ]
    )
    status = {r.name: (r.status, r.detail) for r in results}
    assert status["ok"] == (Status.OK, "fine")
    assert status["boom"] == (Status.FAIL, "OSError: disk on fire")
    assert status["after_boom"] == (Status.SKIP, "skipped: needs boom FAIL")
    assert status["garbage"][0] is Status.FAIL and "expected (Status, detail)" in status["garbage"][1]
    assert status["exit"] == (Status.FAIL, "SystemExit: 3")
    report = Report(tuple(results), "here", __version__, 0.0)
    assert not report.ready and [r.name for r in report.failed] == ["boom", "garbage", "exit"]
    table = render_table(report)
    assert "OSError: disk on fire" in table and "second line" not in table
    assert table.splitlines()[-1].startswith("NOT READY: 3 check(s) failed: boom, garbage, exit")


def test_a_hung_check_times_out_and_the_report_goes_on() -> None:
    release = threading.Event()
    begin = time.perf_counter()
    try:
        results = run_checks(
            [
                Check("hung_driver", "t", lambda: release.wait(60) and (Status.OK, "late"), timeout_s=0.3),
                Check("uses_driver", "t", lambda: (Status.OK, "never runs"), needs=("hung_driver",)),
                Check("next", "t", lambda: (Status.OK, "still checked")),
            ]
        )
    finally:
        release.set()
    assert time.perf_counter() - begin < 5
    hung, uses, nxt = results
    assert hung.status is Status.FAIL and hung.detail.startswith("CheckTimeout: no answer after 0.3 s")
    assert uses.status is Status.SKIP
    assert (nxt.status, nxt.detail) == (Status.OK, "still checked")


# --- comparing a host's answer with this machine (pure) --------------------------------------------------


def _answer(slots: int, **facts: object) -> HostAnswer:
    base = {"python": "3.11.7", "torch": "2.13.0", "dslaunch": __version__, "gpus": 8, "time": 1000.0}
    return HostAnswer(HostSpec("node7", slots), 0, json.dumps(base | facts) + "\n", "", 0.5, 1000.0)


def test_host_answers_are_judged_against_this_machine() -> None:
    here = LocalFacts(
        "/venv/bin/python", python_version="3.11.2", torch="2.13.0", dslaunch=__version__, gpus=8
    )

    def statuses(answer: HostAnswer) -> dict[str, tuple[str, str]]:
        return {r.name: (r.status.value, r.detail) for r in judge_host(answer, here)}

    good = statuses(_answer(8))
    assert [name for name in good] == HOST_CHECKS
    assert all(status == "OK" for status, _ in good.values())
    assert statuses(_answer(16))["gpus"] == ("FAIL", "8 GPU(s) but the hostfile gives it slots=16")
    assert statuses(_answer(4))["gpus"] == ("OK", "8 GPU(s) for slots=4 (4 unused)")
    assert statuses(_answer(8, torch="2.12.1"))["torch"] == (
        "FAIL",
        "torch 2.12.1 there but 2.13.0 here: install the same version",
    )
    no_torch = statuses(_answer(8, torch=None, torch_error="ModuleNotFoundError: No module named 'torch'"))
    assert no_torch["torch"] == (
        "FAIL",
        "does not import there: ModuleNotFoundError: No module named 'torch'",
    )
    assert statuses(_answer(8, time=1030.0))["clock"] == (
        "WARNING",
        "clock +30.00 s off: logs will not line up (run NTP/chrony)",
    )
    assert statuses(_answer(8, python="3.10.12"))["python"] == (
        "WARNING",
        "python 3.10.12 there but 3.11.2 here",
    )
    garbled = HostAnswer(HostSpec("node7", 8), 1, "", "Segmentation fault\n", 0.5, 1000.0)
    assert statuses(garbled)["python"] == ("FAIL", "/venv/bin/python exited 1: Segmentation fault")


# --- hostfile hosts over real SSH ----------------------------------------------------------------------


@pytest.mark.ssh
def test_every_reachable_matching_host_is_ok(sshd_hosts: Testbed) -> None:
    proc = run_report(
        "--json", "--hostfile", str(sshd_hosts.hostfile), "--ssh_config", str(sshd_hosts.ssh_config)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    remote = [c for c in report["checks"] if c["host"] is not None]
    assert [c["host"] for c in remote] == [h for h in sshd_hosts.names for _ in HOST_CHECKS]
    for host in sshd_hosts.names:
        checks = by_name(report, host)
        assert list(checks) == HOST_CHECKS
        assert all(c["status"] == "OK" and c["section"] == "hosts" for c in checks.values()), checks
        assert checks["dslaunch"]["detail"] == f"dslaunch {__version__}"
        # Same machine, same clock: the skew estimate must be close to zero.
        assert abs(float(checks["clock"]["detail"].split()[1])) < 1.0


@pytest.mark.ssh
def test_stopped_host_and_version_mismatch_fail_with_their_reasons(
    sshd_testbed_factory, tmp_path: Path
) -> None:
    tb = sshd_testbed_factory(3, 2)
    tb.stop_host("worker2")
    # worker3 has another dslaunch: an older install shadows ours there (chosen by the address the SSH
    # connection landed on, which differs per host even when all hosts share this filesystem).
    old = tmp_path / "old" / "launcher"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "0.0.9"\n')
    python = tmp_path / "python"
    address = tb.host("worker3").address
    python.write_text(
        "#!/bin/sh\n"
        f'case "$SSH_CONNECTION" in *" {address} "*) export PYTHONPATH={old.parent};; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    args = [
        "--hostfile",
        str(tb.hostfile),
        "--ssh_config",
        str(tb.ssh_config),
        "--remote_python",
        str(python),
    ]

    proc = run_report("--json", *args)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert all(c["status"] == "OK" for c in by_name(report, "worker1").values())
    down = by_name(report, "worker2")
    assert list(down) == ["ssh"] and down["ssh"]["status"] == "FAIL"
    assert down["ssh"]["detail"].startswith(
        f"connection refused: nothing listens on {tb.host('worker2').address}"
    )
    mismatch = by_name(report, "worker3")
    assert mismatch["dslaunch"]["status"] == "FAIL"
    assert (
        mismatch["dslaunch"]["detail"]
        == f"dslaunch 0.0.9 there but {__version__} here: install the same version"
    )
    assert mismatch["torch"]["status"] == "OK"

    # The table folds each host into one row: worst status, and the reasons when it is not OK.
    results = [
        CheckResult(c["name"], c["section"], Status(c["status"]), c["detail"], c["host"])
        for c in report["checks"]
    ]
    lines = render_table(Report(tuple(results), report["hostname"], __version__, 1.0)).splitlines()
    host_rows = {}
    for line in lines[-5:-2]:
        words = line.split()
        host_rows[words[1] if words[0] == "hosts" else words[0]] = line
    assert " OK " in host_rows["worker1"] and "dslaunch" in host_rows["worker1"]
    assert " FAIL " in host_rows["worker2"] and "ssh: connection refused" in host_rows["worker2"]
    assert " FAIL " in host_rows["worker3"] and "dslaunch: dslaunch 0.0.9 there" in host_rows["worker3"]
    assert "torch" not in host_rows["worker3"], "an OK check cluttering a failing host's row"
    assert lines[-1].startswith("NOT READY: 2 check(s) failed: worker2:ssh, worker3:dslaunch")
