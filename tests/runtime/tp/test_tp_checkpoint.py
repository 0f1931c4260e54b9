"""Tensor-parallel checkpoints: each model rank keeps its own shards (with pipelines, each stage and model
rank), so a tp2 run, a tp2 x dp2 run and a pp2 x tp2 run resumed from a save repeat the uninterrupted run
exactly (before, the model ranks wrote the same files and the resume diverged), and a resume at another
degree is refused by name. 2 and 4 gloo ranks (one spawn each), CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.tp_models import GPT2Block, TinyLM, lm_batch, lm_loss

STEPS, SAVE_AT = 4, 2


def _config(tp: int) -> dict[str, Any]:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
            "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp}}  # fmt: skip


def _train(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    import runtime
    from runtime.checkpoint import CheckpointNotFound

    def engine() -> Any:
        torch.manual_seed(0)
        model = TinyLM(GPT2Block)
        return runtime.initialize(model=model, config=_config(2))[0]

    def steps(eng: Any, start: int) -> list[float]:
        losses = []
        for step in range(start, STEPS):
            tokens, labels = lm_batch(step, 0)
            loss = lm_loss(eng, tokens, labels)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
            if step + 1 == SAVE_AT and start == 0:
                eng.save_checkpoint(save_dir)
        return losses

    whole = steps(engine(), 0)
    resumed_engine = engine()
    resumed_engine.load_checkpoint(save_dir)
    resumed = steps(resumed_engine, SAVE_AT)
    folders = sorted(p.name for p in Path(save_dir).iterdir())
    wrong_degree = None
    try:  # the same checkpoint, read as if saved at tp4
        resumed_engine.tp_size = 4
        resumed_engine.load_checkpoint(save_dir)
    except CheckpointNotFound as error:
        wrong_degree = str(error)
    return {"whole": whole, "resumed": resumed, "folders": folders, "wrong_degree": wrong_degree}


def test_a_tensor_parallel_resume_repeats_the_uninterrupted_run(tmp_path: Path) -> None:
    results = run_distributed(_train, 2, str(tmp_path / "ckpt"), timeout=180)
    for r in results:
        assert r["resumed"] == pytest.approx(r["whole"][SAVE_AT:], rel=1e-6, abs=0), r
        assert r["folders"] == ["tp_rank_00_of_02", "tp_rank_01_of_02"]
        assert "has no checkpoint for tensor-parallel rank" in r["wrong_degree"], r["wrong_degree"]
        assert "_of_04); it holds ['tp_rank_00_of_02', 'tp_rank_01_of_02']" in r["wrong_degree"]


def _train_3d(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    """pp2 x tp2: each (stage, model rank) keeps its own folder; a resume repeats the uninterrupted run."""
    from runtime.parallel import PipeModelDataParallelTopology
    from runtime.pipe import PipelineEngine, PipelineModule
    from tests.support.pipe_cases import BASE_SEED, data_iterator, token_loss
    from tests.support.tp_models import layers_3d

    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}  # fmt: skip

    def engine() -> Any:
        topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
        module = PipelineModule(layers_3d(), topology=topology, loss_fn=token_loss, seed_layers=True,
                                base_seed=BASE_SEED, partition_method="type:Block")  # fmt: skip
        return PipelineEngine(module, config)

    def steps(eng: Any, start: int) -> list[float]:
        losses = []
        for step in range(start, STEPS):
            losses.append(float(eng.train_batch(data_iterator("gpt", step, 2, 4, 0, 1))))
            if step + 1 == SAVE_AT and start == 0:
                eng.save_checkpoint(save_dir)
        return losses

    whole = steps(engine(), 0)
    resumed_engine = engine()
    resumed_engine.load_checkpoint(save_dir)
    return {"whole": whole, "resumed": steps(resumed_engine, SAVE_AT),
            "folders": sorted(p.name for p in Path(save_dir).iterdir())}  # fmt: skip


DP_STEPS, DP_SAVE_AT = 8, 4


def _train_tp_dp(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    """tp2 x dp2 with AutoTP on the GPT-2-style model, ZeRO-1 over data: 8 steps, saved after 4; a fresh
    engine loads the save and runs the last 4."""
    import runtime

    config = _config(2) | {"train_batch_size": 8}

    def engine() -> Any:
        torch.manual_seed(0)
        return runtime.initialize(model=TinyLM(GPT2Block), config=config)[0]

    def steps(eng: Any, start: int) -> list[float]:
        losses = []
        for step in range(start, DP_STEPS):
            tokens, labels = lm_batch(step, eng.grid.get_data_parallel_rank())
            loss = lm_loss(eng, tokens, labels)
            eng.backward(loss)
            eng.step()
            losses.append(float(loss))
            if step + 1 == DP_SAVE_AT and start == 0:
                eng.save_checkpoint(save_dir)
        return losses

    first = engine()
    whole = steps(first, 0)
    resumed_engine = engine()
    resumed_engine.load_checkpoint(save_dir)
    resumed = steps(resumed_engine, DP_SAVE_AT)
    return {"whole": whole, "resumed": resumed, "whole_state": first.hf_state_dict(),
            "resumed_state": resumed_engine.hf_state_dict(),
            "folders": sorted(p.name for p in Path(save_dir).iterdir())}  # fmt: skip


def _world4(rank: int, world_size: int, save_root: str) -> dict[str, Any]:
    return {
        "pp_tp": _train_3d(rank, world_size, f"{save_root}/pp_tp"),
        "tp_dp": _train_tp_dp(rank, world_size, f"{save_root}/tp_dp"),
    }


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_world4, 4, str(tmp_path_factory.mktemp("ckpt4")), timeout=300)


def test_a_pipeline_by_tensor_parallel_resume_repeats_the_uninterrupted_run(world4: list[dict]) -> None:
    results = [r["pp_tp"] for r in world4]
    for r in results:
        assert r["resumed"] == pytest.approx(r["whole"][SAVE_AT:], rel=1e-6, abs=0), r
    assert results[0]["folders"] == [
        f"pipe_stage_{s:02d}_of_02_tp_{t:02d}_of_02" for s in range(2) for t in range(2)
    ]


def test_a_tensor_by_data_parallel_resume_repeats_the_uninterrupted_run(world4: list[dict]) -> None:
    for rank, r in enumerate(r["tp_dp"] for r in world4):
        assert r["resumed"] == r["whole"][DP_SAVE_AT:], f"rank {rank}"  # exact
        assert sorted(r["resumed_state"]) == sorted(r["whole_state"])
        for key, value in r["whole_state"].items():
            assert torch.equal(r["resumed_state"][key], value), f"rank {rank} {key}"
        assert r["folders"] == ["tp_rank_00_of_02", "tp_rank_01_of_02"]
