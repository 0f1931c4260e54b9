"""launcher.ssh against real sshd servers: settings from ssh_config, preflight, and one clear cause per
failure (with the command that fixes it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from launcher import ssh
from launcher.preflight import PreflightError, RemoteCheck, master_address, preflight
from tests.support import sshd_testbed
from tests.support.sshd_testbed import Testbed

CHECK = RemoteCheck(cwd=os.getcwd(), python=sys.executable, module="launcher.agent")


# --- settings (no server needed) -------------------------------------------------------------------------


def test_resolve_reads_ssh_config_and_flags_override(tmp_path: Path) -> None:
    cfg = tmp_path / "config"
    cfg.write_text(
        "Host gpu1\n  HostName 10.1.2.3\n  Port 2200\n  User alice\n  IdentityFile ~/k1\n"
        "  UserKnownHostsFile /kh/a /kh/b\n  IdentitiesOnly yes\n"
        "Host *\n  ConnectTimeout 3\n"
    )
    t = ssh.resolve("gpu1", ssh.SSHSettings(config_path=cfg))
    assert (t.hostname, t.port, t.user) == ("10.1.2.3", 2200, "alice")
    assert t.identity_files == (os.path.expanduser("~/k1"),)
    assert t.known_hosts_files == ("/kh/a", "/kh/b")
    assert t.identities_only and t.connect_timeout == 3.0
    assert t.known_hosts_key == "[10.1.2.3]:2200"
    # --ssh_port beats the config; user@host:port in the hostfile beats both.
    assert ssh.resolve("gpu1", ssh.SSHSettings(config_path=cfg, port=2222)).port == 2222
    t2 = ssh.resolve("bob@gpu1:2022", ssh.SSHSettings(config_path=cfg, port=2222))
    assert (t2.user, t2.hostname, t2.port) == ("bob", "10.1.2.3", 2022)
    # An unlisted host keeps its name, port 22 and OpenSSH's default known_hosts files.
    other = ssh.resolve("plainhost", ssh.SSHSettings(config_path=cfg))
    assert (other.hostname, other.port, other.known_hosts_key) == ("plainhost", 22, "plainhost")
    assert other.known_hosts_files[0] == os.path.expanduser("~/.ssh/known_hosts")


def test_bad_settings_are_reported_with_the_file(tmp_path: Path) -> None:
    with pytest.raises(PreflightError, match=r"ssh config file not found: .*nope"):
        preflight(["h"], ssh.SSHSettings(config_path=tmp_path / "nope"))
    with pytest.raises(ssh.SSHHostError, match=r"bad port 'x'"):
        ssh.resolve("h:x", ssh.SSHSettings(config_path=None))


# --- against the shared testbed --------------------------------------------------------------------------


@pytest.mark.ssh
def test_preflight_connects_every_host_and_learns_its_address(sshd_hosts: Testbed) -> None:
    conns = preflight(sshd_hosts.names, ssh.SSHSettings(config_path=sshd_hosts.ssh_config), CHECK)
    try:
        assert list(conns) == sshd_hosts.names
        for name, conn in conns.items():
            host = sshd_hosts.host(name)
            assert conn.hostname == sshd_hosts.hostname_of(name)
            # The address the host sees our connection arrive on: what MASTER_ADDR defaults to.
            assert master_address(conn) == host.address
            assert conn.python_version == sys.version.split()[0]
    finally:
        for c in conns.values():
            c.close()


@pytest.mark.ssh
def test_run_returns_exit_code_and_both_streams(sshd_hosts: Testbed) -> None:
    settings = ssh.SSHSettings(config_path=sshd_hosts.ssh_config)
    rc, out, err = ssh.run("worker2", "echo out; echo err >&2; exit 7", settings, timeout=20)
    assert (rc, out, err) == (7, "out\n", "err\n")


@pytest.mark.ssh
def test_preflight_bounds_concurrency_below_sshd_maxstartups(sshd_hosts: Testbed, tmp_path: Path) -> None:
    # 16 aliases of one stock sshd (MaxStartups 10:30:100): an unbounded burst of 16 connects gets some
    # dropped with "Error reading SSH protocol banner"; the bounded preflight must pass them all.
    h = sshd_hosts.host("worker1")
    cfg = tmp_path / "cfg"
    base = sshd_hosts.ssh_config.read_text()
    cfg.write_text(
        "".join(f"Host alias{i}\n  HostName {h.address}\n  Port {h.port}\n" for i in range(16)) + base
    )
    names = [f"alias{i}" for i in range(16)]
    conns = preflight(names, ssh.SSHSettings(config_path=cfg))
    assert len(conns) == 16
    for c in conns.values():
        c.close()


@pytest.mark.ssh
def test_proxy_jump_reaches_a_host_through_another(sshd_hosts: Testbed, tmp_path: Path) -> None:
    w2 = sshd_hosts.host("worker2")
    cfg = tmp_path / "cfg"
    cfg.write_text(
        f"Host behind\n  HostName {w2.address}\n  Port {w2.port}\n  ProxyJump worker1\n"
        + sshd_hosts.ssh_config.read_text()
    )
    conns = preflight(["behind"], ssh.SSHSettings(config_path=cfg), CHECK)
    try:
        assert conns["behind"].hostname == sshd_hosts.hostname_of("worker2")
    finally:
        conns["behind"].close()


# --- failures: a private testbed, because these tests break hosts ----------------------------------------


@pytest.fixture(scope="module")
def broken(sshd_testbed_factory) -> Testbed:
    """4 hosts: worker1 healthy, worker2 with a rotated host key, worker3 stopped, worker4 healthy."""
    tb = sshd_testbed_factory(4, 1)
    tb.regenerate_host_key("worker2")
    tb.stop_host("worker3")
    return tb


def _errors(hosts: list[str], settings: ssh.SSHSettings, check=CHECK) -> dict[str, ssh.SSHHostError]:
    with pytest.raises(PreflightError) as info:
        preflight(hosts, settings, check)
    return {e.host.split()[0]: e for e in info.value.errors}


@pytest.mark.ssh
def test_each_failure_names_its_cause_and_fix(broken: Testbed) -> None:
    settings = ssh.SSHSettings(config_path=broken.ssh_config)
    errs = _errors(["worker1", "worker2", "worker3", "no-such-host.invalid"], settings)
    assert "worker1" not in errs  # the healthy host is not blamed
    w2, w3 = broken.host("worker2"), broken.host("worker3")

    changed = errs["worker2"]
    assert changed.cause is ssh.Cause.HOST_KEY_CHANGED
    assert f"ssh-keygen -f {broken.known_hosts} -R '[{w2.address}]:{w2.port}'" in str(changed)
    assert "SHA256:" in changed.detail

    refused = errs["worker3"]
    assert refused.cause is ssh.Cause.REFUSED
    assert f"nothing listens on {w3.address} port {w3.port}" in str(refused)

    assert errs["no-such-host.invalid"].cause is ssh.Cause.DNS


@pytest.mark.ssh
def test_unknown_host_key_is_refused_unless_opted_in(broken: Testbed, tmp_path: Path) -> None:
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    cfg = broken.write_ssh_config(tmp_path / "cfg", known_hosts=kh)
    w1 = broken.host("worker1")
    err = _errors(["worker1"], ssh.SSHSettings(config_path=cfg))["worker1"]
    assert err.cause is ssh.Cause.UNKNOWN_HOST_KEY
    assert f"ssh-keyscan -p {w1.port} {w1.address} >> {kh}" in str(err)
    assert "--accept_new_host_keys" in str(err)
    assert kh.read_text() == ""  # refusing records nothing

    conns = preflight(["worker1"], ssh.SSHSettings(config_path=cfg, accept_new_host_keys=True), CHECK)
    conns["worker1"].close()
    recorded = kh.read_text().split()
    assert recorded[0] == f"[{w1.address}]:{w1.port}"
    assert recorded[2] == w1.host_key_pub.read_text().split()[1]
    # Now known: a strict connection works without the flag.
    preflight(["worker1"], ssh.SSHSettings(config_path=cfg))["worker1"].close()


@pytest.mark.ssh
def test_accept_new_never_overrides_a_changed_key(broken: Testbed) -> None:
    before = broken.known_hosts.read_text()
    settings = ssh.SSHSettings(config_path=broken.ssh_config, accept_new_host_keys=True)
    assert _errors(["worker2"], settings)["worker2"].cause is ssh.Cause.HOST_KEY_CHANGED
    assert broken.known_hosts.read_text() == before


@pytest.mark.ssh
def test_wrong_user_key_is_an_auth_failure(broken: Testbed, tmp_path: Path) -> None:
    sshd_testbed.keygen(tmp_path / "stranger", "not-authorized")
    cfg = broken.write_ssh_config(tmp_path / "cfg", identity=tmp_path / "stranger")
    err = _errors(["worker1"], ssh.SSHSettings(config_path=cfg))["worker1"]
    assert err.cause is ssh.Cause.AUTH
    assert str(tmp_path / "stranger") in err.detail and "authorized_keys" in err.hint


@pytest.mark.ssh
def test_missing_python_project_or_directory_on_the_host(broken: Testbed) -> None:
    settings = ssh.SSHSettings(config_path=broken.ssh_config)
    cases = {
        RemoteCheck(cwd="/no/such/dir", python=sys.executable): (ssh.Cause.NO_PROJECT, "/no/such/dir"),
        RemoteCheck(cwd="/", python="/opt/nopython/bin/python3"): (ssh.Cause.NO_PYTHON, "/opt/nopython"),
        RemoteCheck(cwd="/", python=sys.executable, module="no_such_module_x"): (
            ssh.Cause.NO_PROJECT,
            "No module named 'no_such_module_x'",
        ),
    }
    for check, (cause, text) in cases.items():
        err = _errors(["worker4"], settings, check)["worker4"]
        assert err.cause is cause and text in str(err), str(err)


@pytest.mark.ssh
def test_a_probe_that_never_answers_times_out_with_what_to_check(broken: Testbed, tmp_path: Path) -> None:
    """A remote command that hangs (here the interpreter; in life often a shell startup file) ends in a
    bounded wait, with the cause and what to check, instead of a silent hang."""
    from launcher.preflight import Connection, start_checked

    stuck = tmp_path / "python-that-hangs"
    stuck.write_text("#!/bin/sh\nexec sleep 30\n")
    stuck.chmod(0o755)
    settings = ssh.SSHSettings(config_path=broken.ssh_config)
    target = ssh.resolve("worker4", settings)
    conn = Connection(target, ssh.connect(target, settings))
    try:
        with pytest.raises(ssh.SSHHostError) as info:
            start_checked(conn, RemoteCheck(cwd="/", python=str(stuck)), timeout=2.0)
    finally:
        conn.close()
    assert info.value.cause is ssh.Cause.COMMAND
    assert "did not answer within 2s" in str(info.value)
    assert "`ssh <host> true`" in info.value.hint and "~/.bashrc" in info.value.hint
