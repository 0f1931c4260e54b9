"""Activation checkpoints kept in host memory (``activation_checkpointing.cpu_checkpointing``).

The stash (runtime.sequence.host_stash) gives back exactly what it was given, from separate host memory,
and prefetches in backward order; a tiny HF Llama whose layers checkpoint through
runtime.activation_checkpointing (``hf_checkpointing``) trains like the plain model; on CUDA (``gpu``) the
checkpointed inputs really live in pinned host memory, the GPU keeps less, and losses and gradients equal
on-device checkpoints.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from runtime import activation_checkpointing
from runtime.sequence.host_stash import HostStash, pinned_pieces

VOCAB, SEQ = 64, 24


@pytest.fixture(autouse=True)
def fresh_settings() -> Any:
    """Checkpointing options are process-wide: start and end with the defaults."""
    activation_checkpointing.configure()
    activation_checkpointing.take_profile()
    yield
    activation_checkpointing.configure()


def test_stash_returns_the_values_from_host_copies_and_prefetches_backwards() -> None:
    stash = HostStash()
    inputs = [torch.randn(3, 5) * i for i in range(4)]
    copies = [stash.put(t) for t in inputs]
    for t, c in zip(inputs, copies, strict=True):
        (host,) = c.pieces  # 60 bytes: one page-sized block
        assert host.device.type == "cpu" and host.data_ptr() != t.data_ptr()  # a copy, not the tensor
        assert torch.equal(host.view(3, 5), t)
    # backward takes the last first; each take starts bringing back the one before it
    assert torch.equal(stash.take(copies[3]), inputs[3])
    assert copies[2].prefetched is not None and copies[1].prefetched is None
    assert torch.equal(stash.take(copies[2]), inputs[2])
    assert torch.equal(stash.take(copies[1]), inputs[1])
    assert torch.equal(stash.take(copies[0]), inputs[0])
    assert stash.prefetched == 3  # every take but the first found its tensor already on the way
    assert torch.equal(stash.take(copies[2]), inputs[2])  # taken again (retain_graph): still there


def test_a_long_input_is_kept_in_power_of_two_blocks_within_a_64th_of_its_size() -> None:
    """torch's pinned allocator rounds a block up to a power of two (1.24 GiB took 2 GiB on the H200): the
    stash asks only for powers of two, a few of them, and the values come back whole and in order."""
    layer_input = 162_816 * 4096 * 2  # the 8B shape's bf16 layer input at 162,816 tokens: 1.24 GiB
    pieces = pinned_pieces(layer_input)
    assert pieces == [1 << 30, 1 << 28]  # 1.25 GiB: 0.6% over, where one block would be 2 GiB
    for nbytes in (1, 4095, 4097, 3 * (1 << 20) + 5, layer_input, 123_456_789_012):
        got = pinned_pieces(nbytes)
        assert all(p & (p - 1) == 0 for p in got) and got == sorted(got, reverse=True) and len(got) <= 8
        assert nbytes <= sum(got) <= max(nbytes + 4096, nbytes + nbytes // 64)
    stash = HostStash()
    data = torch.arange(10_000, dtype=torch.float32).view(100, 100)[:, ::2]  # not contiguous: 20,000 bytes
    copy = stash.put(data)
    assert [p.numel() for p in copy.pieces] == [4096, 904]  # 16 KiB + 4 KiB blocks, the second part-used
    assert torch.equal(stash.take(copy), data)


def _llama(device: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def _losses_and_grads(device: str, checkpoint: bool, cpu: bool) -> dict[str, Any]:
    model = _llama(device)
    if checkpoint:
        activation_checkpointing.configure(checkpoint_in_cpu=cpu, profile=True)
        activation_checkpointing.hf_checkpointing(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, kept = [], []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        kept.append(activation_checkpointing.take_profile())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    recomputed = sum(k.recompute_calls for k in kept)
    recomputed += activation_checkpointing.take_profile().recompute_calls
    return {
        "losses": losses,
        "weights": [p.detach().cpu() for p in model.parameters()],
        "kept": kept,
        "recomputed": recomputed,
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
    for x, y in zip(a["weights"], b["weights"], strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_hf_layers_checkpoint_through_runtime_with_cpu_checkpointing_on() -> None:
    plain = _losses_and_grads("cpu", checkpoint=False, cpu=False)
    kept_on_host = _losses_and_grads("cpu", checkpoint=True, cpu=True)
    _assert_same(kept_on_host, plain)
    assert kept_on_host["recomputed"] == 2 * 3  # every layer of both steps went through our checkpoint
    # what the host copies would take on a GPU: exactly the three layers' inputs (on the CPU they stay put)
    layer_input = 2 * SEQ * 32 * 4  # [batch, seq, hidden] fp32
    assert [k.device_bytes_kept for k in kept_on_host["kept"]] == [3 * layer_input] * 2


@pytest.mark.gpu
def test_checkpointed_inputs_live_in_pinned_host_memory_on_cuda() -> None:
    on_device = _losses_and_grads("cuda", checkpoint=True, cpu=False)
    taken: list[Any] = []
    put = HostStash.put

    def spy(self: HostStash, data: torch.Tensor) -> Any:
        copy = put(self, data)
        taken.append(copy)
        return copy

    HostStash.put = spy  # type: ignore[method-assign]
    try:
        on_host = _losses_and_grads("cuda", checkpoint=True, cpu=True)
    finally:
        HostStash.put = put  # type: ignore[method-assign]
    _assert_same(on_host, on_device)
    assert len(taken) == 2 * 3  # one input per layer and step
    assert all(all(h.device.type == "cpu" and h.is_pinned() for h in c.pieces) for c in taken)
    layer_input = 2 * SEQ * 32 * 4  # [batch, seq, hidden] fp32
    assert on_host["kept"][0].host_bytes_kept == 3 * layer_input
    assert on_device["kept"][0].host_bytes_kept == 0


@pytest.mark.gpu
def test_backward_keeps_two_inputs_on_the_gpu_while_the_cpu_runs_ahead_of_it() -> None:
    """Taking input k brings k-1 back ahead of need, so the GPU holds those two; the one used before is
    freed in stream order and reused by the next prefetch, even while the GPU runs far behind the CPU
    (at 131K tokens the 1B's trace showed a third input held: its free waited on a stream event)."""
    count, numel = 6, 16 << 20  # six 64 MiB inputs
    stash = HostStash()
    copies = [stash.put(torch.full((numel,), float(i), device="cuda")) for i in range(count)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seen = []
    for i in reversed(range(count)):
        data = stash.take(copies[i])
        torch.cuda._sleep(20_000_000)  # a long block backward: the GPU falls behind the CPU
        seen.append(torch.stack([data.min(), data.max()]))
        del data
    torch.cuda.synchronize()
    assert [s.tolist() for s in seen] == [[float(i), float(i)] for i in reversed(range(count))]
    assert torch.cuda.max_memory_allocated() - base <= 2 * numel * 4 + (1 << 20)
    assert stash.prefetched == count - 1


@pytest.mark.gpu
def test_a_prefetch_never_taken_is_freed_only_after_its_copy() -> None:
    """A graph dropped before its backward leaves a prefetched input unused: its memory goes back to the
    compute stream only after the side stream's copy into it, so what is allocated there next keeps its
    values."""
    numel = 32 << 20
    stash = HostStash()
    copies = [stash.put(torch.full((numel,), float(i + 1), device="cuda")) for i in range(2)]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy so the copy is still pending on the GPU
    assert stash.take(copies[1]).min().item() == 2.0  # and copies[0] is now on its way back
    del copies, stash  # never taken
    reused = torch.zeros(numel, device="cuda")  # may get the dropped prefetch's memory
    torch.cuda.synchronize()
    assert reused.abs().max().item() == 0.0
