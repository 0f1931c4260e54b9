"""What the launcher decides about this machine (launcher.machine): CPU or GPU slots, and the rendezvous
port. Pure decisions, probed against real sockets the tests hold (never against 29500 itself)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from launcher.errors import LaunchError
from launcher.machine import Devices, choose_master_port, default_slots, devices_for, port_is_free


@pytest.mark.parametrize(
    ("gpus", "env", "want"),
    [
        (("0",), {"DS_ACCELERATOR": "cpu"}, Devices((), "DS_ACCELERATOR=cpu")),  # the 1-GPU test machine
        (("0", "1"), {"DS_ACCELERATOR": " CPU "}, Devices((), "DS_ACCELERATOR=cpu")),
        (("0", "1"), {"DS_ACCELERATOR": "cuda"}, Devices(("0", "1"))),
        (("0", "1"), {}, Devices(("0", "1"))),
        ((), {}, Devices((), "no GPUs on this machine")),
        ((), {"DS_ACCELERATOR": "cpu"}, Devices((), "DS_ACCELERATOR=cpu")),
    ],
)
def test_ds_accelerator_cpu_means_cpu_workers_even_with_gpus(gpus, env, want) -> None:
    assert devices_for(gpus, env) == want


def test_num_gpus_counts_cpu_workers_when_the_workers_are_cpu_workers() -> None:
    forced = devices_for(("0",), {"DS_ACCELERATOR": "cpu"})
    assert default_slots(forced, 2) == (2, "DS_ACCELERATOR=cpu: starting 2 CPU worker(s)")
    assert default_slots(devices_for((), {}), 3) == (3, "no GPUs on this machine: starting 3 CPU worker(s)")
    assert default_slots(devices_for(("0", "1"), {}), None) == (2, None)  # one worker per GPU
    with pytest.raises(LaunchError, match=r"^DS_ACCELERATOR=cpu: pass --num_gpus N to start N CPU workers$"):
        default_slots(forced, None)


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process is listening on, as a job already running would be."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_one_node_without_master_port_moves_off_a_busy_default(held_port) -> None:
    assert not port_is_free(held_port)
    choice = choose_master_port(None, single_node=True, master_is_here=True, default=held_port)
    assert choice.port != held_port and port_is_free(choice.port)
    assert choice.notice == f"port {held_port} is in use; using {choice.port} (pass --master_port to choose)"
    # drawn below the kernel's range for outgoing connections, where no other process's connection can
    # take it before rank 0's store binds it
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    assert 10_000 <= choice.port < ephemeral_low


def test_a_free_default_or_a_given_free_port_is_kept_silently(held_port) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    for single in (True, False):
        assert choose_master_port(None, single_node=single, master_is_here=True, default=free).notice is None
        assert choose_master_port(None, single_node=single, master_is_here=True, default=free).port == free
        assert (
            choose_master_port(free, single_node=single, master_is_here=True, default=held_port).port == free
        )


def test_multi_node_keeps_the_default_and_refuses_it_busy_where_rank_0_runs_here(held_port) -> None:
    with pytest.raises(LaunchError) as err:
        choose_master_port(None, single_node=False, master_is_here=True, default=held_port)
    assert str(err.value) == (
        f"port {held_port} (the default --master_port) is in use on this machine, where rank 0 runs: "
        "pass --master_port with a free port"
    )
    # Rank 0 elsewhere: its port cannot be checked from here, and the default stays predictable.
    assert (
        choose_master_port(None, single_node=False, master_is_here=False, default=held_port).port == held_port
    )


def test_a_given_busy_port_is_refused_where_rank_0_runs_here(held_port) -> None:
    for single in (True, False):
        with pytest.raises(
            LaunchError, match=f"^--master_port {held_port}: the port is in use on this machine$"
        ):
            choose_master_port(held_port, single_node=single, master_is_here=True)
