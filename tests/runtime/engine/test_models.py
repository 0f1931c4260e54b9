"""The example GPT model: sizes, shapes, tying, initialisation and that it learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runtime.models import GPT, MODEL_SIZES, GPTConfig

# Parameter counts of Hugging Face's GPT2LMHeadModel checkpoints (vocab 50257, 1024 positions, tied head),
# which the GPT-2 model cards round to 124M / 355M / 774M / 1.5B.
GPT2_PUBLISHED = {
    "small": 124_439_808,
    "medium": 354_823_168,
    "large": 774_030_080,
    "xl": 1_557_611_200,
}
# The round numbers people quote for the same four models.
GPT2_NOMINAL = {"small": 124e6, "medium": 350e6, "large": 774e6, "xl": 1.5e9}


def _tiny(**overrides: object) -> GPTConfig:
    return GPTConfig.named("tiny", **overrides)


@pytest.mark.parametrize("size", sorted(GPT2_PUBLISHED))
def test_named_sizes_match_gpt2_parameter_counts(size: str) -> None:
    exact = GPTConfig.named(size, vocab_size=50257).num_params()
    assert exact == GPT2_PUBLISHED[size]
    # The default (vocab padded to 50304 for fast matmuls) stays within 2% of the exact count, and within
    # 4% of the rounded name ("1.5B" is really 1.558B).
    padded = GPTConfig.named(size).num_params()
    assert abs(padded - GPT2_PUBLISHED[size]) / GPT2_PUBLISHED[size] < 0.02
    assert abs(padded - GPT2_NOMINAL[size]) / GPT2_NOMINAL[size] < 0.04


def test_config_count_equals_allocated_parameters() -> None:
    for config in (_tiny(), _tiny(bias=False), GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=300)):
        assert GPT(config).num_params() == config.num_params()


def test_meta_build_then_materialize_keeps_the_tie_and_initializes() -> None:
    with torch.device("meta"):
        model = GPT(_tiny())
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_params() == _tiny().num_params()
    std = model.tok_emb.weight.std().item()
    assert 0.015 < std < 0.025
    idx = torch.randint(0, 256, (1, 8))
    logits, _ = model(idx)
    assert torch.isfinite(logits).all()


def test_aliases_and_overrides() -> None:
    assert GPTConfig.named("gpt2-xl") == MODEL_SIZES["xl"]
    assert GPTConfig.named("tiny", n_layer=2).n_layer == 2
    assert MODEL_SIZES["tiny"].num_params() < 1_000_000


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 100, "n_head": 3}, "divisible by n_head"),
        ({"n_layer": 0}, "n_layer must be a positive integer"),
        ({"dropout": 1.5}, "dropout"),
    ],
)
def test_bad_config_is_refused_with_the_field_name(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _tiny(**overrides)


def test_unknown_size_lists_known_sizes() -> None:
    with pytest.raises(ValueError, match=r"unknown model size 'huge'.*medium"):
        GPTConfig.named("huge")


def test_forward_shapes_and_loss_is_fp32_cross_entropy() -> None:
    torch.manual_seed(0)
    config = _tiny(max_seq_len=32)
    model = GPT(config)
    idx = torch.randint(0, 256, (3, 32))
    targets = torch.randint(0, 256, (3, 32))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 32, 256)
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 256), targets.view(-1)))
    # A freshly initialised model is close to uniform: loss near ln(vocab).
    assert abs(loss.item() - math.log(256)) < 0.3
    assert model(idx).loss is None


def test_loss_stays_fp32_under_bf16_autocast() -> None:
    model = GPT(_tiny())
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32


def test_output_head_is_tied_to_token_embedding() -> None:
    torch.manual_seed(0)
    model = GPT(_tiny())
    assert model.lm_head.weight is model.tok_emb.weight
    assert [n for n, _ in model.named_parameters() if "head" in n] == []  # listed once, as tok_emb.weight
    idx = torch.randint(0, 256, (2, 16))
    # Logits are the final hidden states times the embedding matrix...
    hidden = {}
    model.ln_f.register_forward_hook(lambda _m, _i, out: hidden.setdefault("h", out))
    logits, loss = model(idx, idx)
    torch.testing.assert_close(logits, hidden["h"] @ model.tok_emb.weight.T)
    # ...so the embedding's gradient gets contributions from every vocabulary row via the head, not only
    # from the rows of tokens that occur in the input.
    loss.backward()
    unused = torch.ones(256, dtype=torch.bool)
    unused[idx.unique()] = False
    assert model.tok_emb.weight.grad[unused].abs().sum(dim=1).gt(0).all()


def test_blocks_are_separate_modules() -> None:
    model = GPT(_tiny(n_layer=3))
    assert len(model.blocks) == 3
    ids = {id(p) for p in model.blocks[0].parameters()}
    assert ids.isdisjoint(id(p) for p in model.blocks[1].parameters())


def test_gpt2_initialisation_scales_residual_projections() -> None:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=512, max_seq_len=64)
    model = GPT(config)
    block = model.blocks[0]
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    expected = 0.02 / math.sqrt(2 * config.n_layer)
    assert abs(block.attn.proj.weight.std().item() - expected) < 0.1 * expected
    assert abs(block.mlp.proj.weight.std().item() - expected) < 0.1 * expected
    assert block.mlp.fc.bias.abs().sum() == 0
    assert torch.equal(block.ln_1.weight, torch.ones(256))


def test_dropout_is_active_only_in_training() -> None:
    torch.manual_seed(0)
    model = GPT(_tiny(dropout=0.5))
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    torch.testing.assert_close(model(idx).logits, model(idx).logits)
    model.train()
    assert not torch.equal(model(idx).logits, model(idx).logits)


def test_sequence_longer_than_positions_is_refused() -> None:
    model = GPT(_tiny(max_seq_len=8))
    with pytest.raises(ValueError, match="longer than the model's max_seq_len 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_loss_decreases_with_adamw() -> None:
    torch.manual_seed(0)
    model = GPT(_tiny(max_seq_len=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A repeating pattern is learnable in a few steps; random tokens would not be.
    pattern = torch.arange(64) % 7
    idx, targets = pattern[:-1].repeat(4, 1), pattern[1:].repeat(4, 1)
    losses = []
    for _ in range(15):
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_flops_per_token_formula() -> None:
    config = GPTConfig.named("medium")
    n = config.num_params()
    assert config.flops_per_token() == 6 * n + 12 * 24 * 1024 * 1024
    assert config.flops_per_token(512) == 6 * n + 12 * 24 * 1024 * 512
