"""Hostfiles whose hosts cannot all be used as listed, through the real CLI: two lines naming one machine
(refused before anything starts, naming both lines), and many unreachable hosts (one line per cause).
No sshd needed: the unreachable hosts are loopback addresses where nothing listens."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.hostfile import check_one_line_per_machine, parse_hostfile, select_hosts
from launcher.machine import machine_keys
from tests.support.dist import free_port
from tests.support.launching import run_dslaunch


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('LOCAL_RANK', os.environ['LOCAL_RANK'])\n")
    return script


@pytest.mark.parametrize("other", ["127.0.0.1", "::1", socket.gethostname()])
def test_two_names_of_this_machine_are_refused_naming_both_lines(tmp_path: Path, other: str) -> None:
    # Both lines used to run as two nodes of one machine, each with LOCAL_RANK 0 (two ranks on GPU 0).
    name = f"[{other}]" if ":" in other else other
    hostfile = _hostfile(tmp_path, f"# two names, one machine\nlocalhost slots=1\n{name} slots=1\n")
    result = run_dslaunch(["--hostfile", str(hostfile), str(_script(tmp_path))], timeout=30)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"dslaunch: error: {hostfile}:3: {name!r} is the same machine as 'localhost' on line 2 "
        f"({hostfile}:2: 'localhost slots=1'; both are this machine), so both would start at LOCAL_RANK 0 "
        f"on the same devices: list each machine once, with all its slots on one line: '{name} slots=1'"
    )
    assert "LOCAL_RANK" not in result.stdout  # nothing started


def test_distinct_loopback_addresses_are_distinct_hosts_and_names_of_this_machine_are_one() -> None:
    hosts = ["127.0.0.2", "127.0.0.3", "worker1", "10.0.0.5", "root@10.0.0.6:2222", "[::1]"]
    keys = machine_keys([*hosts, "localhost", "127.0.0.1", socket.gethostname()])
    assert len(set().union(*(keys[h] for h in hosts))) == len(hosts)  # the sshd testbed's hosts stay allowed
    assert keys["localhost"] == keys["127.0.0.1"] == keys[socket.gethostname()] == {"this machine:22"}
    assert keys["[::1]"] == {"this machine:22"} and keys["root@10.0.0.6:2222"] == {"10.0.0.6:2222"}
    hf = parse_hostfile("".join(f"{h} slots=1\n" for h in hosts), "hf")
    check_one_line_per_machine("hf", select_hosts(hf), keys)  # no error


def test_a_thousand_unreachable_hosts_are_one_line_and_one_fix_per_cause(tmp_path: Path) -> None:
    # 1000 loopback addresses where nothing listens on the port: each used to print its own two lines.
    port = free_port()
    hosts = [f"127.0.{10 + i // 250}.{i % 250 + 1}:{port}" for i in range(1000)]
    hostfile = _hostfile(tmp_path, "".join(f"{h} slots=1\n" for h in hosts))
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("")
    args = ["--hostfile", str(hostfile), "--ssh_config", str(ssh_config), str(_script(tmp_path))]
    result = run_dslaunch(args, timeout=120)
    assert result.returncode == 2, result.stderr
    error = result.stderr[result.stderr.index("dslaunch: error:") :].splitlines()
    assert error == [
        "dslaunch: error: 1000 host(s) failed the SSH preflight; nothing was started:",
        f"  hosts {hosts[0]}, {hosts[1]}, {hosts[2]} ... and 997 more: connection refused "
        f"(e.g. nothing listens on 127.0.10.1 port {port})",
        "    fix: start sshd there, or set the right port (Port in ssh_config, --ssh_port, host:PORT)",
    ]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on every loopback address that accepts TCP connections and never says a word."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(256)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


def test_hosts_that_never_answer_are_waited_for_together_not_eight_at_a_time(tmp_path, silent_port) -> None:
    # 40 hosts whose "sshd" never sends its greeting: each costs 3 banner timeouts of 1 s. With 8
    # connections in flight in all (not 8 per sshd), that was 5 rounds: about 18 s before the error.
    hosts = [f"127.0.20.{i}:{silent_port}" for i in range(1, 41)]
    hostfile = _hostfile(tmp_path, "".join(f"{h} slots=1\n" for h in hosts))
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text("Host *\n  ConnectTimeout 1\n")
    start = time.monotonic()
    args = ["--hostfile", str(hostfile), "--ssh_config", str(ssh_config), str(_script(tmp_path))]
    result = run_dslaunch(args, timeout=120)
    took = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert (
        f"  hosts {hosts[0]}, {hosts[1]}, {hosts[2]} ... and 37 more: no SSH server answered "
        in result.stderr
    )
    assert took < 12, f"{took:.1f}s"
