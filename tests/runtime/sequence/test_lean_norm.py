"""The lean RMSNorm (runtime.sequence.lean_norm) against HF's LlamaRMSNorm: the same output bit for bit,
gradients as close as two orders of the same fp32 sums allow, a fraction of the bytes saved for backward;
several token counts (one tile, uneven last tile), bf16 and fp32 inputs, an fp32 weight under a bf16
input; the model-wide swap and its bad input; ZeRO-3 on 2 gloo ranks without recomputation. Device: CPU;
CUDA for the `gpu` test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runtime.errors import UserError
from runtime.sequence import lean_llama_norms, lean_norm

HIDDEN = 64


def _norm(weight_dtype: torch.dtype) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(HIDDEN))
    return norm.to(weight_dtype)


def _run(norm: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    norm.weight.grad = None
    y = norm(x)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, norm.weight.grad


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 units in the last place (at b's magnitude) a and b differ."""
    mantissa = 8  # bf16's significand bits
    exponent = torch.frexp(b.float().abs().clamp_min(1e-30)).exponent
    ulp = torch.ldexp(torch.ones_like(b, dtype=torch.float32), exponent - mantissa)
    return (a.float() - b.float()).abs() / ulp


@pytest.mark.parametrize("tokens", [5, HIDDEN * 3 + 7])  # one tile; four tiles, the last one short
@pytest.mark.parametrize(
    "x_dtype, weight_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["bf16", "fp32", "bf16-input-fp32-weight"],
)
def test_the_lean_norm_computes_what_hf_computes(
    tokens: int, x_dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (3.0 * torch.randn(2, tokens, HIDDEN, generator=gen)).to(x_dtype)
    g = torch.randn(2, tokens, HIDDEN, generator=gen)
    hf = _run(_norm(weight_dtype), x, g)
    lean = _run(lean_norm(_norm(weight_dtype)), x, g)
    assert torch.equal(lean[0], hf[0])  # the forward is HF's, op for op
    for got, want in zip(lean[1:], hf[1:], strict=True):  # the input's and the weight's gradients
        assert got.dtype == want.dtype
        if got.dtype == torch.float32:  # sums of hundreds of terms in another order: fp32's own noise
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            continue
        apart = _ulps_apart(got, want)  # the same fp32 sums, rounded to bf16: mostly equal, never far
        assert bool((apart <= 2).all()), float(apart.max())
        assert float((apart > 0).float().mean()) < 0.05


def test_an_empty_sequence_has_empty_gradients() -> None:
    x = torch.zeros(2, 0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    norm = lean_norm(_norm(torch.bfloat16))
    norm(x).sum().backward()
    assert x.grad.shape == x.shape and bool((norm.weight.grad == 0).all())


def test_backward_keeps_the_16_bit_input_and_one_fp32_a_row() -> None:
    """What a long sequence's layer holds through its backward: HF's norm keeps the fp32 upcast (4 bytes an
    element) and the normalized 16-bit value (2 more); the lean one its bf16 input and the reciprocal RMS."""
    x = torch.randn(1, 1000, HIDDEN, dtype=torch.bfloat16, requires_grad=True)

    def saved_bytes(norm: nn.Module) -> int:
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        return sum(kept.values())

    elements = x.numel()
    assert saved_bytes(_norm(torch.bfloat16)) >= 6 * elements
    assert saved_bytes(lean_norm(_norm(torch.bfloat16))) == 2 * elements + 4 * 1000


def test_every_norm_of_a_llama_is_swapped_and_its_state_dict_unchanged() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=50, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    keys = list(model.state_dict())
    ids = torch.randint(0, 50, (2, 12))
    plain = model(input_ids=ids, labels=ids).loss
    assert lean_llama_norms(model) == 5  # two a layer and the final one
    assert list(model.state_dict()) == keys
    assert torch.equal(model(input_ids=ids, labels=ids).loss, plain)
    lean_llama_norms(model)  # twice: the same
    assert torch.equal(model(input_ids=ids, labels=ids).loss, plain)


def test_a_model_or_module_without_an_rms_norm_is_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="lean_llama_norms: Sequential has no RMSNorm module"):
        lean_llama_norms(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    with pytest.raises(UserError, match="lean_norm: LayerNorm is not an RMSNorm"):
        lean_norm(nn.LayerNorm(4))


def _zero3_losses(rank: int, world_size: int, lean: bool) -> list[float]:
    import runtime
    from tests.runtime.sequence.test_tiled import SEQ, VOCAB, _llama

    model = _llama()
    if lean:
        lean_llama_norms(model)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = runtime.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    engine.destroy()
    return losses


def _plain_and_lean(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    return _zero3_losses(rank, world_size, False), _zero3_losses(rank, world_size, True)


def test_zero3_without_recomputation_trains_the_same_with_lean_norms() -> None:
    """ZeRO-3 releases the norm's weight after forward and gathers it again for backward, where the lean
    norm reads the weight it saved: the losses of HF's norms, step for step, on 2 gloo ranks."""
    from tests.support.dist import run_distributed

    for plain, lean in run_distributed(_plain_and_lean, 2, timeout=180):
        assert lean[0] == plain[0]  # the forward is HF's bit for bit
        assert lean == pytest.approx(plain, rel=1e-5)  # the gradients, as close as their fp32 sums


@pytest.mark.gpu
def test_on_cuda_the_lean_norm_is_hfs_output_and_holds_a_fraction_of_the_memory() -> None:
    """CUDA, a long sequence's shape (8 tiles of rows): the output bit for bit, gradients within 2 bf16
    ulps; what the allocator holds between forward and backward (the output and what backward keeps), and
    the forward's own peak (HF's fp32 temporaries of the whole sequence; the lean one's, a tile's)."""
    hidden, tokens = 2048, 16384
    gen = torch.Generator().manual_seed(2)
    x = (3.0 * torch.randn(1, tokens, hidden, generator=gen)).to(torch.bfloat16).cuda()
    g = torch.randn(1, tokens, hidden, generator=gen).cuda()

    def norm_of(lean: bool) -> nn.Module:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        norm = LlamaRMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1.0 + 0.3 * torch.randn(hidden))
        norm = norm.to(torch.bfloat16).cuda()
        return lean_norm(norm) if lean else norm

    def run(norm: nn.Module) -> tuple[int, int, tuple[torch.Tensor, ...]]:
        leaf = x.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        y = norm(leaf)
        torch.cuda.synchronize()
        held, peak = torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
        y.backward(g.to(y.dtype))
        return held, peak, (y.detach(), leaf.grad, norm.weight.grad)

    hf_held, hf_peak, hf = run(norm_of(lean=False))
    lean_held, lean_peak, lean = run(norm_of(lean=True))
    assert torch.equal(lean[0], hf[0])
    for got, want in zip(lean[1:], hf[1:], strict=True):
        assert bool((_ulps_apart(got, want) <= 2).all())
    elements = tokens * hidden
    # HF: the bf16 output, the fp32 upcast and the bf16 normalized value (8 bytes an element) and more;
    # lean: the output and one fp32 a token
    assert hf_held >= 8 * elements
    assert lean_held <= 2 * elements + 4 * tokens + (1 << 20)
    tile = hidden * hidden  # elements of a tile of rows
    assert hf_peak >= 10 * elements  # the fp32 input and normalized value, the 16-bit cast, the output
    assert lean_peak <= 2 * elements + 4 * tokens + 12 * tile + (1 << 20)
