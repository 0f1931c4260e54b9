"""Pure planning of optimizer offload: `OffloadSettings` + `OffloadFacts` -> `OffloadPlan`.

Like the launcher's `make_plan`, this module decides and does nothing: no tensors, no collectives, no
environment. Its inputs are the settings (settings.py: the config keys and the internal sizes) and the
facts about this rank and its machine (machine.py reads them once); its output says

- which dtype gradients land on the host in (`plan_landing`, the `grad_transfer` key);
- where the Adam step runs, and the CPU's share of it (`plan_update`, the `update` and `host_share` keys);
- whether gradients stream to the host during backward (one rank, not the sharded stage 3, copies that
  do not block autograd);
- the spans, in the order their gradients become final;
- whether a checked step (a non-finite verdict pending, no clipping) may update during backward into a
  second copy of the state, committed or dropped once the verdict is known (`plan_speculation`: by
  default where the GPU runs the whole step and the host has room).

Each rank plans from its own facts; machine.py's `agree` then makes every rank take the same landing and
the same update site (a separate step, since it is a collective). host_masters.py executes the plan.

Where the Adam step runs:

- host: the gradients cross PCIe to the host, the CPU runs the fused Adam kernel, the new weights cross
  back (step/host_step.py). Per parameter: 8 bytes over PCIe with fp32 landing and 36 bytes of host
  memory traffic (the kernel's 28 and both copies), so the host's memory bandwidth limits the step.
- device: a ring of staging slots on the GPU (step/device_step.py). For each chunk of a span the master
  and both moments go up (12 bytes), the GPU's fused kernel updates them from the gradient that never
  left the device and writes the new working weights in place, and the three go back down (12 bytes).
  Per parameter: 24 bytes over PCIe, split evenly between the two directions, 24 bytes of host memory
  traffic (DMA only), no CPU work, and it runs while backward computes.
- both (`host_share: f`): the GPU streams the head of every span and the CPU updates its tail, about f of
  its elements, from gradients landed on the host; the step takes about the longer of the two halves.
  Measured on the H200, the GPU alone beat every split tried (BENCHMARKS.md), so "auto" gives the CPU
  no share (`OffloadSettings.one_rank_host_share`).

What lands: by default, on a GPU, 16-bit gradients of fp32 masters are converted to fp32 on the device
and land as fp32 whenever host memory holds the 16 bytes a parameter that costs (fp32 master, two Adam
moments, the fp32 landing buffer) on every rank; the host step is then torch's fused fp32 kernel alone,
which outweighs moving twice the bytes over PCIe (BENCHMARKS.md). Otherwise, with "native", and always
with offload_param (whose kernel writes the new 16-bit weights on the host), they land in their own dtype
(2 bytes a parameter) and the host step converts them in cache (14 bytes a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config.offload import DEVICE_CHUNK_ELEMS, OffloadSettings
from runtime.host_memory import HOST_HEADROOM, PIN_ROOM_BYTES_PER_PARAM
from runtime.offload.io.spans import CHUNK_ALIGN, Span, plan_spans
from runtime.zero.partition import FlatLayout, align_up

LANDING_KEY = "offload_optimizer.grad_transfer"  # how the reasons name the settings
UPDATE_KEY = "offload_optimizer.update"
SHARE_KEY = "offload_optimizer.host_share"
FP32_LANDING_HOST_BYTES = 16  # per parameter of the shard: master 4 + exp_avg 4 + exp_avg_sq 4 + landing 4
DEVICE_SLOTS = 4
"""The fewest staging slots of the device step; a device with room gets more, up to MAX_DEVICE_SLOTS."""
MAX_DEVICE_SLOTS = 16
"""With 16M-element chunks, 4 GiB of slots: the downloads still running when the next forward starts may
cover 16 chunks (BENCHMARKS.md has what this was measured against)."""
SLOTS_SHARE_OF_FREE = 16
"""The slots take at most 1/16 of the memory the device has free when the engine is built."""


@dataclass(frozen=True)
class LandingChoice:
    """The dtype gradients land on the host in, and why (the engine logs it at startup)."""

    dtype: torch.dtype
    reason: str


@dataclass(frozen=True)
class UpdateChoice:
    """Where the offloaded Adam step runs, and why (the engine logs it at startup)."""

    on_device: bool
    reason: str
    host_share: float = 0.0  # with on_device: the fraction of the elements the CPU updates


@dataclass(frozen=True)
class MachineFacts:
    """What the plan needs to know about this rank's machine (machine.read_machine)."""

    on_gpu: bool  # the training device is a GPU: copies run asynchronously on copy engines
    can_pin: bool  # page-locked host memory is possible (CUDA is available)
    local_ranks: int  # ranks on this host, which share its memory and cores
    host_available: int  # host bytes left to this process (a container's limit included)
    device_free: int | None  # free bytes on the GPU; None without one


@dataclass(frozen=True)
class OffloadFacts:
    """What the plan needs to know about this rank's model state, and its machine (machine.read_facts)."""

    grad_dtype: torch.dtype  # the stage's gradients (also the working weights' dtype)
    master_dtype: torch.dtype
    layouts: tuple[FlatLayout, ...]  # per group: buckets and this rank's shard of each
    order: tuple[tuple[int, int], ...]  # (group, bucket) in the order their gradients become final
    weights_on_host: bool  # offload_param: the working shards live in host memory
    sharded_stage: bool  # ZeRO stage 3's units: gradients arrive by reduce-scatter
    world_size: int
    machine: MachineFacts

    @property
    def shard_numel(self) -> int:
        return sum(layout.shard_numel for layout in self.layouts)


@dataclass(frozen=True)
class OffloadPlan:
    """What `HostMasters` runs: every choice of the offloaded step, made."""

    landing: LandingChoice
    update: UpdateChoice
    spans: tuple[Span, ...]  # in landing order
    stream: bool  # gradients land (and may update) during backward, from hooks
    pin: bool  # host buffers that a copy engine touches are page-locked
    warnings: tuple[str, ...] = ()  # for rank 0's log
    speculate: bool = False  # a checked step streams into a second copy of the state (plan_speculation)
    speculation: str = ""  # why (or why not), for rank 0's log

    @property
    def order(self) -> list[tuple[int, int]]:
        return [(span.group, span.bucket) for span in self.spans]


def plan_offload(settings: OffloadSettings, facts: OffloadFacts) -> OffloadPlan:
    """This rank's plan (before the ranks agree on it: machine.agree)."""
    machine = facts.machine
    landing = plan_landing(
        facts.grad_dtype,
        facts.master_dtype,
        setting=settings.grad_transfer,
        on_gpu=machine.on_gpu,
        weights_on_host=facts.weights_on_host,
        shard_numel=facts.shard_numel,
        local_ranks=machine.local_ranks,
        host_available=machine.host_available,
    )
    share = settings.host_share
    if share is None:
        share = default_host_share(machine.local_ranks, settings.one_rank_host_share)
    update = plan_update(
        setting=settings.update,
        on_gpu=machine.on_gpu,
        adam=True,  # HostMasters.bind checks the optimizer the engine builds later
        weights_on_host=facts.weights_on_host,
        pinned=settings.pin_memory,
        shard_numel=facts.shard_numel,
        local_ranks=machine.local_ranks,
        host_available=machine.host_available if machine.on_gpu else None,
        device_free=machine.device_free if machine.on_gpu else None,
        host_share=share,
        staging=staging_bytes(settings.device_chunk_elems, settings.device_slots),
    )
    pin = settings.pin_memory and machine.can_pin and machine.on_gpu
    # Gradients can stream during backward only when nothing is left to reduce (one rank, and not the
    # sharded stage 3, whose gradients arrive by reduce-scatter) and a copy does not block the autograd
    # thread (pinned memory on CUDA; on CPU every copy is synchronous).
    stream = facts.world_size == 1 and not facts.sharded_stage and (not machine.on_gpu or pin)
    warnings: tuple[str, ...] = ()
    if machine.on_gpu and not pin:
        warnings = (
            "offload_optimizer.pin_memory is false: gradients and weights cross PCIe through pageable "
            "memory, which is slower and does not overlap with backward; set pin_memory: true",
        )
    spans = tuple(plan_spans(facts.layouts, facts.order))
    speculate, why = plan_speculation(
        setting=settings.speculate,
        stream=stream,
        device_step=update.on_device,
        host_share=update.host_share if update.on_device else 1.0,
        state_itemsize=torch.tensor([], dtype=facts.master_dtype).element_size(),
        shard_numel=facts.shard_numel,
        local_ranks=machine.local_ranks,
        host_available=machine.host_available,
    )
    return OffloadPlan(landing, update, spans, stream, pin, warnings, speculate, why)


def plan_speculation(
    *,
    setting: bool | None,
    stream: bool,
    device_step: bool,
    host_share: float,
    state_itemsize: int,
    shard_numel: int,
    local_ranks: int,
    host_available: int,
) -> tuple[bool, str]:
    """Whether a checked step without clipping updates during backward (runtime/offload/step/speculative.py:
    the new master and moments go to a second copy, swapped in on a finite verdict), and why. Only where
    gradients stream (one rank); `setting` True or False decides. None (auto): where the GPU runs the
    whole step (`device_step`, no `host_share`), whose downloads then only land elsewhere, and the host
    has room for the second copy (3 x `state_itemsize` bytes a parameter, pinned) beside the pinned state.
    Not for the CPU's step: its copy into the second buffer costs host memory traffic (40 bytes a
    parameter against 28; 1.4-2x the CPU's update on the 2-core dev box), which only pays where the
    update is much shorter than the backward it overlaps, a ratio the plan does not know."""
    if not stream:
        return False, "the checked step waits for the verdict: gradients land after backward (several ranks)"
    if setting is not None:
        how = "updates during backward" if setting else "waits for the verdict"
        return setting, f"the checked step {how} (speculate={setting})"
    if not device_step or host_share > 0.0:
        return False, (
            "the checked step waits for the verdict: the CPU runs (part of) the update, and updating into a "
            "second copy of the state would cost it more memory traffic than waiting"
        )
    extra = 3 * state_itemsize
    need = (shard_numel * (PIN_ROOM_BYTES_PER_PARAM + extra) + HOST_HEADROOM) * local_ranks
    gib = 1 << 30
    if host_available < need:
        return False, (
            f"the checked step waits for the verdict: a second copy of the state ({extra} bytes a parameter) "
            f"would need {need / gib:.1f} GiB of host memory and {host_available / gib:.1f} GiB is available"
        )
    return True, (
        f"the checked step updates during backward into a second copy of the state ({extra} pinned host "
        "bytes a parameter), kept on a finite verdict"
    )


def plan_landing(
    grad_dtype: torch.dtype,
    master_dtype: torch.dtype,
    *,
    setting: str | None = None,
    on_gpu: bool,
    weights_on_host: bool,
    shard_numel: int,
    local_ranks: int,
    host_available: int,
) -> LandingChoice:
    """Whether 16-bit gradients land as fp32 (see the module docstring). `setting` is the key's value
    (None: auto); `host_available` the host's available bytes, shared by `local_ranks` ranks like this one."""
    key = LANDING_KEY
    if setting not in (None, "fp32", "native"):
        raise ValueError(f"{key} {setting!r}: expected 'fp32', 'native' or None (auto)")
    if grad_dtype == master_dtype:
        return LandingChoice(grad_dtype, f"gradients land as {_name(grad_dtype)}, the master's dtype")
    if master_dtype != torch.float32:  # the fused fp32 kernel is what fp32 landing buys
        return LandingChoice(grad_dtype, f"gradients land as {_name(grad_dtype)}: the master is not fp32")
    native = _name(grad_dtype)
    if weights_on_host:  # the kernel writes the new 16-bit weights straight into the offloaded shard
        return LandingChoice(grad_dtype, f"gradients land as {native}: offload_param updates on the host")
    if setting == "native":
        return LandingChoice(grad_dtype, f'gradients land as {native} ({key}: "native")')
    if setting == "fp32":
        return LandingChoice(torch.float32, f'gradients land as fp32 ({key}: "fp32")')
    if not on_gpu:
        return LandingChoice(grad_dtype, f"gradients land as {native}: no PCIe to trade bytes on")
    need = (shard_numel * FP32_LANDING_HOST_BYTES + HOST_HEADROOM) * local_ranks
    gib = 1 << 30
    if host_available < need:
        return LandingChoice(
            grad_dtype,
            f"gradients land as {native} (14 host bytes a parameter): fp32 landing, the faster host step, "
            f"needs {need / gib:.1f} GiB for {local_ranks} rank(s) here and {host_available / gib:.1f} GiB "
            "is available",
        )
    return LandingChoice(
        torch.float32,
        f"gradients land as fp32: 16 host bytes a parameter ({need / gib:.1f} GiB for {local_ranks} "
        f"rank(s) here, of {host_available / gib:.1f} GiB available) buy the fused host step; "
        f'{key}: "native" keeps 14',
    )


def default_host_share(local_ranks: int, one_rank: float) -> float:
    """The CPU's share with `local_ranks` ranks on this host, from `one_rank`, the share that balances one
    rank's halves. Each rank's GPU has its own PCIe link, but the ranks split the host's cores, so a rank's
    CPU half takes `local_ranks` times as long: with r = (1 - one_rank) / one_rank, the time the CPU takes
    per element over the GPU's, the balance is 1 / (1 + local_ranks * r)."""
    if one_rank <= 0.0 or local_ranks < 1:
        return 0.0
    return 1.0 / (1.0 + local_ranks * (1.0 - one_rank) / one_rank)


def plan_update(
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
    host_share: float = 0.0,
    staging: int | None = None,
) -> UpdateChoice:
    """The update site for this run. `setting` is `offload_optimizer.update`: host or device when it says
    so (device only where it can run), else (None: auto) device exactly where it can run and pays: a GPU,
    Adam or AdamW, pinned host state, working weights on the device, host memory with room to pin the
    state (`host_available` bytes shared by `local_ranks` ranks) and a device with room for the `staging`
    slots (default: the fewest slots of the default chunk; at most 1/8 of its `device_free` bytes: the
    model came to the GPU already, its activations have not); None: not checked. With the device, the
    CPU still updates `host_share` of the elements."""
    key = UPDATE_KEY
    if setting not in (None, "host", "device"):
        raise ValueError(f"{key} {setting!r}: expected 'host', 'device' or None (auto)")
    if setting == "host":
        return UpdateChoice(False, f'the CPU runs the Adam step ({key}: "host")')
    blocker = None
    if not adam:
        blocker = "the optimizer is not Adam or AdamW (or uses options the fused kernel lacks)"
    elif weights_on_host:
        blocker = "offload_param keeps the working weights in host memory"
    elif on_gpu and not pinned:
        blocker = "offload_optimizer.pin_memory is false, and the state could not stream asynchronously"
    if setting == "device":
        if blocker is not None:
            return UpdateChoice(False, f'the CPU runs the Adam step although {key} is "device": {blocker}')
        return UpdateChoice(
            True,
            f'the GPU runs the Adam step on state streamed from host memory ({key}: "device")'
            + _sharing(host_share),
            host_share,
        )
    if not on_gpu:
        return UpdateChoice(False, "the CPU runs the Adam step (no GPU)")
    if blocker is not None:
        return UpdateChoice(False, f"the CPU runs the Adam step: {blocker}")
    gib = 1 << 30
    need = (shard_numel * PIN_ROOM_BYTES_PER_PARAM + HOST_HEADROOM) * local_ranks
    if host_available is not None and host_available < need:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: streaming the state through the GPU pins all of it, and this host "
            f"has {host_available / gib:.1f} GiB available of the {need / gib:.1f} GiB that {local_ranks} "
            f'rank(s) would want; {key}: "device" insists',
        )
    staging = staging_bytes() if staging is None else staging
    if device_free is not None and staging * 8 > device_free:
        return UpdateChoice(
            False,
            f"the CPU runs the Adam step: the GPU has {device_free / gib:.1f} GiB free, too little to spare "
            f"{staging / gib:.2f} GiB for the device step's staging; "
            f'{key}: "device" insists',
        )
    return UpdateChoice(
        True,
        "the GPU runs the Adam step on state streamed from pinned host memory (24 bytes a parameter over "
        f'PCIe, no CPU pass over host memory){_sharing(host_share)}; {key}: "host" runs it all on the '
        "CPU",
        host_share,
    )


def staging_bytes(chunk_elems: int | None = None, slots: int | None = None) -> int:
    """Device bytes of the device step's slots: master, both moments and the fp32 gradient per element."""
    chunk = align_up(DEVICE_CHUNK_ELEMS if chunk_elems is None else chunk_elems, CHUNK_ALIGN)
    return (DEVICE_SLOTS if slots is None else slots) * 4 * chunk * 4


def device_slots(device_free: int, chunk_elems: int | None = None) -> int:
    """How many staging slots to allocate on a device with `device_free` bytes free: as many as fit in
    1/SLOTS_SHARE_OF_FREE of it, from DEVICE_SLOTS to MAX_DEVICE_SLOTS."""
    fits = device_free // SLOTS_SHARE_OF_FREE // staging_bytes(chunk_elems, 1)
    return max(DEVICE_SLOTS, min(MAX_DEVICE_SLOTS, fits))


def _sharing(share: float) -> str:
    if share == 0.0:
        return ""
    return f", and the CPU updates {share:.0%} of the elements at the same time ({SHARE_KEY})"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
