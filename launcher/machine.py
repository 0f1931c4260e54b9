"""This machine, as the launcher sees it before starting anything: its GPUs, its names, its ports.

Names: ``machine_keys`` tells which hostfile hosts are one machine (a name and its address, ``localhost``
and ``127.0.0.1``), so that the hostfile check refuses listing a machine twice.

GPU counting never imports torch: ``CUDA_VISIBLE_DEVICES`` if set, else NVML (nvidia-ml-py) when the
NVIDIA driver is present, else ``/proc/driver/nvidia/gpus``. ``DS_ACCELERATOR=cpu`` (DeepSpeed's name,
which the runtime honours too) means CPU workers even where GPUs are: no slot becomes a
``CUDA_VISIBLE_DEVICES`` entry and ``--num_gpus N`` starts N CPU workers.

The rendezvous port: without ``--master_port`` a job uses 29500 (DeepSpeed's and torch's default). On
one machine a busy 29500 is replaced by a free port, said in one line. On several machines the port
stays predictable (it is what firewalls between the nodes are opened for): when rank 0 runs here and
29500 is busy, the launcher stops before starting anything, naming the flag. The decisions are pure
functions (``devices_for``, ``default_slots``, ``choose_master_port``; the port probes and the default
port are parameters), so tests run them against a socket they hold instead of against 29500 itself.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from launcher.errors import LaunchError
from launcher.hostfile import split_host

ACCELERATOR_ENV = "DS_ACCELERATOR"
DEFAULT_MASTER_PORT = 29500


# -- devices ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Devices:
    """What this machine's workers run on."""

    gpu_ids: tuple[str, ...]  # ids for CUDA_VISIBLE_DEVICES (strings: may be UUIDs); empty: CPU workers
    why_cpu: str = ""  # why the workers are CPU workers: "no GPUs on this machine" or "DS_ACCELERATOR=cpu"

    @property
    def cpu_forced(self) -> bool:
        return self.why_cpu.startswith(ACCELERATOR_ENV)


def accelerator_is_cpu(env: Mapping[str, str]) -> bool:
    return env.get(ACCELERATOR_ENV, "").strip().lower() == "cpu"


def devices_for(detected_gpus: tuple[str, ...], env: Mapping[str, str]) -> Devices:
    """The devices workers get, from the GPUs found and the environment (``DS_ACCELERATOR``)."""
    if accelerator_is_cpu(env):
        return Devices((), f"{ACCELERATOR_ENV}=cpu")
    if not detected_gpus:
        return Devices((), "no GPUs on this machine")
    return Devices(detected_gpus)


def default_slots(devices: Devices, num_gpus: int | None) -> tuple[int, str | None]:
    """Without a hostfile: how many slots this machine offers, and the notice to print (CPU workers)."""
    if devices.gpu_ids:
        return len(devices.gpu_ids), None
    if num_gpus is None:
        raise LaunchError(f"{devices.why_cpu}: pass --num_gpus N to start N CPU workers")
    return num_gpus, f"{devices.why_cpu}: starting {num_gpus} CPU worker(s)"


def visible_gpus() -> tuple[str, ...]:
    """Ids of the GPUs this process may use (strings: CUDA_VISIBLE_DEVICES may hold UUIDs)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return tuple(x.strip() for x in cvd.split(",") if x.strip())
    proc_dir = "/proc/driver/nvidia/gpus"
    if not os.path.isdir(proc_dir):
        return ()  # no NVIDIA driver: skip NVML, whose import and init cost time
    try:
        import pynvml  # only when a driver is present

        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or broken: fall back to the driver's list
        count = len(os.listdir(proc_dir))
    return tuple(str(i) for i in range(count))


def this_machine_devices() -> Devices:
    """The devices of this machine's workers; with DS_ACCELERATOR=cpu without asking NVML at all."""
    if accelerator_is_cpu(os.environ):
        return devices_for((), os.environ)
    return devices_for(visible_gpus(), os.environ)


# -- names -----------------------------------------------------------------------------------------
THIS_MACHINE = "this machine"
_RESOLVE_THREADS = 16  # names resolve in parallel: a hostfile of 1000 DNS names must not take minutes


def is_local_host(name: str) -> bool:
    hostname = socket.gethostname()
    return name in ("localhost", "127.0.0.1", hostname, hostname.split(".")[0])


def addresses_of(name: str) -> frozenset[str]:
    """The IP addresses a host name (or an address) stands for here; empty when it does not resolve."""
    try:
        return frozenset({str(ipaddress.ip_address(name))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset(str(info[4][0]).split("%")[0] for info in infos)


def master_addr_problem(master_addr: str) -> str | None:
    """Why rank 0, started on this machine, could not serve the rendezvous at `master_addr` (the other
    ranks would retry for torch's 30 minutes): the name does not resolve, or none of its addresses is
    one of this machine's (binding a socket to it is the test). None: it can."""
    addresses = addresses_of(master_addr)
    if not addresses:
        return f"{master_addr} does not resolve here"
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((address, 0))
            return None
        except OSError:
            continue
    shown = "" if addresses == {master_addr} else f" ({', '.join(sorted(addresses))})"
    return f"{master_addr}{shown} is not an address of this machine"


def machine_keys(hosts: Sequence[str]) -> dict[str, frozenset[str]]:
    """hostfile host -> what identifies the machine it reaches (its addresses, with the SSH port).

    ``localhost``, ``127.0.0.1``, ``::1`` and this machine's own name and addresses all stand for
    ``this machine``; any other address stands for itself, exactly (the sshd testbed's 127.0.0.2,
    127.0.0.3 ... are different hosts). The port counts: two ports of one address may be two containers.
    A name that does not resolve here (an ssh_config alias) stands only for itself.
    """
    local = {"127.0.0.1", "::1"} | addresses_of(socket.gethostname())

    def keys(host: str) -> frozenset[str]:
        _user, name, port = split_host(host)
        port_text = f":{port or 22}"
        if is_local_host(host):
            return frozenset({THIS_MACHINE + port_text})
        found = addresses_of(name) or frozenset({name.lower()})
        return frozenset((THIS_MACHINE if a in local else a) + port_text for a in found)

    with ThreadPoolExecutor(max_workers=max(1, min(_RESOLVE_THREADS, len(hosts)))) as pool:
        return dict(zip(hosts, pool.map(keys, hosts), strict=True))


# -- ports -----------------------------------------------------------------------------------------
def port_is_free(port: int) -> bool:
    """Whether rank 0's rendezvous store could listen on ``port`` here (it binds every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the store does: a previous job's connections in TIME_WAIT do not make the port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


LOWEST_DRAWN_PORT = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux: 32768 unless configured)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def find_free_port() -> int:
    """A TCP port free on this machine now, drawn at random from below the kernel's ephemeral range.

    Not port 0's answer: that one comes from the ephemeral range, where every outgoing connection of every
    process takes its local port (gloo opens dozens a world), so between this choice and the store's bind
    another process's connection could take it ("the port is in use"). Below the range only listeners
    bind, and a random draw among ~20,000 ports keeps concurrent jobs apart. The kernel's choice only
    where the range leaves no room below it."""
    high = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(LOWEST_DRAWN_PORT, high) if high > LOWEST_DRAWN_PORT else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise LaunchError(f"no free TCP port between {LOWEST_DRAWN_PORT} and {high}: pass --master_port")


@dataclass(frozen=True)
class PortChoice:
    port: int
    notice: str | None = None  # one line to print when the port is not the one asked for


def choose_master_port(
    given: int | None,
    *,
    single_node: bool,
    master_is_here: bool,
    default: int = DEFAULT_MASTER_PORT,
    is_free: Callable[[int], bool] = port_is_free,
    free_port: Callable[[], int] = find_free_port,
) -> PortChoice:
    """MASTER_PORT for the job; raises ``LaunchError`` before anything starts when it cannot work.

    Args:
        given: ``--master_port``, or None when not given.
        single_node: every worker runs on this machine.
        master_is_here: rank 0 (the rendezvous store) runs on this machine, so its port can be checked.
        default: the port used when none is given.
    """
    if given is not None:
        if master_is_here and not is_free(given):
            raise LaunchError(f"--master_port {given}: the port is in use on this machine")
        return PortChoice(given)
    if not master_is_here or is_free(default):
        return PortChoice(default)
    if single_node:
        port = free_port()
        return PortChoice(port, f"port {default} is in use; using {port} (pass --master_port to choose)")
    raise LaunchError(
        f"port {default} (the default --master_port) is in use on this machine, where rank 0 runs: "
        "pass --master_port with a free port"
    )
