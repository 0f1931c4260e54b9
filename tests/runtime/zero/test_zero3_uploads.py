"""ZeRO-3 `offload_param`: which host shards are uploaded, in which order, and how many bytes; and what a
rank stages for its gradients in backward.

One rank, GPT-tiny with every module its own unit (persistence threshold 0) and no reuse window, so
every need gathers: after the first step has recorded the traces, a step's uploads follow the recorded
forward order (the first units' updated weights first, the tied embedding again for the head), then
the backward order, and the bytes counted are exactly the host shards of the units uploaded. On a GPU
the same uploads run on their own stream (runtime/zero/stage3_upload.py); here they are plain copies.
The weights they carry are checked by tests/runtime/offload/test_parity.py's offload_param cases.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.dist import run_distributed


def _engine(**config: Any) -> tuple[Any, Any]:
    """GPT-tiny under ZeRO-3 with parameters and optimizer offloaded, every module its own unit."""
    import runtime
    from runtime.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.named("tiny"))
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        **config.pop("zero", {}),
    }
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        **config,
    }
    engine, _, _, _ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def _one_step_of_uploads(rank: int, world_size: int) -> dict:
    engine, model = _engine(zero={"stage3_max_reuse_distance": 0})
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss)

    uploads = engine.zero.uploads
    step()  # records the traces
    uploads.stats.reset()
    _, loss = engine(x, y)
    forward = list(uploads.stats.order)
    engine.backward(loss)
    engine.step()
    shard_bytes = {u.index: u.host_shard_bytes() for u in engine.zero.units}
    result = {
        "forward": forward,
        "backward": list(uploads.stats.order)[len(forward) :],
        "bytes": uploads.stats.bytes,
        "shard_bytes": shard_bytes,
        "forward_trace": engine.zero.schedule.forward_trace.recorded,
        "losses": [step() for _ in range(2)],
    }
    engine.destroy()
    return result


def test_offloaded_shards_upload_in_trace_order_and_count_their_bytes() -> None:
    [result] = run_distributed(_one_step_of_uploads, 1)
    # units: 0 tok_emb (tied to lm_head), 1 pos_emb, 2-5 blocks, 6 ln_f
    assert result["forward_trace"] == [0, 1, 2, 3, 4, 5, 6, 0]
    assert result["forward"] == result["forward_trace"]  # the first units' new weights go up first
    assert result["backward"] == [0, 6, 5, 4, 3, 2, 1]  # the tied unit stays gathered until tok_emb
    uploaded = result["forward"] + result["backward"]
    assert result["bytes"] == sum(result["shard_bytes"][u] for u in uploaded)
    assert result["losses"][1] < result["losses"][0]


def _staging_seen_in_backward(rank: int, world_size: int) -> dict:
    engine, model = _engine(gradient_accumulation_steps=2, bf16={"enabled": True})
    seen: list[int] = []
    for param in model.parameters():  # after the engine's own hook: what it holds once a gradient is in
        param.register_post_accumulate_grad_hook(lambda _: seen.append(engine.zero.buffer_bytes()))
    torch.manual_seed(1 + rank)
    for _ in range(4):  # two optimizer steps of two micro-batches
        tokens = torch.randint(0, model.config.vocab_size, (2, 9))
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    largest = max(s.numel * s.grad_shard.element_size() for u in engine.zero.units for s in u.segments)
    engine.destroy()
    return {"max_staging": max(seen), "largest_unit_bytes": largest}


def test_one_rank_adds_gradients_into_its_shards_without_unit_sized_staging() -> None:
    """One GPU is where offload_param is used for the largest models: there a gradient is its own
    reduction, so no unit-sized staging buffer is held (the staged path kept up to three: 3.45 GiB at
    17.6B). Two ranks still stage each unit for its reduce-scatter. The losses of both paths are
    tests/runtime/offload/test_parity.py's offload_param cases against plain PyTorch."""
    [one] = run_distributed(_staging_seen_in_backward, 1)
    assert one["max_staging"] == 0
    two = run_distributed(_staging_seen_in_backward, 2)
    assert all(r["max_staging"] >= r["largest_unit_bytes"] for r in two)  # the check can see staging
