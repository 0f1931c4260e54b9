"""The sshd testbed itself (tests/support/sshd_testbed.py): hosts are distinct, listable, and stop without
leftovers;
without namespaces it falls back to plain mode and says so."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from tests.support import sshd_testbed
from tests.support.sshd_testbed import find_processes

pytestmark = pytest.mark.ssh


@pytest.fixture(autouse=True)
def _needs_sshd() -> None:
    reason = sshd_testbed.unavailable_reason()
    if reason:
        pytest.skip(reason)


def _listening(address: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((address, port)) == 0


def test_hosts_are_separate_and_stopping_one_ends_everything_on_it(tmp_path: Path) -> None:
    tb = sshd_testbed.start(tmp_path / "tb", n_hosts=2)
    try:
        if not tb.isolated:
            pytest.skip(f"no namespaces on this machine: {tb.notice}")
        assert [tb.run(h, "hostname").stdout.strip() for h in tb.names] == ["worker1", "worker2"]
        # A double-forked orphan (setsid) still belongs to its host and dies with it.
        pid = tb.spawn_detached("worker2", ["sleep", "600"])
        assert pid in [p.pid for p in tb.processes("worker2")]
        assert pid not in [p.pid for p in tb.processes("worker1")]
        w2 = tb.host("worker2")
        tb.stop_host("worker2")
        assert not Path(f"/proc/{pid}").exists() or not Path(f"/proc/{pid}/cmdline").read_bytes()
        assert not _listening(w2.address, w2.port)
        assert tb.run("worker1", "true").returncode == 0  # the other host is untouched
    finally:
        tb.stop()
    assert find_processes(str(tb.dir)) == []


def test_without_namespaces_it_falls_back_to_plain_mode_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    fake = fake_bin / "unshare"
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    tb = sshd_testbed.start(tmp_path / "tb", n_hosts=1)
    try:
        assert not tb.isolated
        assert "namespaces unavailable" in tb.notice and "Operation not permitted" in tb.notice
        assert tb.run("worker1", "hostname").stdout.strip() == socket.gethostname()
    finally:
        tb.stop()
    assert find_processes(str(tb.dir)) == []
