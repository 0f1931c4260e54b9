"""The offload's plan (runtime/offload/plan.py), table by table, with no engine: spans and chunks, the
shared step's heads and tails, the device step's slots, what lands, where Adam runs and the CPU's share;
the facts it reads from this machine (runtime/offload/machine.py); and the ranks' agreement, on 3 gloo
ranks (the only tests here that start processes).

Behaviour is chosen through the plan's inputs (`OffloadSettings`, `MachineFacts`), never by overwriting a
module constant.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.dist import run_distributed


def test_spans_follow_landing_order_and_chunks_tile_each_span() -> None:
    from runtime.offload.io.spans import piece_containing, plan_chunks, plan_spans
    from runtime.zero.partition import plan_flat_layout

    layouts = [
        plan_flat_layout([100, 300, 50], world_size=2, bucket_numel=320, align=64),
        plan_flat_layout([1000], world_size=2, bucket_numel=320, align=64),
    ]
    order = [(1, 0), (0, 2), (0, 1), (0, 0)]  # buckets of 100 | 300 | 50 and of 1000
    spans = plan_spans(layouts, order)
    assert [(s.group, s.bucket) for s in spans] == order
    for span in spans:
        bucket = layouts[span.group].buckets[span.bucket]
        assert (span.shard_offset, span.numel) == (bucket.shard_offset, bucket.piece_numel)
    with pytest.raises(ValueError, match="every"):
        plan_spans(layouts, order[:3])
    chunks = plan_chunks(1000, 300)  # rounded up to whole cache lines: 320
    assert chunks == [(0, 320), (320, 320), (640, 320), (960, 40)]
    assert plan_chunks(1000, 0) == [(0, 1000)] and plan_chunks(0, 64) == []
    # stage-1 pieces (one per bucket) tile the shard; a bucket's range lies inside exactly one of them
    sizes = [b.piece_numel for b in layouts[0].buckets]
    assert piece_containing(sizes, layouts[0].buckets[1].shard_offset, sizes[1]) == (1, 0)
    with pytest.raises(ValueError, match="not inside one piece"):
        piece_containing(sizes, sizes[0] - 1, 2)


def test_a_shared_step_gives_the_cpu_each_spans_tail_and_packs_the_tails_buffers() -> None:
    """With the GPU and the CPU sharing the step, each span is split at a cache line: the GPU's head and
    the CPU's tail of about the asked share (so both work on every span at once, whatever the number of
    spans), and the tails land in buffers just their size."""
    from runtime.offload.io.spans import CHUNK_ALIGN, Span, packed_offsets, share_span

    span = Span(1, 3, 5000, 1000)
    head, tail = share_span(span, 0.4)
    assert (head, tail) == (Span(1, 3, 5000, 640), Span(1, 3, 5640, 360))  # 600 rounded up to 640
    assert head.numel % CHUNK_ALIGN == 0 and head.numel + tail.numel == span.numel
    assert share_span(span, 0.0) == (span, Span(1, 3, 6000, 0))
    assert share_span(span, 1.0) == (Span(1, 3, 5000, 0), span)
    assert share_span(Span(0, 0, 0, 0), 0.5)[1].numel == 0
    with pytest.raises(ValueError, match="between 0 and 1"):
        share_span(span, 1.5)
    # landing order: group 0's second bucket first; tails packed in shard order per group
    spans = [Span(0, 1, 1000, 1000), Span(1, 0, 0, 500), Span(0, 0, 0, 1000)]
    tails = [share_span(s, 0.5)[1] for s in spans]
    assert [t.numel for t in tails] == [488, 244, 488]  # heads of 512 and 256
    offsets, lengths = packed_offsets(tails, groups=2)
    assert offsets == [488, 0, 0] and lengths == [976, 244]


def test_the_device_step_stages_more_chunks_where_the_device_has_room() -> None:
    """More slots let the next step's first uploads, and this step's last downloads, overlap the
    forward; they take at most a sixteenth of the free memory, and never fewer than the minimum."""
    from runtime.offload.plan import (
        DEVICE_SLOTS,
        MAX_DEVICE_SLOTS,
        SLOTS_SHARE_OF_FREE,
        device_slots,
        staging_bytes,
    )

    slot = staging_bytes(None, 1)
    assert slot == 256 << 20  # 16M elements: master, both moments and the gradient in fp32
    assert device_slots(0) == DEVICE_SLOTS
    assert device_slots(SLOTS_SHARE_OF_FREE * slot * 10) == 10
    assert device_slots(SLOTS_SHARE_OF_FREE * slot * 10 - 1) == 9
    assert device_slots(141 << 30) == MAX_DEVICE_SLOTS  # an H200: 4 GiB of slots


def test_the_cpus_share_of_the_device_step_is_a_checked_fraction() -> None:
    from runtime.config.offload import parse_override
    from runtime.offload.plan import SHARE_KEY, default_host_share, plan_update

    # the benchmark override's reading (the config key's is checked with the other keys, below)
    assert parse_override("host_share", "0.35") == 0.35 and parse_override("host_share", "1") == 1.0
    assert parse_override("host_share", "AUTO") is None
    for bad in ("1.5", "-0.1", "half", "nan"):
        with pytest.raises(ValueError, match=f"DSLAUNCH_OFFLOAD_HOST_SHARE='{bad}': expected the fraction"):
            parse_override("host_share", bad)
    kwargs = dict(on_gpu=True, adam=True, weights_on_host=False, pinned=True)
    shared = plan_update(**kwargs, host_share=0.4)
    assert shared.on_device and shared.host_share == 0.4
    assert f"the CPU updates 40% of the elements at the same time ({SHARE_KEY})" in shared.reason
    assert SHARE_KEY not in plan_update(**kwargs, host_share=0.0).reason
    # ranks on one host split its cores but not their PCIe links: each rank's CPU takes less
    assert default_host_share(1, 0.4) == pytest.approx(0.4)
    assert default_host_share(2, 0.4) == pytest.approx(0.25) and default_host_share(8, 0.4) < 0.08
    assert default_host_share(4, 0.0) == 0.0


def test_gradients_land_as_fp32_on_a_gpu_only_when_the_host_has_room() -> None:
    """fp32 landing (the faster host step) costs 2 host bytes a parameter more: the default takes it on a
    GPU when every rank on the host fits, and says why it did or did not."""
    from runtime.offload.plan import LandingChoice, plan_landing

    gib = 1 << 30
    bf16, fp32 = torch.bfloat16, torch.float32

    def choose(
        setting: str | None = None,
        *,
        on_gpu: bool = True,
        on_host: bool = False,
        ranks: int = 1,
        available: int = 64 * gib,
    ) -> LandingChoice:
        return plan_landing(
            bf16,
            fp32,
            setting=setting,
            on_gpu=on_gpu,
            weights_on_host=on_host,
            shard_numel=1 << 30,
            local_ranks=ranks,
            host_available=available,
        )

    assert choose().dtype == fp32  # 1G parameters: 16 GiB + 4 GiB of headroom, of 64
    # every rank on the host takes its share: 4 ranks need 80 GiB
    tight = choose(ranks=4)
    assert tight.dtype == bf16
    assert "needs 80.0 GiB for 4 rank(s)" in tight.reason and "64.0 GiB is available" in tight.reason
    assert choose(on_gpu=False).dtype == bf16  # no PCIe on a CPU-only machine: nothing to gain
    assert choose(on_host=True).dtype == bf16  # offload_param: the kernel writes bf16 weights on the host
    native = choose("native")
    assert native.dtype == bf16 and native.reason.endswith('(offload_optimizer.grad_transfer: "native")')
    assert choose("fp32", available=0).dtype == fp32  # asked for: the user's call
    # fp32 training has nothing to convert; bf16 masters have no fused fp32 step to gain
    for grad, master in ((fp32, fp32), (torch.float16, bf16)):
        kept = plan_landing(
            grad, master, on_gpu=True, weights_on_host=False, shard_numel=1, local_ranks=1, host_available=0
        )
        assert kept.dtype == grad, kept
    assert "not fp32" in kept.reason
    with pytest.raises(ValueError, match="grad_transfer 'bf32': expected 'fp32', 'native' or None"):
        choose("bf32")


def test_landing_follows_its_key_and_counts_the_ranks_any_launcher_put_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grad_transfer decides when set; "auto" (None) weighs the host's memory against the ranks sharing the
    host, counted from whichever launcher started them."""
    from runtime.distributed import LOCAL_SIZE_VARIABLES, DistEnvError
    from runtime.offload.machine import read_machine
    from runtime.offload.plan import plan_landing

    def choice(setting: str | None = None) -> torch.dtype:
        machine = read_machine(torch.device("cpu"))  # this process's ranks per host and host memory
        kwargs = dict(on_gpu=True, weights_on_host=False, shard_numel=1 << 20)
        kwargs.update(local_ranks=machine.local_ranks, host_available=machine.host_available)
        return plan_landing(torch.bfloat16, torch.float32, setting=setting, **kwargs).dtype

    for name in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert choice("native") == torch.bfloat16
    assert choice() == torch.float32  # auto, and 16 MiB of shard fits any host
    # a million ranks on this host (srun's "N(xM)" form) leave no room for 16 bytes a parameter each
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1000000(x2)")
    assert choice() == torch.bfloat16
    assert choice("fp32") == torch.float32  # asked for: the user's call
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")  # the first variable set wins, and must be a count
    with pytest.raises(DistEnvError, match="LOCAL_WORLD_SIZE='four' is not a rank count"):
        choice()


def _facts(layouts: tuple, machine) -> object:
    from runtime.offload.plan import OffloadFacts

    return OffloadFacts(
        grad_dtype=torch.bfloat16,
        master_dtype=torch.float32,
        layouts=layouts,
        order=tuple((g, b.index) for g, layout in enumerate(layouts) for b in reversed(layout.buckets)),
        weights_on_host=False,
        sharded_stage=False,
        world_size=1,
        machine=machine,
    )


def test_the_cpus_share_comes_from_its_key_and_shrinks_with_ranks_per_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtime.config.offload import OffloadSettings
    from runtime.distributed import LOCAL_SIZE_VARIABLES
    from runtime.offload.machine import read_machine
    from runtime.offload.plan import plan_offload
    from runtime.zero.partition import plan_flat_layout

    layouts = (plan_flat_layout([1 << 20], world_size=1, bucket_numel=1 << 18, align=64),)

    def share(host_share: float | None, **internal: float) -> float:
        settings = OffloadSettings(device="cpu", update="device", host_share=host_share, **internal)
        plan = plan_offload(settings, _facts(layouts, read_machine(torch.device("cpu"))))
        assert plan.update.on_device, plan.update.reason
        return plan.update.host_share

    for name in LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert share(0.3) == 0.3  # asked for: taken as it is, whatever the ranks
    assert share(None) == 0.0  # auto: the CPU takes no share by default
    assert share(None, one_rank_host_share=0.4) == pytest.approx(0.4)  # were the default a share ...
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # ... two ranks would split this host's cores
    assert share(None, one_rank_host_share=0.4) == pytest.approx(0.25)
    assert share(0.3) == 0.3


def test_the_plan_streams_pins_and_warns_from_the_machine_it_runs_on() -> None:
    """Gradients stream during backward only with one rank, not the sharded stage 3, and copies that do
    not block autograd (pinned on a GPU, any copy on a CPU); pageable memory on a GPU is warned about; the
    spans come in the order the facts give."""
    from runtime.config.offload import OffloadSettings
    from runtime.offload.plan import MachineFacts, plan_offload
    from runtime.zero.partition import plan_flat_layout

    layouts = (plan_flat_layout([300, 500], world_size=1, bucket_numel=256, align=64),)
    gpu = MachineFacts(on_gpu=True, can_pin=True, local_ranks=1, host_available=1 << 40, device_free=1 << 40)
    cpu = MachineFacts(on_gpu=False, can_pin=False, local_ranks=1, host_available=1 << 40, device_free=None)
    pinned = OffloadSettings(device="cpu", pin_memory=True)
    plan = plan_offload(pinned, _facts(layouts, gpu))
    assert plan.stream and plan.pin and not plan.warnings
    assert plan.order == list(_facts(layouts, gpu).order)
    assert [s.numel for s in plan.spans] == [b.piece_numel for b in reversed(layouts[0].buckets)]
    pageable = plan_offload(replace(pinned, pin_memory=False), _facts(layouts, gpu))
    assert not pageable.stream and not pageable.pin
    assert pageable.warnings and "pin_memory is false" in pageable.warnings[0]
    on_cpu = plan_offload(pinned, _facts(layouts, cpu))
    assert on_cpu.stream and not on_cpu.pin and not on_cpu.warnings  # nothing to pin without CUDA
    ranks = replace(_facts(layouts, gpu), world_size=2)
    assert not plan_offload(pinned, ranks).stream  # more ranks: spans land after the reduction
    sharded = replace(_facts(layouts, gpu), sharded_stage=True)
    assert not plan_offload(pinned, sharded).stream  # stage 3: gradients come by reduce-scatter


def _landing_votes(rank: int, world_size: int) -> list[str]:
    from runtime.comm import Comm
    from runtime.offload.machine import agree_on_landing
    from runtime.offload.plan import LandingChoice

    comm = Comm()
    out = []
    for wants_fp32 in ([True] * world_size, [r == 0 for r in range(world_size)]):
        mine = LandingChoice(torch.float32 if wants_fp32[rank] else torch.bfloat16, "own")
        agreed = agree_on_landing(mine, torch.bfloat16, comm, torch.device("cpu"))
        out.append(f"{agreed.dtype} {agreed.reason}")
    return out


def test_ranks_land_fp32_only_when_every_rank_has_room() -> None:
    """Each rank reads its own host's memory; one without room for fp32 landing makes all land bf16."""
    results = run_distributed(_landing_votes, 3)
    for all_agree, one_fits in results:
        assert all_agree == "torch.float32 own"
        assert one_fits.startswith("torch.bfloat16") and "2 of 3 ranks have no room" in one_fits


def test_the_gpu_runs_the_adam_step_where_it_can_and_the_host_has_room_to_pin() -> None:
    """The device step needs a GPU, Adam, pinned state and the working weights on the device; "auto" also
    wants the host to have room to pin the state and the GPU room for the staging, and every refusal
    says why."""
    from runtime.offload.plan import UPDATE_KEY as KEY
    from runtime.offload.plan import plan_update

    gib = 1 << 30

    def choose(setting: str | None = None, **overrides):
        kwargs = dict(on_gpu=True, adam=True, weights_on_host=False, pinned=True, shard_numel=1 << 30)
        kwargs.update(
            local_ranks=overrides.pop("ranks", 1), host_available=overrides.pop("available", 64 * gib)
        )
        return plan_update(setting=setting, **{**kwargs, **overrides})

    assert choose().on_device  # 1G parameters: 16 GiB + 4 GiB of headroom, of 64
    tight = choose(ranks=4)  # four ranks would want 80 GiB
    assert not tight.on_device and "64.0 GiB available of the 80.0 GiB that 4 rank(s)" in tight.reason
    assert choose("device", ranks=4).on_device  # asked for: the user's call
    # the staging slots (1 GiB by default) may take at most an eighth of the GPU's free memory
    assert choose(device_free=8 * gib).on_device
    cramped = choose(device_free=6 * gib)
    assert not cramped.on_device and "6.0 GiB free, too little to spare 1.00 GiB" in cramped.reason
    assert choose("device", device_free=0).on_device
    assert choose("host").reason.endswith(f'({KEY}: "host")')
    assert not choose(on_gpu=False).on_device  # on a CPU-only machine the host is the device
    assert choose("device", on_gpu=False).on_device  # ... unless asked for (the tests' way in)
    for blocked, words in (
        ({"adam": False}, "not Adam or AdamW"),
        ({"weights_on_host": True}, "offload_param"),
        ({"pinned": False}, "pin_memory is false"),
    ):
        for setting in (None, "device"):
            refused = choose(setting, **blocked)
            assert not refused.on_device and words in refused.reason, refused
    with pytest.raises(ValueError, match=f"{KEY} 'gpu': expected 'host', 'device' or None"):
        choose("gpu")


def _update_votes(rank: int, world_size: int) -> list[str]:
    from runtime.comm import Comm
    from runtime.offload.machine import agree_on_update
    from runtime.offload.plan import UpdateChoice

    comm = Comm()
    out = []
    for on_device in ([True] * world_size, [r != 1 for r in range(world_size)]):
        agreed = agree_on_update(UpdateChoice(on_device[rank], "own"), comm, torch.device("cpu"))
        out.append(f"{agreed.on_device} {agreed.reason}")
    return out


def test_ranks_run_the_device_step_only_when_every_rank_can() -> None:
    for all_agree, one_cannot in run_distributed(_update_votes, 3):
        assert all_agree == "True own"
        assert one_cannot.startswith("False") and "1 of 3 ranks cannot stream" in one_cannot
