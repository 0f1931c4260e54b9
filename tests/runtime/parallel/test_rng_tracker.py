"""The model-parallel random streams (runtime.parallel.rng, DeepSpeed's ``deepspeed.checkpointing``
names): `fork()` draws from a named stream and leaves the default one as it was; the seeding rule
(default stream `seed`, model stream `seed + 2718 + model rank`); states saved and restored; exact errors;
and activation checkpointing replaying the streams, so recomputed dropout inside `fork()` draws the
forward's masks (gradients equal to a run without checkpointing). One process, CPU generator (a `gpu`
test checks that under CUDA the device generator carries the streams); the cross-rank behaviour (masks
differ over tensor-parallel ranks, agree outside `fork()`) is checked at world 4 in
tests/runtime/parallel/test_mpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime import activation_checkpointing
from runtime.parallel.rng import MODEL_PARALLEL_RNG, get_cuda_rng_tracker, model_parallel_cuda_manual_seed


@pytest.fixture(autouse=True)
def fresh_tracker() -> Iterator[None]:
    """The tracker and the checkpointing options are process-wide: start and end empty."""
    get_cuda_rng_tracker().reset()
    activation_checkpointing.configure()
    yield
    get_cuda_rng_tracker().reset()
    activation_checkpointing.configure()


def _drawn(seed: int, n: int = 6) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


class _RankOnly:
    """An mpu as far as the seeding rule needs one: its model-parallel rank."""

    def __init__(self, rank: int, *, newer_names: bool = False) -> None:
        self.rank = rank
        if newer_names:  # Megatron's newer spelling takes precedence over get_model_parallel_rank
            self.get_tensor_model_parallel_group = lambda: None
            self.get_tensor_model_parallel_world_size = lambda: 2
            self.get_tensor_model_parallel_rank = lambda: rank
            self.rank = 99

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 2

    def get_model_parallel_rank(self) -> int:
        return self.rank


def test_fork_draws_from_its_stream_and_leaves_the_default_one_alone() -> None:
    tracker = get_cuda_rng_tracker()
    torch.manual_seed(5)
    tracker.add("split", 123)
    first = torch.rand(3)
    with tracker.fork("split"):
        inside = torch.rand(6)
    second = torch.rand(3)
    with tracker.fork("split"):
        inside_again = torch.rand(6)
    torch.manual_seed(5)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))  # as if fork had never run
    stream = _drawn(123, 12)
    assert torch.equal(inside, stream[:6]) and torch.equal(inside_again, stream[6:])  # it continues


def test_states_round_trip_and_reset() -> None:
    tracker = get_cuda_rng_tracker()
    tracker.add("a", 1)
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(4)
    assert not torch.equal(tracker.get_states()["a"], saved["a"])  # the stream advanced, the copy did not
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), first)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # name and seed are free again


def test_bad_use_is_refused_by_name() -> None:
    tracker = get_cuda_rng_tracker()
    tracker.add("a", 7)
    with pytest.raises(ValueError) as seed_reuse:
        tracker.add("b", 7)
    assert str(seed_reuse.value) == "RNG tracker: seed 7 already starts another stream; give 'b' its own"
    with pytest.raises(ValueError) as name_reuse:
        tracker.add("a", 8)
    assert str(name_reuse.value) == "RNG tracker: a stream named 'a' exists already (reset() forgets it)"
    with pytest.raises(RuntimeError) as unknown, tracker.fork():
        pass
    assert str(unknown.value) == (
        "RNG tracker: no stream named 'model-parallel-rng'; seed it first with "
        "model_parallel_cuda_manual_seed(seed) (or get_cuda_rng_tracker().add(name, seed))"
    )


@pytest.mark.parametrize("newer_names", [False, True], ids=["get_model_parallel_rank", "tensor_names"])
def test_seeding_rule_default_stream_seed_model_stream_seed_2718_rank(newer_names: bool) -> None:
    draws = {}
    for rank in (0, 1):
        model_parallel_cuda_manual_seed(1000, mpu=_RankOnly(rank, newer_names=newer_names))
        outside = torch.rand(6)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(6)
        draws[rank] = (outside, inside)
        assert torch.equal(outside, _drawn(1000)), rank
        assert torch.equal(inside, _drawn(1000 + 2718 + rank)), rank
    assert torch.equal(draws[0][0], draws[1][0]) and not torch.equal(draws[0][1], draws[1][1])
    assert list(get_cuda_rng_tracker().get_states()) == [MODEL_PARALLEL_RNG]


def test_seeding_takes_the_rank_from_configure_and_without_an_mpu_rank_0() -> None:
    model_parallel_cuda_manual_seed(40)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(6), _drawn(40 + 2718))
    activation_checkpointing.configure(_RankOnly(1))
    model_parallel_cuda_manual_seed(40)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(6), _drawn(40 + 2718 + 1))


class _TPBlock(nn.Module):
    """Dropout as a tensor-parallel layer has it: on the split activation inside fork(), on the
    replicated one outside."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork():
            h = F.dropout(torch.relu(self.up(x)), p=0.5, training=True)
        return F.dropout(self.down(h), p=0.3, training=True) + x


def _grads(use_checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_TPBlock() for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    model_parallel_cuda_manual_seed(77, mpu=_RankOnly(1))
    h = x
    for block in blocks:
        h = activation_checkpointing.checkpoint(block, h) if use_checkpoint else block(h)
    h.square().sum().backward()
    with get_cuda_rng_tracker().fork():  # where the stream stands after the step
        after = torch.rand(4)
    return h.detach(), [p.grad for p in blocks.parameters()] + [x.grad], after


def test_recomputation_replays_the_streams_so_gradients_equal_the_plain_run() -> None:
    out, grads, after = _grads(use_checkpoint=False)
    ckpt_out, ckpt_grads, ckpt_after = _grads(use_checkpoint=True)
    assert torch.equal(out, ckpt_out)
    for plain, checkpointed in zip(grads, ckpt_grads, strict=True):
        assert torch.equal(plain, checkpointed)
    # the recomputations leave the stream where the forward left it
    assert torch.equal(after, ckpt_after)


def test_deepspeed_names_resolve_to_the_runtime() -> None:
    import deepspeed
    import deepspeed.runtime.activation_checkpointing.checkpointing as ds_ckpt

    from runtime.parallel import rng

    for module in (deepspeed.checkpointing, ds_ckpt):
        assert module.get_cuda_rng_tracker is rng.get_cuda_rng_tracker
        assert module.model_parallel_cuda_manual_seed is rng.model_parallel_cuda_manual_seed
        assert module.CudaRNGStatesTracker is rng.RNGStatesTracker
        assert module.configure is activation_checkpointing.configure


@pytest.mark.gpu
def test_on_cuda_the_streams_live_in_the_device_generator() -> None:
    tracker = get_cuda_rng_tracker()
    cpu_before = torch.get_rng_state()
    torch.cuda.manual_seed(3)
    tracker.add("split", 5)
    with tracker.fork("split"):
        inside = torch.rand(6, device="cuda")
    outside = torch.rand(6, device="cuda")
    torch.cuda.manual_seed(3)
    assert torch.equal(outside, torch.rand(6, device="cuda"))  # the default stream did not move
    stream = torch.Generator("cuda").manual_seed(5)
    assert torch.equal(inside, torch.rand(6, device="cuda", generator=stream))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator is not the one used
