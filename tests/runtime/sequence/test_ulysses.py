"""Ulysses sequence parallelism (runtime.sequence.ulysses*, sp_groups) on gloo ranks equals one process.

A tiny HF Llama built from a config, the same weights on every rank, is made to run Ulysses through
DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` (as Accelerate calls it) and fed by
``UlyssesSPDataLoaderAdapter`` from each rank's own batches; each step's loss is reduced over the sequence
group (``reduce_sequence_loss``), gradients are summed over the sequence group and averaged over the data
group (what the engine does: tests/runtime/sequence/test_sequence_engine.py), and AdamW steps. At sp 2, sp 4
(2 kv heads:
replicated) and sp 2 x dp 2, 8 steps' losses and the final weights equal one process training the whole
sequences in the order the adapter serves them. Some shards have only -100 labels (a prompt), so their
ranks count zero tokens. Also: the adapter serving batches of different lengths drawn on the group's ranks
in group order, its shards against hand-computed ones, the group layout, and the bad-input messages.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from runtime.errors import UserError
from runtime.sequence.sp_groups import init_sequence_parallel, sequence_layout
from runtime.sequence.ulysses import check_heads
from runtime.sequence.ulysses_data import reduce_sequence_loss, shard_batch, shift_labels
from tests.support.dist import run_distributed

VOCAB, SEQ, BATCH, STEPS, PROMPT = 96, 32, 2, 8, 10


def _model(kv_heads: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _data(world: int, rounds: int) -> list[list[dict[str, torch.Tensor]]]:
    """data[round][rank]: the batch rank `rank`'s own DataLoader yields in that round."""
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(rounds):
        row = []
        for _ in range(world):
            ids = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
            labels = ids.clone()
            labels[:, :PROMPT] = -100  # the prompt: at sp 4 the first shard has no counted token
            row.append({"input_ids": ids, "labels": labels})
        data.append(row)
    return data


def _worker(rank: int, world: int, sp: int, kv_heads: int) -> dict[str, Any]:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    errors = []
    try:
        init_sequence_parallel(3)
    except UserError as exc:
        errors.append(str(exc))
    model = _model(kv_heads)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=BATCH,
        seq_length=SEQ,
        seq_length_is_variable=False,
    )
    sp_group, data_group = mpu.get_sequence_parallel_group(), mpu.get_data_parallel_group()
    # where HF Trainer's sp loss and Accelerate's late adapter look the group up
    from deepspeed.utils import groups

    assert groups._get_sequence_parallel_group() is sp_group
    assert groups._get_sequence_parallel_world_size() == sp
    assert groups._get_sequence_parallel_rank() == rank % sp
    dp = mpu.get_data_parallel_world_size()
    own = [row[rank] for row in _data(world, STEPS // sp)]
    loader = UlyssesSPDataLoaderAdapter(
        own, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=sp_group, sp_world_size=sp, device="cpu"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in loader:
        labels = batch["shift_labels"]
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=labels,
            shift_labels=labels,
            num_items_in_batch=1,  # HF then returns the summed loss of this shard
            use_cache=False,
        )
        loss = reduce_sequence_loss(out.loss, (labels != -100).sum(), sp_group)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=sp_group)  # each rank back-propagated its share: sum
            dist.all_reduce(p.grad, group=data_group)
            p.grad /= dp  # data parallelism averages
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # batches of another length on each rank of the group: each rank's is served in group order
    ragged = [{"input_ids": torch.arange(4 * (rank + 1)).reshape(1, -1) + 100 * rank, "tag": rank}]
    served = list(UlyssesSPDataLoaderAdapter(ragged, mpu.get_sequence_parallel_rank(), sp_group, sp, None))
    return {
        "served": served,
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "groups": (dist.get_process_group_ranks(sp_group), dist.get_process_group_ranks(data_group)),
        "len": len(loader),
        "errors": errors,
    }


def _reference(world: int, sp: int, kv_heads: int) -> tuple[list[list[float]], list[torch.Tensor]]:
    """One process: step t trains, for each data group d, the batch of rank d*sp + t%sp of round t//sp
    (the adapter's order), whole; the loss is the mean of the data groups' losses."""
    model = _model(kv_heads)
    data = _data(world, STEPS // sp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = world // sp
    losses = []
    for step in range(STEPS):
        per_group = []
        for d in range(dp):
            batch = data[step // sp][d * sp + step % sp]
            per_group.append(model(**batch, use_cache=False).loss)
        (sum(per_group) / dp).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_group])
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("world", "sp", "kv_heads"),
    [(2, 2, 2), (4, 4, 2), (4, 2, 4)],
    ids=["sp2", "sp4-kv-replicated", "sp2xdp2"],
)
def test_ulysses_equals_one_process(world: int, sp: int, kv_heads: int) -> None:
    results = run_distributed(_worker, world, sp, kv_heads)
    ref_losses, ref_params = _reference(world, sp, kv_heads)
    layout = sequence_layout(world, sp)
    for rank, result in enumerate(results):
        assert result["groups"] == (layout.sequence_ranks(rank), layout.data_ranks(rank))
        assert result["len"] == (STEPS // sp) * sp
        first = rank - rank % sp
        drawn = [
            {"input_ids": torch.arange(4 * (r + 1)).reshape(1, -1) + 100 * r, "tag": r}
            for r in range(first, first + sp)
        ]
        want = [shard_batch(batch, rank % sp, sp) for batch in drawn]
        assert [(s["tag"], s["input_ids"].tolist()) for s in result["served"]] == [
            (w["tag"], w["input_ids"].tolist()) for w in want
        ]
        assert result["errors"] == [
            f"sequence_parallel_size=3 does not divide the world size {world}",
        ]
        expected = [step[rank // sp] for step in ref_losses]
        torch.testing.assert_close(result["losses"], expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(result["params"], ref_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shard_batch_shifts_labels_before_cutting() -> None:
    ids = torch.arange(8).reshape(1, 8)
    labels = torch.tensor([[-100, -100, 12, 13, 14, 15, 16, 17]])
    assert shift_labels(labels).tolist() == [[-100, 12, 13, 14, 15, 16, 17, -100]]
    shards = [shard_batch({"input_ids": ids, "labels": labels, "note": "x"}, r, 2) for r in range(2)]
    assert [s["input_ids"].tolist() for s in shards] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # shard 0's last target is shard 1's first token: shifted before the cut
    assert [s["shift_labels"].tolist() for s in shards] == [[[-100, 12, 13, 14]], [[15, 16, 17, -100]]]
    assert [s["position_ids"].tolist() for s in shards] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert all("labels" not in s and s["note"] == "x" for s in shards)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # given position_ids (packed documents) are cut
    shard = shard_batch({"input_ids": ids, "position_ids": packed}, 1, 4)
    assert shard["position_ids"].tolist() == [[2, 0]] and "shift_labels" not in shard


def test_bad_input_one_line_each() -> None:
    with pytest.raises(UserError) as exc:
        shard_batch({"input_ids": torch.zeros(1, 30, dtype=torch.long)}, 0, 4)
    assert str(exc.value) == "sequence length 30 is not divisible by sequence_parallel_size=4"
    with pytest.raises(UserError) as exc:
        check_heads(4, 4, 3)
    assert str(exc.value) == "num_attention_heads=4 is not divisible by sequence_parallel_size=3"
    with pytest.raises(UserError) as exc:
        check_heads(12, 3, 2)
    assert str(exc.value) == "num_key_value_heads=3 and sequence_parallel_size=2: neither divides the other"
    with pytest.raises(UserError) as exc:
        sequence_layout(6, 4)
    assert str(exc.value) == "sequence_parallel_size=4 does not divide the world size 6"
    assert exc.value.hint == "launch a multiple of 4 ranks, or set sequence_parallel_size to a divisor of 6"


def test_bad_input_at_the_entry_points_users_call() -> None:
    """What Accelerate's call and a config without groups get: one line naming the key, before any group."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from runtime.config import ConfigError, load_config

    with pytest.raises(UserError) as exc:
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path="unused", core_attn_implementation="sdpa", sequence_parallel_size=4,
            micro_batch_size=1, seq_length=30, seq_length_is_variable=False,
        )  # fmt: skip
    assert str(exc.value) == "seq_length=30 is not divisible by sequence_parallel_size=4"
    with pytest.raises(ConfigError) as exc:
        load_config({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}, world_size=2)
    assert str(exc.value).startswith(
        "sequence_parallel_size: a DeepSpeed option dslaunch does not support: sequence parallelism without "
        "its groups (pass initialize(mpu=...) the Ulysses groups of register_with_transformers"
    )


def _registered(**options: Any) -> Any:
    """A tiny Llama registered for Ulysses at sp 2 through DeepSpeed's name (Accelerate's call)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model = _model(2)
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=2,
        micro_batch_size=1,
        **options,
    )
    return model


def _bad_shards_worker(rank: int, world: int) -> list[tuple[str, str]]:
    model = _registered()
    ids = torch.arange(SEQ).reshape(1, -1) % VOCAB
    errors = []
    # whole sequences without the adapter: each rank would attend over 2 copies of its sequence
    # shards of different lengths in one group: the equal-split all-to-all cannot pair them
    cut = slice(0, 10) if rank == 0 else slice(10, SEQ)
    positions = torch.arange(SEQ).reshape(1, -1)[:, cut]
    for kwargs in ({"input_ids": ids}, {"input_ids": ids[:, cut], "position_ids": positions}):
        try:
            model(**kwargs, use_cache=False)
        except UserError as exc:
            errors.append((str(exc), exc.hint))
    return errors


def _fixed_length_worker(rank: int, world: int) -> tuple[str, str]:
    model = _registered(seq_length=SEQ + 8, seq_length_is_variable=False)
    ids = torch.arange(SEQ).reshape(1, -1) % VOCAB
    half = SEQ // 2
    cut = slice(rank * half, (rank + 1) * half)
    with pytest.raises(UserError) as exc:
        model(input_ids=ids[:, cut], position_ids=torch.arange(SEQ).reshape(1, -1)[:, cut], use_cache=False)
    return str(exc.value), exc.value.hint


def test_a_fixed_sequence_length_is_held_to() -> None:
    # DeepSpeed's seq_length_is_variable=False: a batch of another length is refused by name, on every rank
    for message, hint in run_distributed(_fixed_length_worker, 2):
        assert message == (
            f"this batch's sequence shard has {SEQ // 2} tokens, {SEQ} over 2 ranks, but Ulysses was "
            f"registered with seq_length={SEQ + 8} and seq_length_is_variable=False"
        )
        assert hint == (
            f"pad or cut every sequence to {SEQ + 8} tokens, or register with seq_length_is_variable=True"
        )


def test_bad_shards_refused_on_every_rank() -> None:
    for errors in run_distributed(_bad_shards_worker, 2):
        assert errors == [
            (
                f"Ulysses: every rank of the sequence group got positions 0..{SEQ - 1}: whole sequences (or "
                "shards without their position_ids) reached a model registered for sequence parallelism",
                "feed the model through UlyssesSPDataLoaderAdapter, which cuts each sequence and passes "
                "its position_ids",
            ),
            (
                "Ulysses: the sequence group's shards differ in length "
                "([10, 22] tokens, in group rank order)",
                "shard each batch with UlyssesSPDataLoaderAdapter (or shard_batch), which cuts equal shards",
            ),
        ]
