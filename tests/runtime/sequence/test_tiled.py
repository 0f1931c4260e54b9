"""The tiled MLP and the tiled logits loss (runtime.sequence) equal the untiled computations.

Forward values and gradients (input and parameters) against the plain module and against
``F.cross_entropy(hidden @ W.T, labels, ignore_index=-100)``, over several tile counts with an uneven last
tile, more tiles than tokens, fp32 and bf16; DeepSpeed's ``TiledMLP`` / ``TiledFusedLogitsLoss`` call
signatures; a tiny HF Llama trained 4 steps with both tiled, its norms lean (runtime.sequence.lean_norm)
and its layers checkpointed, equal to the plain model, in one process and at ZeRO-3 over 2 gloo ranks
(parameters sharded, so the tiles must run on gathered weights); bad input.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import runtime
from runtime.activation_checkpointing import hf_checkpointing
from runtime.errors import UserError
from runtime.sequence import (
    lean_llama_norms,
    loss_tiles,
    mlp_tiles,
    tile_causal_lm_loss,
    tile_llama_mlps,
    tile_mlp,
    tiled_causal_lm_loss,
)
from tests.support.dist import run_distributed

HIDDEN, INTER, VOCAB = 16, 40, 50
SEQ = 11  # not divisible by 2, 3 or 4: the last tile is shorter


class GatedMLP(nn.Module):
    """LlamaMLP's shape: down(silu(gate(x)) * up(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _run_mlp(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    y = module(x)
    (y.float() * g).sum().backward()
    return (y.detach(), x.grad, *(p.grad for p in module.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_mlp_equals_the_plain_module(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    plain = GatedMLP().to(dtype)
    x = torch.randn(2, SEQ, HIDDEN, dtype=dtype)
    g = torch.randn(2, SEQ, HIDDEN)
    expected = _run_mlp(plain, x, g)
    # fp32: rounding only (a tile's matmuls block differently; tiles sum the weight gradients in another
    # order); bf16: the tiled weight gradients are summed in fp32 and rounded once, the plain ones come from
    # one bf16 matmul: within bf16's resolution of each other
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1.6e-2}
    for tiles in (1, 3, 4, SEQ, 64):  # 64 > tokens: one token per tile
        tiled = tile_mlp(copy.deepcopy(plain), tiles)
        got = _run_mlp(tiled, x, g)
        for a, b in zip(got, expected, strict=True):
            assert a.dtype == b.dtype == dtype
            assert torch.allclose(a.float(), b.float(), **tol), (tiles, (a - b).abs().max())
    # the state dict is untouched: a tiled model loads and saves the plain model's checkpoints
    assert tiled.state_dict().keys() == plain.state_dict().keys()


def _reference_loss(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (h[:, :-1] @ w.T).float()
    return F.cross_entropy(logits.reshape(-1, w.shape[0]), labels[:, 1:].reshape(-1), ignore_index=-100)


def _grads(loss_fn: Any, h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = loss_fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def test_tiled_loss_equals_cross_entropy_with_ignored_tiles_and_the_shift() -> None:
    torch.manual_seed(1)
    h, w = torch.randn(2, SEQ + 2, HIDDEN), torch.randn(VOCAB, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, SEQ + 2))
    labels[0, :10] = -100  # the first tiles count nothing (skipped: no logits computed)
    labels[1, 4] = -100
    expected = _grads(lambda h, w: _reference_loss(h, w, labels), h, w)
    for tiles in (1, 2, 5, 2 * (SEQ + 2), 100):
        got = _grads(lambda h, w, tiles=tiles: tiled_causal_lm_loss(h, w, labels, tiles=tiles), h, w)
        for a, b in zip(got, expected, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (tiles, (a - b).abs().max())
    # pre-shifted labels (HF's shift_labels) and an explicit normaliser (HF's num_items_in_batch)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    counted = int((shifted != -100).sum())

    def halved(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tiled_causal_lm_loss(h, w, shifted, tiles=3, shift=False, num_items_in_batch=2 * counted)

    got = _grads(halved, h, w)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a * 2, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # evaluation: the same value, nothing kept for backward
        assert torch.allclose(tiled_causal_lm_loss(h, w, labels, tiles=3), expected[0], rtol=1e-6)
    # every label ignored: loss 0 and zero gradients, not the NaN of the plain mean
    none = torch.full_like(labels, -100)
    loss, gh, gw = _grads(lambda h, w: tiled_causal_lm_loss(h, w, none, tiles=2), h, w)
    assert loss.item() == 0.0 and not gh.any() and not gw.any()


def test_tiled_loss_in_bf16_matches_the_fp32_logits_loss() -> None:
    torch.manual_seed(2)
    h, w = torch.randn(1, 64, HIDDEN).bfloat16(), torch.randn(VOCAB, HIDDEN).bfloat16()
    labels = torch.randint(0, VOCAB, (1, 64))
    expected = _grads(lambda h, w: _reference_loss(h, w, labels), h, w)
    got = _grads(lambda h, w: tiled_causal_lm_loss(h, w, labels, tiles=5), h, w)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert torch.allclose(got[0], expected[0], rtol=1e-5)
    for a, b in zip(got[1:], expected[1:], strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1.6e-2, atol=1e-3), (a - b).abs().max()


def test_deepspeed_names_keep_their_signatures() -> None:
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    torch.manual_seed(3)
    plain = GatedMLP()
    tiled = copy.deepcopy(plain)
    x, g = torch.randn(2, SEQ, HIDDEN), torch.randn(2, SEQ, HIDDEN)
    expected = _run_mlp(plain, x, g)

    class Patched(nn.Module):  # ALST's monkey patch: forward calls TiledMLP.apply
        def __init__(self) -> None:
            super().__init__()
            self.mlp = tiled

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = self.mlp
            weights = [m.down_proj.weight, m.gate_proj.weight, m.up_proj.weight]
            return ulysses_sp.TiledMLP.apply(lambda self, x: GatedMLP.forward(self, x), m, x, 4, weights)

    got = _run_mlp(Patched(), x, g)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    h = torch.randn(2, SEQ, HIDDEN, requires_grad=True)
    y = torch.randint(0, VOCAB, (2, SEQ))

    def loss_fn(self: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).float(), y, reduction="sum")

    loss = ulysses_sp.TiledFusedLogitsLoss.apply(loss_fn, head, h, y, None, 3, [head.weight], "sum")
    loss.backward()
    ref_h = h.detach().clone().requires_grad_()
    ref_head = copy.deepcopy(head)
    ref_head.weight.grad = None
    ref = F.cross_entropy(ref_head(ref_h).reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert torch.allclose(h.grad, ref_h.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(head.weight.grad, ref_head.weight.grad, rtol=1e-5, atol=1e-6)

    # the Ulysses names are real (tests/runtime/sequence/test_ulysses.py); at sequence_parallel_size=1
    # DeepSpeed's register_with_transformers does nothing and returns no mpu
    assert ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(None, "sdpa", 1, 1) is None


def test_bad_input_is_one_line_naming_the_argument() -> None:
    mlp = GatedMLP()
    message = r"^tile_mlp\(tiles=\.\.\.\): expected a positive number of tiles, got 0$"
    with pytest.raises(UserError, match=message):
        tile_mlp(mlp, 0)
    h, w = torch.randn(1, 4, HIDDEN), torch.randn(VOCAB, HIDDEN)
    with pytest.raises(UserError, match=r"^tiled_causal_lm_loss\(tiles=\.\.\.\): .* got -1$"):
        tiled_causal_lm_loss(h, w, torch.zeros(1, 4, dtype=torch.long), tiles=-1)
    with pytest.raises(UserError, match=r"labels \(1, 3\) do not match hidden states \(1, 4, 16\)"):
        tiled_causal_lm_loss(h, w, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(UserError, match=r"^tile_llama_mlps: GatedMLP has no model.layers\[i\].mlp$"):
        tile_llama_mlps(mlp)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    with pytest.raises(UserError, match=r"output_reduction=\.\.\.\): expected 'mean' or 'sum', got 'avg'"):
        TiledFusedLogitsLoss.apply(None, mlp, h, h[..., 0], None, 2, [], "avg")
    # the documented default rules
    assert (mlp_tiles(100, 16), mlp_tiles(8, 16), loss_tiles(1 << 20, 128256)) == (7, 1, 501)


# ------------------------------------------------------------------------------- a tiny HF Llama


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train_llama(rank: int, stage: int, tiled: bool) -> dict[str, Any]:
    model = _llama()
    if tiled:
        assert tile_llama_mlps(model, tiles=3) == 2
        tile_causal_lm_loss(model, tiles=4)
        assert lean_llama_norms(model) == 5
        hf_checkpointing(model)  # as ALST runs: every layer recomputed, its MLP tiles recomputed again
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = runtime.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
        labels = ids.clone()
        labels[0, :3] = -100  # a prompt that does not count
        out = engine(input_ids=ids, labels=labels)
        assert (out.logits is None) == tiled  # the tiled loss never made the logits
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    master = engine.full_state_dict(rank0_only=False)
    engine.destroy()
    return {"losses": losses, "master": master}


def _assert_same_training(plain: dict[str, Any], tiled: dict[str, Any]) -> None:
    assert tiled["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert plain["master"].keys() == tiled["master"].keys()
    for name, value in plain["master"].items():
        assert torch.allclose(tiled["master"][name], value, rtol=1e-4, atol=1e-5), name


def test_tiny_llama_trains_the_same_with_tiled_mlp_and_loss() -> None:
    _assert_same_training(_train_llama(0, 0, False), _train_llama(0, 0, True))


def _zero3_pair(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train_llama(rank, 3, False), _train_llama(rank, 3, True)


def test_tiny_llama_at_zero3_on_two_ranks_trains_the_same_tiled() -> None:
    for plain, tiled in run_distributed(_zero3_pair, 2, timeout=180):
        _assert_same_training(plain, tiled)
