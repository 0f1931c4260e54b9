"""Where the offloaded Adam step runs: on the CPU, on the GPU over streamed state, or split between them.

Optimizer offload keeps the fp32 master and both Adam moments in host memory. Where they are updated is
a separate choice (`offload_optimizer.update`: auto, host or device; `choose_update`):

- host: the gradients cross PCIe to the host, the CPU runs the fused Adam kernel, the new weights cross
  back (host_step.py). Per parameter: 8 bytes over PCIe (fp32 landing) and 36 bytes of host memory
  traffic (the kernel's 28 and both copies), so the host's memory bandwidth limits the step.
- device: a ring of staging slots on the GPU (device_step.py). For each chunk of a span the master and
  both moments go up (12 bytes), the GPU's fused kernel updates them from the gradient that never left
  the device and writes the new working weights in place, and the three go back down (12 bytes). Per
  parameter: 24 bytes over PCIe, split evenly between the two directions, 24 bytes of host memory
  traffic (DMA only), no CPU work. On the H200 (PCIe 5, 49 GB/s each way with both directions busy)
  GPT-2 XL's 1.56B parameters took 0.38 s this way, about torch's fused CPU step alone, against
  0.56-0.64 s for the host step with its copies, and it runs while backward computes.

The two can share a step: with `offload_optimizer.host_share: f` the GPU streams the head of every span
and the CPU updates its tail, about f of its elements, from gradients landed on the host (only the tails
land, into buffers their size). Both work on every span at once, from the first span backward hands over:
PCIe carries the GPU's state and the CPU's gradients and weights, the host's cores and memory bandwidth
the CPU's update, and the step takes about the longer of the two halves.

On the H200 the GPU alone was faster than every split tried (25-55% for the CPU, BENCHMARKS.md run E),
so the CPU's default share is 0. All ranks take the same placement (`agree_on_update`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.comm import Comm
from runtime.distributed import local_world_size
from runtime.memory import host_available_bytes
from runtime.offload.settings import OffloadSettings
from runtime.offload.step.device_step import staging_bytes

KEY = "offload_optimizer.update"  # how the reasons name the settings
SHARE_KEY = "offload_optimizer.host_share"
DEFAULT_HOST_SHARE = 0.0
"""The fraction of the elements whose update the CPU takes when the GPU runs the step, with one rank on
the host (`default_host_share` scales it for more)."""
PIN_ROOM_BYTES_PER_PARAM = 16
"""What "auto" wants available per parameter of the shard before it pins the 12 bytes of state: the same
rule as fp32 landing (landing.py), so a host that gave the CPU step fp32 landing gives the device step
room, and the largest models (8.44B on the 126 GiB H200 host) keep the CPU step, which pins 2 bytes."""
PIN_HEADROOM = 4 << 30  # per rank, like landing.FP32_LANDING_HEADROOM


@dataclass(frozen=True)
class UpdateChoice:
    """Where the offloaded Adam step runs, and why (the engine logs it at startup)."""

    on_device: bool
    reason: str
    host_share: float = 0.0  # with on_device: the fraction of the elements the CPU updates


def default_host_share(local_ranks: int, one_rank: float | None = None) -> float:
    """The CPU's share with `local_ranks` ranks on this host, from `one_rank`, the share that balances one
    rank's halves. Each rank's GPU has its own PCIe link, but the ranks split the host's cores, so a rank's
    CPU half takes `local_ranks` times as long: with r = (1 - one_rank) / one_rank, the time the CPU takes
    per element over the GPU's, the balance is 1 / (1 + local_ranks * r). `one_rank` defaults to
    DEFAULT_HOST_SHARE."""
    one_rank = DEFAULT_HOST_SHARE if one_rank is None else one_rank
    if one_rank <= 0.0 or local_ranks < 1:
        return 0.0
    return 1.0 / (1.0 + local_ranks * (1.0 - one_rank) / one_rank)


def choose_update(
    *,
    setting: str | None = None,
    on_gpu: bool,
    adam: bool,
    weights_on_host: bool,
    pinned: bool,
    shard_numel: int = 0,
    local_ranks: int = 1,
    host_available: int | None = None,
    device_free: int | None = None,
    host_share: float = DEFAULT_HOST_SHARE,
    staging: int | None = None,
) -> UpdateChoice:
    """The update placement for this run. `setting` is `offload_optimizer.update`: host or device when it
    says so (device only where it can run), else (None: auto) device exactly where it can run and pays:
    a GPU, Adam or AdamW, pinned host state, working weights on the device, host memory with room to pin
    the state (`host_available` bytes shared by `local_ranks` ranks) and a device with room for the
    `staging` slots (default: the fewest slots of the default chunk; at most 1/8 of its `device_free`
    bytes: the model came to the GPU already, its activations have not); None: not checked. With the
    device, the CPU still updates `host_share` of the elements."""
    if setting not in (None, "host", "device"):
        raise ValueError(f"{KEY} {setting!r}: expected 'host', 'device' or None (auto)")
    if setting == "host":
        return UpdateChoice(False, f'the CPU runs the Adam step ({KEY}: "host")')
    blocker = None
    if not adam:
        blocker = "the optimizer is not Adam or AdamW (or uses options the fused kernel lacks)"
    elif weights_on_host:
        blocker = "offload_param keeps the working weights in host memory"
    elif on_gpu and not pinned:
        blocker = "offload_optimizer.pin_memory is false, and the state could not stream asynchronously"
    if setting == "device":
        if blocker is not None:
            return UpdateChoice(False, f'the CPU runs the Adam step although {KEY} is "device": {blocker}')
        return UpdateChoice(
            True,
            f'the GPU runs the Adam step on state streamed from host memory ({KEY}: "device")'
            + _sharing(host_share),
            host_share,
        )
    if not on_gpu:
        return UpdateChoice(False, "the CPU runs the Adam step (no GPU)")
    if blocker is not None:
        return UpdateChoice(False, f"the CPU runs the Adam step: {blocker}")
    gib = 1 << 30
    need = (shard_numel * PIN_ROOM_BYTES_PER_PARAM + PIN_HEADROOM) * local_ranks
    if host_available is not None and host_available < need:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: streaming the state through the GPU pins all of it, and this host "
            f"has {host_available / gib:.1f} GiB available of the {need / gib:.1f} GiB that {local_ranks} "
            f'rank(s) would want; {KEY}: "device" insists',
        )
    staging = staging_bytes() if staging is None else staging
    if device_free is not None and staging * 8 > device_free:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: the GPU has {device_free / gib:.1f} GiB free, too little to spare "
            f"{staging / gib:.2f} GiB for the device step's staging; "
            f'{KEY}: "device" insists',
        )
    return UpdateChoice(
        True,
        "the GPU runs the Adam step on state streamed from pinned host memory (24 bytes a parameter over "
        f'PCIe, no CPU pass over host memory){_sharing(host_share)}; {KEY}: "host" runs it all on the '
        "CPU",
        host_share,
    )


def _sharing(share: float) -> str:
    if share == 0.0:
        return ""
    return f", and the CPU updates {share:.0%} of the elements at the same time ({SHARE_KEY})"


def update_choice(
    settings: OffloadSettings, *, device: torch.device, weights_on_host: bool, pinned: bool, shard_numel: int
) -> UpdateChoice:
    """`choose_update` with `settings`, and the host memory left to this process, the ranks on this host
    and the device's free memory read here (Adam is assumed; `HostMasters.bind` checks the optimizer)."""
    on_gpu = device.type == "cuda"
    share = settings.host_share
    return choose_update(
        setting=settings.update,
        on_gpu=on_gpu,
        adam=True,
        weights_on_host=weights_on_host,
        pinned=pinned,
        shard_numel=shard_numel,
        local_ranks=local_world_size(),
        host_available=host_available_bytes() if on_gpu else None,
        device_free=torch.cuda.mem_get_info(device)[0] if on_gpu else None,
        host_share=default_host_share(local_world_size()) if share is None else share,
        staging=staging_bytes(settings.device_chunk_elems, settings.device_slots),
    )


def agree_on_update(choice: UpdateChoice, comm: Comm, device: torch.device) -> UpdateChoice:
    """The placement every rank uses: the device only where all ranks chose it, so every shard takes the
    same arithmetic and no rank waits on a slower one's host."""
    on_device = comm.count(choice.on_device, device)
    if on_device in (0, comm.world_size):
        return choice
    return UpdateChoice(
        False,
        f"the CPU runs the Adam step: {comm.world_size - on_device} of {comm.world_size} ranks cannot "
        "stream the state through their GPU",
    )
