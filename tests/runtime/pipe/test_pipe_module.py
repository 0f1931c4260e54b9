"""PipelineModule: the partition as pure functions, each stage building only its own layers, eval_batch,
and the clear errors for bad input (the distributed checks run in
the shared spawn of 4 gloo ranks, tests/support/pipe_world4.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runtime.pipe.config import check_schedule, read_pipeline_config
from runtime.pipe.module import LayerSpec, TiedLayerSpec, count_trainable_params, layer_type_name
from runtime.pipe.partition import (
    partition_balanced,
    partition_layers,
    partition_uniform,
    type_weights,
    virtual_stages,
)
from tests.support.pipe_cases import (
    BASE_SEED,
    ReferenceModel,
    data_iterator,
    global_micro_batch,
    mlp_layers,
    mse,
)
from tests.support.pipe_world4 import part


class Recorded(nn.Module):
    """A layer that notes where it was built: (layer id, device of its weight)."""

    built: list[tuple[int, str]] = []  # noqa: RUF012 - per process

    def __init__(self, layer_id: int, width: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        Recorded.built.append((layer_id, self.weight.device.type))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


# -- pure partitioning -------------------------------------------------------------------------------
def test_uniform_gives_the_first_stages_the_extra_layers() -> None:
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]


def test_balanced_minimises_the_heaviest_stage() -> None:
    # Linear(6,16), two parameterless layers, Linear(16,16), tanh, Linear(16,16), tanh, Linear(16,4)
    weights = [112, 0, 0, 272, 0, 272, 0, 68]
    assert partition_balanced(weights, 4) == [0, 3, 5, 7, 8]
    assert partition_balanced(weights, 2) == [0, 5, 8]  # 384 | 340, the best split
    assert partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert partition_balanced([0, 0, 0, 0], 2) == [0, 3, 4]  # every stage still gets a layer


def test_type_regex_spreads_the_matching_layers() -> None:
    names = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Head"]
    assert type_weights(names, "block") == [0, 1, 1, 1, 1, 0, 0]
    assert partition_layers("type:Block", 2, type_names=names) == [0, 3, 7]
    with pytest.raises(ValueError, match=r"'type:Attention' matches none of the layer types \['Block', "):
        partition_layers("type:Attention", 2, type_names=names)


def test_bad_partition_input_names_the_numbers() -> None:
    with pytest.raises(ValueError, match="the pipeline has 5 stages but only 4 layers"):
        partition_uniform(4, 5)
    with pytest.raises(ValueError, match="the pipeline has 3 stages but only 2 layers"):
        partition_layers("parameters", 3, param_counts=[1, 1], type_names=["A", "B"])
    with pytest.raises(
        ValueError, match="unknown partition_method 'blocks'; use one of 'parameters', 'uniform'"
    ):
        partition_layers("blocks", 2, type_names=["A", "B"])


def test_counting_a_spec_builds_it_on_meta_only() -> None:
    Recorded.built.clear()
    assert count_trainable_params(LayerSpec(Recorded, 7, width=9)) == 9
    assert count_trainable_params(LayerSpec(nn.Linear, 3, 2)) == 8
    assert count_trainable_params(torch.tanh) == 0
    assert Recorded.built == [(7, "meta")]
    assert layer_type_name(LayerSpec(Recorded, 0)) == "Recorded"
    assert layer_type_name(torch.tanh) == "tanh"


def test_chunks_sit_num_stages_apart() -> None:
    assert virtual_stages(0, 4, 2) == [0, 4]
    assert virtual_stages(3, 4, 2) == [3, 7]
    assert virtual_stages(1, 2, 3) == [1, 3, 5]
    assert virtual_stages(2, 4, 1) == [2]


def test_schedule_follows_the_chunks() -> None:
    auto = read_pipeline_config({})
    assert check_schedule(auto, 4, 1, 8) == "1f1b"
    assert check_schedule(auto, 4, 2, 8) == "interleaved_1f1b"
    assert check_schedule(read_pipeline_config({"schedule": "looped_bfs"}), 2, 2, 5) == "looped_bfs"
    # torch's interleaved 1F1B runs rounds of max(1, m // stages) micro-batches: 6 or 3 with 4 stages work
    assert check_schedule(auto, 4, 2, 6) == check_schedule(auto, 4, 2, 3) == "interleaved_1f1b"


def test_bad_schedule_input_names_the_numbers() -> None:
    def error(section: dict, stages: int, chunks: int, micro: int) -> str:
        with pytest.raises(ValueError) as info:
            check_schedule(read_pipeline_config(section), stages, chunks, micro)
        return str(info.value)

    assert error({}, 4, 2, 9) == (
        "gradient_accumulation_steps: 9 is not a multiple of 2: pipeline.schedule 'interleaved_1f1b' with 4 "
        "stages runs the micro-batches in rounds of max(1, 9 // 4) = 2"
    )
    assert error({"schedule": "interleaved_1f1b"}, 2, 2, 7).startswith(
        "gradient_accumulation_steps: 7 is not a multiple of 3"
    )
    assert error({"schedule": "1f1b"}, 2, 2, 4) == (
        "pipeline.schedule: '1f1b' runs one chunk per stage but the PipelineModule holds 2 chunks per stage; "
        "use one of ['interleaved_1f1b', 'looped_bfs']"
    )
    assert error({"schedule": "Interleaved_1F1B"}, 2, 1, 4) == (
        "pipeline.schedule: 'interleaved_1f1b' interleaves several chunks per stage but the PipelineModule "
        "holds one; build it with PipelineModule(..., chunks_per_stage=2) or use '1f1b'"
    )
    assert error({"chunks_per_stage": 3}, 2, 2, 4) == (
        "pipeline.chunks_per_stage: 3 but the PipelineModule was built with 2 chunks per stage: pass "
        "PipelineModule(..., chunks_per_stage=3) or remove the key"
    )
    with pytest.raises(ValueError, match=r"pipeline.chunks_per_stage: expected an integer >= 1, got 0"):
        read_pipeline_config({"chunks_per_stage": 0})


# -- distributed -------------------------------------------------------------------------------------
def _config(micro_batches: int, dp: int, **extra: Any) -> dict:
    return {
        "train_batch_size": 8 * micro_batches,
        "gradient_accumulation_steps": micro_batches,
        "train_micro_batch_size_per_gpu": 8 // dp,
        "steps_per_print": 0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int) -> dict:
    from runtime.pipe import PipelineEngine, PipelineModule

    out: dict[str, Any] = {}
    # unseeded, DeepSpeed's order: the "parameters" count builds every spec once, then the stage its own
    Recorded.built.clear()
    module = PipelineModule([LayerSpec(Recorded, i) for i in range(8)], num_stages=4, loss_fn=mse)
    out["stage"] = module.stage_id
    out["real"] = [i for i, device in Recorded.built if device != "meta"]
    out["names"] = sorted(n for n, _ in module.named_parameters())
    # seeded, each stage builds its own layers for real, the others only on meta (to count them); two
    # chunks per stage (pp2 x dp2): stage r builds parts r and r + 2 only, names unchanged
    Recorded.built.clear()
    module = PipelineModule(
        [LayerSpec(Recorded, i) for i in range(8)],
        num_stages=2,
        loss_fn=mse,
        chunks_per_stage=2,
        seed_layers=True,
    )
    out["chunk_real"] = sorted(i for i, device in Recorded.built if device != "meta")
    out["chunk_layers"] = [list(chunk.layers) for chunk in module.chunks]
    out["chunk_names"] = sorted(n for n, _ in module.named_parameters())
    out["chunk_forward"] = _error(lambda: module(torch.zeros(4)))
    # a tie first used on stage 1 (layer 1) and again on stage 0 (layer 2, its second chunk): the copies
    # start as the first use's seed makes them, though stage 0 owns the tie (and broadcasts it)
    tied = [LayerSpec(nn.Linear, 2, 2), TiedLayerSpec("t", nn.Linear, 2, 2)]
    tied += [TiedLayerSpec("t", nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2)]
    module = PipelineModule(
        tied, num_stages=2, loss_fn=mse, seed_layers=True, base_seed=BASE_SEED, chunks_per_stage=2
    )
    PipelineEngine(module, _config(2, 2))
    out["tied_weight"] = module.tied_modules["t"].weight.detach().clone()

    # eval_batch against the reference forward
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=mse, seed_layers=True, base_seed=BASE_SEED)
    engine = PipelineEngine(module, _config(2, 2))
    dp_rank = module.grid.get_data_parallel_rank()
    out["eval_avg"] = float(engine.eval_batch(data_iterator("mlp", 0, 2, 8, dp_rank, 2)))
    per_micro, logits = engine.eval_batch(
        data_iterator("mlp", 0, 2, 8, dp_rank, 2), return_logits=True, reduce_output=None
    )
    out["eval_micro"] = per_micro.tolist()
    out["logits"] = logits
    out["dp_rank"] = dp_rank
    out["no_loss"] = engine.eval_batch(data_iterator("mlp", 0, 2, 8, dp_rank, 2), compute_loss=False)
    # the same through two chunks per stage (interleaved 1F1B)
    module = PipelineModule(
        mlp_layers(), num_stages=2, loss_fn=mse, seed_layers=True, base_seed=BASE_SEED, chunks_per_stage=2
    )
    engine = PipelineEngine(module, _config(2, 2))
    out["ieval_avg"] = float(engine.eval_batch(data_iterator("mlp", 0, 2, 8, dp_rank, 2)))
    per_micro, logits = engine.eval_batch(
        data_iterator("mlp", 0, 2, 8, dp_rank, 2), return_logits=True, reduce_output=None
    )
    out["ieval_micro"], out["ilogits"] = per_micro.tolist(), logits
    out["ino_loss"] = engine.eval_batch(data_iterator("mlp", 0, 2, 8, dp_rank, 2), compute_loss=False)
    # after eval, training still matches (the schedule's shapes were inferred for eval first)
    out["itrain"] = float(engine.train_batch(data_iterator("mlp", 0, 2, 8, dp_rank, 2)))

    # a data iterator that runs out mid-batch: every rank stops before any compute, middle stages too
    module4 = PipelineModule(mlp_layers(), num_stages=4, loss_fn=mse)
    engine4 = PipelineEngine(module4, _config(4, 1))
    out["ran_out"] = _error(lambda: engine4.train_batch(data_iterator("mlp", 0, 2, 8, 0, 1)))
    # no iterator on the last stage (pp4 x dp1: rank 3): it says so, every other rank stops too
    engine4.data_iterator = None  # forget the iterator the batch above was given (DeepSpeed keeps it)
    out["no_iterator"] = _error(
        lambda: engine4.train_batch(None if rank == 3 else data_iterator("mlp", 0, 4, 8, 0, 1))
    )
    out["bad_stages"] = _error(lambda: PipelineModule(mlp_layers(), num_stages=3, loss_fn=mse))
    out["too_many_stages"] = _error(lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 3, num_stages=4))
    out["zero3"] = _error(lambda: PipelineEngine(module4, _config(4, 1, zero_optimization={"stage": 3})))
    out["bad_key"] = _error(lambda: PipelineEngine(module4, _config(4, 1, pipeline={"stagez": 2})))
    out["too_many_chunks"] = _error(
        lambda: PipelineModule(mlp_layers(), num_stages=4, loss_fn=mse, chunks_per_stage=3)
    )
    out["zero_chunks"] = _error(lambda: PipelineModule(mlp_layers(), num_stages=4, chunks_per_stage=0))
    out["gpipe_chunks"] = _error(
        lambda: PipelineEngine(
            PipelineModule(mlp_layers(), num_stages=4, loss_fn=mse, chunks_per_stage=2),
            _config(9, 1, pipeline={"schedule": "gpipe"}),
        )
    )
    out["rounds"] = _error(
        lambda: PipelineEngine(
            PipelineModule(mlp_layers(), num_stages=4, loss_fn=mse, chunks_per_stage=2), _config(9, 1)
        )
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return part("module")


def test_each_stage_keeps_its_layers_built_in_deepspeeds_order(results: list[dict]) -> None:
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    everything = list(range(8))
    assert [r["real"] for r in results] == [everything + own for own in ([0, 1], [2, 3], [4, 5], [6, 7])]
    # parameter names carry the global layer index, whatever the partition
    assert results[2]["names"] == ["4.weight", "5.weight"]


def test_each_stage_builds_only_its_chunks(results: list[dict]) -> None:
    """8 layers, 2 stages x 2 chunks: parts [0, 2) [2, 4) [4, 6) [6, 8); stage 0 holds parts 0 and 2."""
    for r in results:
        first = r["stage"] // 2 == 0  # the 4-stage module's stage: ranks 0, 1 are stage 0 at pp2 x dp2
        assert r["chunk_layers"] == ([[0, 1], [4, 5]] if first else [[2, 3], [6, 7]])
        assert r["chunk_real"] == [i for chunk in r["chunk_layers"] for i in chunk]
        assert r["chunk_names"] == [f"{i}.weight" for i in r["chunk_real"]]
        assert r["chunk_forward"] == (
            "this PipelineModule holds 2 chunks per stage, which run as separate pipeline stages: train it "
            "with PipelineEngine, or call module.chunks[i]"
        )


def test_tied_copies_start_from_the_first_use_seed(results: list[dict]) -> None:
    torch.manual_seed(BASE_SEED + 1)
    want = nn.Linear(2, 2).weight.detach()
    for r in results:
        torch.testing.assert_close(r["tied_weight"], want, rtol=0, atol=0)


def test_eval_batch_matches_the_reference_forward(results: list[dict]) -> None:
    model = ReferenceModel(mlp_layers())
    with torch.no_grad():
        outputs = [model(global_micro_batch("mlp", 0, m, 8)[0]) for m in range(2)]
        losses = [float(mse(o, global_micro_batch("mlp", 0, m, 8)[1])) for m, o in enumerate(outputs)]
    for r in results:
        assert r["eval_avg"] == pytest.approx(sum(losses) / 2, rel=1e-5)
        assert r["eval_micro"] == pytest.approx(losses, rel=1e-5)
        assert r["no_loss"] is None
        assert r["ieval_avg"] == pytest.approx(sum(losses) / 2, rel=1e-5)  # two chunks per stage
        assert r["ieval_micro"] == pytest.approx(losses, rel=1e-5)
        assert r["ino_loss"] is None
        assert r["itrain"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    for r in results:  # logits on the last stage only: this data rank's rows of both micro-batches
        if r["stage"] in (0, 1):
            assert r["logits"] is None
        else:
            rows = slice(4 * r["dp_rank"], 4 * r["dp_rank"] + 4)
            torch.testing.assert_close(
                r["logits"], torch.cat([o[rows] for o in outputs]), rtol=1e-5, atol=1e-6
            )
        if r["stage"] in (0, 1):  # ranks 0, 1: stage 0 of pp2 x dp2, which holds chunks 0 and 2 of 4
            assert r["ilogits"] is None
        else:
            rows = slice(4 * r["dp_rank"], 4 * r["dp_rank"] + 4)
            torch.testing.assert_close(
                r["ilogits"], torch.cat([o[rows] for o in outputs]), rtol=1e-5, atol=1e-6
            )


def test_bad_input_is_refused_before_training(results: list[dict]) -> None:
    for r in results:
        assert r["ran_out"] == (
            "the data iterator ran out after 2 of 4 micro-batches (gradient_accumulation_steps) of this batch"
        )
        assert r["bad_stages"] == (
            "PipelineModule(num_stages=3) does not divide the world size 4: every data-parallel replica "
            "needs one rank per stage"
        )
        assert r["no_iterator"] == (
            "stage 3: no data iterator: pass train_batch(data_iter) / eval_batch(data_iter) on the first and "
            "last stage, or give runtime.initialize(training_data=...)"
            if r["stage"] == 3
            else "the first or the last stage could not read this batch's micro-batches (its rank says why: "
            "no data iterator, or not (inputs, labels) pairs)"
        )
        assert r["too_many_stages"].startswith("the pipeline has 4 stages but only 3 layers")
        assert r["zero3"].startswith(
            "zero_optimization.stage: 3 cannot be combined with pipeline parallelism (4 stages)"
        )
        assert r["bad_key"] == 'pipeline.stagez: unknown key; did you mean "stages"?'
        assert r["too_many_chunks"] == (
            "the pipeline has 4 stages x 3 chunks = 12 chunks but only 8 layers; every chunk needs at least "
            "one layer"
        )
        assert r["zero_chunks"] == "PipelineModule(chunks_per_stage=0): expected an integer >= 1, got int 0"
        assert r["gpipe_chunks"] == (
            "pipeline.schedule: 'gpipe' runs one chunk per stage but the PipelineModule holds 2 chunks per "
            "stage; use one of ['interleaved_1f1b', 'looped_bfs']"
        )
        assert r["rounds"].startswith("gradient_accumulation_steps: 9 is not a multiple of 2")
