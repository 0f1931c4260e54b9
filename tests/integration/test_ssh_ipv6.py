"""An IPv6 host end to end: ``[::1]:PORT`` in the hostfile, SSH to it, MASTER_ADDR without brackets.

The fake host's sshd also listens on [::1] (an extra ListenAddress); known_hosts names it the way OpenSSH
does (``[::1]:PORT``). torch's rendezvous (TCPStore behind ``env://``) resolves MASTER_ADDR with
getaddrinfo, which takes ``::1`` and refuses ``[::1]``: the workers' all-reduce proves the address works.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TestbedFactory
from tests.support.launching import DSLAUNCH
from tests.support.multinode import REPORT_WORKER, base_args, run_dslaunch, worker


def _free_v6_port() -> int:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return s.getsockname()[1]
    except OSError as e:
        pytest.skip(f"this machine has no IPv6 loopback ({e})")


@pytest.mark.ssh
@pytest.mark.timeout(180)
def test_a_job_on_an_ipv6_host(sshd_testbed_factory: TestbedFactory, tmp_path: Path) -> None:
    port = _free_v6_port()
    tb = sshd_testbed_factory(1, 2, sshd_extra=f"ListenAddress [::1]:{port}")
    keytype, key = tb.host("worker1").host_key_pub.read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[::1]:{port} {keytype} {key}\n")
    cfg = tb.write_ssh_config(tmp_path / "ssh_config", known_hosts=kh)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"# the fake host by its IPv6 address\n[::1]:{port} slots=2\n")

    script = worker(tmp_path, REPORT_WORKER)
    r = run_dslaunch([*base_args(tb, hostfile, cfg), "--include", "[::1]:0,1", str(script), "--flag"])
    assert r.returncode == 0, r.stderr + r.stdout
    got = {m[1]: json.loads(m[2]) for m in re.finditer(r"^\[(.+ rank \d+)\] REPORT (.*)$", r.stdout, re.M)}
    assert sorted(got) == [f"[::1]:{port} rank 0", f"[::1]:{port} rank 1"], r.stdout
    for rep in got.values():
        assert rep["env"]["MASTER_ADDR"] == "::1"  # no brackets: what getaddrinfo takes
        assert rep["sum"] == 0 + 1  # the rendezvous on ::1 worked
        assert rep["host"] == tb.hostname_of("worker1")  # it ran on the fake host, over SSH


def test_master_addr_given_in_brackets_reaches_workers_bare(tmp_path: Path) -> None:
    """``--master_addr [::1]`` (written as in the hostfile) becomes ``::1`` for the workers."""
    script = tmp_path / "show.py"
    script.write_text("import os; print('ADDR=' + os.environ['MASTER_ADDR'])\n")
    args = ["--num_gpus", "1", "--master_addr", "[::1]", "--master_port", str(_free_v6_port()),
            "--no_local_rank", str(script)]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([*DSLAUNCH, *args], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "ADDR=::1" in r.stdout, r.stdout
