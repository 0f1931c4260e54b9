"""known_hosts read once per launch with exact errors, and paramiko imported without invoke (launch speed).

Corrupt lines used to end as ``connection lost: UnicodeDecodeError ...``; now every bad line names its
file, number and the way to fix it. The real-sshd test checks the whole path a user meets.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import known_hosts, ssh
from launcher.preflight import PreflightError, RemoteCheck, preflight
from tests.support.sshd_testbed import Testbed

KEY = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SUgl7VUKdoGOXqyy6TDbBldvKy7MbkTT"  # a valid ed25519 key
GOOD = f"[10.0.0.1]:2222 ssh-ed25519 {KEY}\n"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"[10.0.0.2]:22 ssh-ed25519 " + KEY[:-5].encode(), "the key is not valid base64 (cut short?)"),
        (b"[10.0.0.2]:22 ssh-ed25519 " + KEY[:-8].encode(), "the ssh-ed25519 key is damaged"),
        (b"\xff\xfe\x00garbage\x80", "not text (binary garbage in the file)"),
        (b"10.0.0.2 ssh-ed25519", "expected 'HOSTS KEYTYPE BASE64-KEY'"),
        (b"h ssh-ed25519 " + base64.b64encode(b"junk" * 3), "the ssh-ed25519 key is damaged"),
    ],
)
def test_a_bad_line_names_file_line_and_fix(tmp_path: Path, line: bytes, reason: str) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_bytes(b"# comment\n" + GOOD.encode() + line + b"\n")
    with pytest.raises(known_hosts.KnownHostsError) as info:
        known_hosts.load(str(kh))
    err = info.value
    assert (err.path, err.line) == (str(kh), 3)
    assert str(err).startswith(f"{kh} line 3: {reason}")
    assert f"sed -i '3d' {kh}" in err.hint() and f"ssh-keygen -f {kh} -R 'HOST'" in err.hint()


def test_lines_openssh_skips_are_skipped_and_hashed_names_match(tmp_path: Path) -> None:
    from launcher.sshlib import paramiko

    hashed = paramiko.HostKeys.hash_host("[10.0.0.3]:2222")
    kh = tmp_path / "known_hosts"
    kh.write_text(
        GOOD
        + f"@cert-authority *.example ssh-ed25519 {KEY}\n"
        + "h sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29tAAAAIA==\n"
        + f"{hashed} ssh-ed25519 {KEY}\n"
    )
    assert set(known_hosts.lookup("[10.0.0.1]:2222", (), (str(kh),)) or {}) == {"ssh-ed25519"}
    assert set(known_hosts.lookup("[10.0.0.3]:2222", (), (str(kh),)) or {}) == {"ssh-ed25519"}
    assert known_hosts.lookup("[10.0.0.9]:2222", (), (str(kh),)) is None
    # Edited between two attempts: read again (a key recorded by accept-new is seen).
    kh.write_text(GOOD + f"[10.0.0.9]:2222 ssh-ed25519 {KEY}\n")
    assert known_hosts.lookup("[10.0.0.9]:2222", (), (str(kh),)) is not None


@pytest.mark.ssh
def test_a_corrupt_known_hosts_line_fails_the_preflight_with_the_line(
    sshd_hosts: Testbed, tmp_path: Path
) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_bytes(sshd_hosts.known_hosts.read_bytes() + b"\xff\xfe broken \x80\n")
    cfg = sshd_hosts.write_ssh_config(tmp_path / "ssh_config", known_hosts=kh)
    bad_line = len(sshd_hosts.known_hosts.read_text().splitlines()) + 1
    check = RemoteCheck(cwd=os.getcwd(), python=sys.executable)
    with pytest.raises(PreflightError) as info:
        preflight(["worker1"], ssh.SSHSettings(config_path=cfg), check)
    (err,) = info.value.errors
    assert err.cause is ssh.Cause.CONFIG
    assert f"bad known_hosts line: {kh} line {bad_line}: not text (binary garbage in the file)" in str(err)
    w1 = sshd_hosts.host("worker1")
    assert f"sed -i '{bad_line}d' {kh}" in err.hint
    assert f"ssh-keygen -f {kh} -R '[{w1.address}]:{w1.port}'" in err.hint
    assert "UnicodeDecodeError" not in str(err)


def test_the_launcher_imports_paramiko_without_invoke() -> None:
    """invoke is a third of paramiko's import time and only runs ssh_config ``Match exec`` lines."""
    code = "import sys, launcher.cli, launcher.runners.ssh; print('invoke' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_match_exec_in_ssh_config_still_works(tmp_path: Path) -> None:
    pytest.importorskip("invoke")
    cfg = tmp_path / "config"
    cfg.write_text('Match exec "test 1 = 1"\n  Port 2201\nMatch exec "test 1 = 2"\n  User nobody-x\n')
    code = (
        "import sys; from pathlib import Path; from launcher import ssh\n"
        f"t = ssh.resolve('h', ssh.SSHSettings(config_path=Path({str(cfg)!r})))\n"
        "print(t.port, t.user != 'nobody-x')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "2201 True", out.stderr
