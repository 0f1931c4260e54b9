"""The engine trains over Ulysses sequence groups (`initialize(mpu=<sequence groups>)`) equal to one process.

Four gloo ranks, sp2 x dp2: each rank holds half of every sequence of its data group (runtime.sequence),
returns its share of the sample's mean loss (`reduce_sequence_loss`) and hands it to `engine.backward`. The
parallel plan reduces gradients over data x sequence (ZeRO-1, -2 and -3 partition over that group) and
divides by the data ranks only, so at each stage the losses and the weights after 8 AdamW steps equal
tests/runtime/sequence/test_ulysses.py's one-process reference on whole sequences (the mean of the two data
groups' losses).
The config's `sequence_parallel_size` is taken where it agrees with the groups and refused by name where it
does not; a train_batch_size counting Accelerate's dp_shard_size left at 1 is refused naming that setting.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.runtime.sequence.test_ulysses import BATCH, STEPS, _data, _model, _reference
from tests.support.dist import run_distributed

WORLD, SP, KV_HEADS = 4, 2, 2
STAGES = (1, 2, 3)


def _train(stage: int, rank: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    from runtime.sequence.ulysses_data import reduce_sequence_loss

    model = _model(KV_HEADS)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=BATCH,
        seq_length=32,
        seq_length_is_variable=False,
    )
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "sequence_parallel_size": SP,
        "zero_optimization": {"stage": stage},
    }
    client = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config, mpu=mpu)
    own = [row[rank] for row in _data(WORLD, STEPS // SP)]
    sp_group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(
        own, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=sp_group, sp_world_size=SP, device="cpu"
    )
    losses = []
    for batch in loader:
        labels = batch["shift_labels"]
        out = engine(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            labels=labels,
            shift_labels=labels,
            num_items_in_batch=1,  # HF then returns the summed loss of this shard
            use_cache=False,
        )
        loss = reduce_sequence_loss(out.loss, (labels != -100).sum(), sp_group)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "params": [state[name] for name, _ in model.named_parameters()]}


def _worker(rank: int, world: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from runtime.errors import UserError

    out: dict[Any, Any] = {stage: _train(stage, rank) for stage in STAGES}
    model = _model(KV_HEADS)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=BATCH,
        seq_length=32,
        seq_length_is_variable=False,
    )
    config = {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": 1}
    try:
        deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config, mpu=mpu
        )
    except UserError as error:
        out["disagrees"] = str(error)
    # Accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=2) without dp_shard_size=2 writes
    # train_batch_size = micro x accumulation x 1
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH,
    }
    try:
        deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config, mpu=mpu
        )
    except UserError as error:
        out["dp_shard_size"] = (str(error), error.hint)
    return out


def test_sequence_parallel_engine_equals_one_process() -> None:
    results = run_distributed(_worker, WORLD, timeout=300)
    ref_losses, ref_params = _reference(WORLD, SP, KV_HEADS)
    for rank, result in enumerate(results):
        expected = [step[rank // SP] for step in ref_losses]  # this rank's data group
        for stage in STAGES:
            torch.testing.assert_close(result[stage]["losses"], expected, rtol=1e-5, atol=1e-5)
            for got, want in zip(result[stage]["params"], ref_params, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert result["disagrees"].startswith(
            "sequence_parallel_size: 1 disagrees with the sequence groups passed as mpu"
        ), result["disagrees"]
        assert result["dp_shard_size"] == (
            f"train_batch_size: {BATCH} counts 1 data-parallel ranks (train_micro_batch_size_per_gpu "
            f"{BATCH} x gradient_accumulation_steps 1), but the 4 ranks in sequence groups of 2 leave 2; "
            'with Accelerate\'s ParallelismConfig(sp_backend="deepspeed") set dp_shard_size=2',
            "--parallelism_config_dp_shard_size 2 (Accelerate's and the Trainer's flag); in a DeepSpeed "
            f"config, train_batch_size={2 * BATCH} or leave it out",
        )
