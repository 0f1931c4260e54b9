"""``initialize(mpu=...)``: a Megatron-style model (tests/support/megatron_mpu.py: column/row-parallel MLP
with its own all-reduces) trained at tp2 x dp2 with ZeRO over the mpu's data group.

One spawn of 4 gloo ranks (CPU) runs every case; each engine case is checked against one process training
the whole model on the same global batches (fp32 losses within 1e-5 relative over 8 steps, the clipped
norm, the final weights): ZeRO-1 with Adam (our ParallelGrid as the mpu), ZeRO-2 with SGD (an mpu that
answers only Megatron's newer get_tensor_model_parallel_* names), ZeRO-0 with a client AdamW of two param
groups, ZeRO-2 with the optimizer offloaded to the host, ZeRO-3. Also: a resume from a save repeats the
uninterrupted run, dropout in both random streams included (one folder per model rank; the checkpoint
carries the streams); an inf gradient on one model rank skips the step on every rank; the data loader
splits samples over data-parallel ranks only; the model-parallel random streams differ over the
tensor-parallel ranks inside fork() and agree outside; and bad input is refused with exact messages.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.dist import run_distributed
from tests.support.megatron_mpu import DIM, GridMPU, ParallelMLP, WholeMLP, batch, whole_state

STEPS, SAVE_AT = 8, 4
# (name, which mpu object, ZeRO stage, optimizer, gradient clipping)
CASES = [
    ("grid_zero1_adam", "grid", 1, "Adam", 0.3),
    ("megatron_names_zero2_sgd", "megatron", 2, "SGD", 0.3),
    ("client_adamw_zero0", "grid", 0, "client", 0.0),
    ("offload_zero2_adam", "grid", 2, "Adam", 0.3),
    ("zero3_adam", "grid", 3, "Adam", 0.3),
]


def _config(stage: int, optimizer: str, clip: float, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 0,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
        **extra,
    }
    if optimizer == "Adam":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.02}}
    elif optimizer == "SGD":
        config["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    return config


def _client_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weight decay on the matrices only (names of ParallelMLP or WholeMLP)."""
    decay = [p for n, p in model.named_parameters() if "weight" in n and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not ("weight" in n and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _engine(
    grid: Any, kind: str, stage: int, optimizer: str, clip: float, dropout: float = 0.0, offload: bool = False
) -> Any:
    import runtime

    torch.manual_seed(0)
    group, rank = grid.get_model_parallel_group(), grid.get_model_parallel_rank()
    model = ParallelMLP(WholeMLP(), group, rank, 2, dropout=dropout)
    client = torch.optim.AdamW(_client_groups(model), lr=0.02) if optimizer == "client" else None
    mpu = grid if kind == "grid" else GridMPU(grid)
    config = _config(stage, optimizer, clip)
    if offload:  # the master weights and Adam's state on the host
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return runtime.initialize(model=model, config=config, mpu=mpu, optimizer=client)[0]


def _train(engine: Any, start: int, stop: int, save_dir: str | None = None) -> tuple[list[float], list]:
    import torch.distributed as dist

    losses, norms = [], []
    for step in range(start, stop):
        x, y = batch(step, engine.mpu_groups.data_rank)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=engine.mpu_groups.data_group)
        losses.append(float(mean) / engine.mpu_groups.data_size)
        norms.append(engine.get_global_grad_norm())
        if save_dir is not None and step + 1 == SAVE_AT:
            engine.save_checkpoint(save_dir)
    return losses, norms


def _case(grid: Any, case: tuple) -> dict[str, Any]:
    name, kind, stage, optimizer, clip = case
    engine = _engine(grid, kind, stage, optimizer, clip, offload=name.startswith("offload"))
    losses, norms = _train(engine, 0, STEPS)
    return {
        "losses": losses,
        "norms": norms,
        "state": engine.full_state_dict(rank0_only=False),
        "batch": engine.train_batch_size(),
        "lrs": [g["lr"] for g in engine.optimizer.param_groups],
    }


def _resume(grid: Any, save_dir: str) -> dict[str, Any]:
    """With dropout in both random streams: the checkpoint carries each rank's stream states."""
    from runtime.activation_checkpointing import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(11 + grid.get_data_parallel_rank(), mpu=grid)
    whole, _ = _train(_engine(grid, "grid", 1, "Adam", 0.3, dropout=0.3), 0, STEPS, save_dir)
    model_parallel_cuda_manual_seed(11 + grid.get_data_parallel_rank(), mpu=grid)  # a fresh job's start
    engine = _engine(grid, "grid", 1, "Adam", 0.3, dropout=0.3)
    engine.load_checkpoint(save_dir)
    resumed, _ = _train(engine, SAVE_AT, STEPS)
    return {"whole": whole, "resumed": resumed, "folders": sorted(p.name for p in Path(save_dir).iterdir())}


def _nonfinite(grid: Any) -> dict[str, Any]:
    """An inf in one model rank's gradient (tensor rank 1, data rank 0), at step 2 of 4: the verdict comes
    from the norm summed over the model group, so every rank skips that step, not only the ranks whose
    data group saw the inf."""
    engine = _engine(grid, "grid", 1, "Adam", 0.0)
    poisoned = {"step": -1}
    if (grid.get_model_parallel_rank(), grid.get_data_parallel_rank()) == (1, 0):
        engine.module.fc1_bias.register_hook(
            lambda grad: grad + float("inf") if poisoned["step"] == 1 else grad
        )
    applied = []
    for step in range(4):
        poisoned["step"] = step
        _train(engine, step, step + 1)
        applied.append(engine.was_step_applied())
    return {
        "applied": applied,
        "skipped": engine.skipped_steps,
        "state": engine.full_state_dict(rank0_only=False),
    }


def _loader(grid: Any) -> list[torch.Tensor]:
    import runtime

    data = torch.utils.data.TensorDataset(torch.arange(16.0).view(16, 1).expand(16, DIM).contiguous())
    torch.manual_seed(0)
    model = ParallelMLP(WholeMLP(), grid.get_model_parallel_group(), grid.get_model_parallel_rank(), 2)
    config = _config(1, "Adam", 0.0)
    _, _, loader, _ = runtime.initialize(model=model, config=config, mpu=grid, training_data=data)
    return [loader.sampler.num_replicas, loader.sampler.rank, next(iter(loader))[0][:, 0]]


def _streams(grid: Any) -> dict[str, torch.Tensor]:
    from runtime import activation_checkpointing

    activation_checkpointing.configure(grid)
    activation_checkpointing.model_parallel_cuda_manual_seed(123)
    outside = torch.rand(6)
    with activation_checkpointing.get_cuda_rng_tracker().fork():
        inside = torch.rand(6)
    from runtime.deepspeed_api import collectives  # deepspeed.utils.groups

    groups = [collectives._get_data_parallel_world_size(), collectives._get_data_parallel_rank(),
              collectives._get_model_parallel_world_size(), grid.get_data_parallel_rank()]  # fmt: skip
    activation_checkpointing.configure()
    return {"outside": outside, "inside": inside, "groups": groups}


class _SizeLies:
    """The grid's groups, but a data-parallel size that the group does not have."""

    def __init__(self, grid: Any) -> None:
        self.grid = grid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def get_data_parallel_world_size(self) -> int:
        return 3


class _SmallData(_SizeLies):
    """A data-parallel group of one rank (each its own), so 2 x 1 ranks do not cover the world."""

    def __init__(self, grid: Any, alone: Any) -> None:
        super().__init__(grid)
        self.alone = alone

    def get_data_parallel_group(self) -> Any:
        return self.alone

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0


def _bad_input(grid: Any) -> dict[str, str]:
    import torch.distributed as dist

    import runtime
    from runtime.parallel import ParallelGrid, topology_for
    from tests.support.tp_models import GPT2Block, TinyLM

    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    pipe_grid = ParallelGrid(topology_for(4, pp=2, tp=2))
    cases = {
        "batch": (grid, _config(1, "Adam", 0.0, train_batch_size=5, train_micro_batch_size_per_gpu=None)),
        "pipeline": (pipe_grid, _config(1, "Adam", 0.0)),
        "size_lies": (_SizeLies(grid), _config(1, "Adam", 0.0)),
        "product": (_SmallData(grid, alone), _config(1, "Adam", 0.0)),
        "autotp": (grid, _config(1, "Adam", 0.0, tensor_parallel={"autotp_size": 2})),
    }
    out = {}
    try:  # AutoTP (its own engine over the grid) stops at stage 2
        config = _config(3, "Adam", 0.0, tensor_parallel={"autotp_size": 2})
        runtime.initialize(model=TinyLM(GPT2Block), config=config)
        out["autotp_stage3"] = "no error"
    except ValueError as error:
        out["autotp_stage3"] = f"{type(error).__name__}: {error}"
    for name, (mpu, config) in cases.items():
        config = {k: v for k, v in config.items() if v is not None}
        model = ParallelMLP(WholeMLP(), grid.get_model_parallel_group(), grid.get_model_parallel_rank(), 2)
        try:
            runtime.initialize(model=model, config=config, mpu=mpu)
            out[name] = "no error"
        except ValueError as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _worker(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    from runtime.parallel import ParallelGrid, topology_for

    grid = ParallelGrid(topology_for(world_size, tp=2))
    out: dict[str, Any] = {"tp": grid.get_model_parallel_rank(), "dp": grid.get_data_parallel_rank()}
    out["cases"] = [_case(grid, case) for case in CASES]
    out["resume"] = _resume(grid, save_dir)
    out["nonfinite"] = _nonfinite(grid)
    out["loader"] = _loader(grid)
    from runtime.deepspeed_api.config_view import DeepSpeedConfig

    ds_config = DeepSpeedConfig(_config(1, "Adam", 0.0, train_micro_batch_size_per_gpu=None), mpu=grid)
    out["ds_config"] = (ds_config.world_size, ds_config.train_micro_batch_size_per_gpu)
    out["streams"] = _streams(grid)
    out["bad"] = _bad_input(grid)
    return out


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="dslaunch-mpu-") as save_dir:
        return run_distributed(_worker, 4, save_dir, timeout=300)


def _reference(optimizer: str, clip: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = WholeMLP()
    if optimizer == "Adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    elif optimizer == "SGD":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(_client_groups(model), lr=0.02)
    losses, norms = [], []
    for step in range(STEPS):
        pieces = [batch(step, d) for d in range(2)]
        x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case[0] for case in CASES])
def test_tp2_dp2_with_an_mpu_matches_one_process(world4: list[dict[str, Any]], index: int) -> None:
    _, _, _, optimizer, clip = CASES[index]
    ref = _reference(optimizer, clip)
    by_tp: dict[int, dict[str, torch.Tensor]] = {}
    for rank, r in enumerate(world4):
        got = r["cases"][index]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
        if clip > 0:
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank}"
        assert got["batch"] == 8  # train_batch_size counts the 2 data-parallel ranks, not the 4 ranks
        by_tp[r["tp"]] = got["state"]
    state = whole_state([by_tp[0], by_tp[1]])
    for key, want in ref["state"].items():
        torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_client_optimizer_keeps_its_groups(world4: list[dict[str, Any]]) -> None:
    index = [case[0] for case in CASES].index("client_adamw_zero0")
    # the two user groups, each split into its model-parallel and its replicated part
    assert world4[0]["cases"][index]["lrs"] == [0.02] * 4


def test_resume_repeats_the_uninterrupted_run(world4: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(world4):
        got = r["resume"]
        assert got["resumed"] == pytest.approx(got["whole"][SAVE_AT:], rel=1e-6, abs=0), f"rank {rank}"
        assert got["folders"] == ["mp_rank_00_of_02", "mp_rank_01_of_02"]


def test_a_nonfinite_gradient_on_one_model_rank_skips_the_step_everywhere(
    world4: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(world4):
        assert r["nonfinite"]["applied"] == [True, False, True, True], f"rank {rank}"
        assert r["nonfinite"]["skipped"] == 1
    for tp in (0, 1):  # the data ranks of each model rank still hold the same weights
        same = [r["nonfinite"]["state"] for r in world4 if r["tp"] == tp]
        for key, value in same[0].items():
            assert torch.equal(value, same[1][key]), (tp, key)


def test_deepspeed_config_counts_the_mpus_data_parallel_ranks(world4: list[dict[str, Any]]) -> None:
    # train_batch_size 8 over 2 data-parallel ranks (not 4 ranks): micro batch 4
    assert [r["ds_config"] for r in world4] == [(2, 4)] * 4


def test_loader_splits_samples_over_data_parallel_ranks_only(world4: list[dict[str, Any]]) -> None:
    first = {}
    for r in world4:
        replicas, rank, samples = r["loader"]
        assert (replicas, rank) == (2, r["dp"])
        first.setdefault(r["dp"], []).append(samples)
    for dp, seen in first.items():
        assert torch.equal(seen[0], seen[1]), f"model ranks of data rank {dp} read different samples"
    assert not torch.equal(first[0][0], first[1][0])


def test_random_streams_differ_over_tensor_parallel_ranks_inside_fork_only(
    world4: list[dict[str, Any]],
) -> None:
    streams = {(r["tp"], r["dp"]): r["streams"] for r in world4}
    for r in world4:
        assert torch.equal(r["streams"]["outside"], world4[0]["streams"]["outside"])
    for dp in (0, 1):
        assert not torch.equal(streams[(0, dp)]["inside"], streams[(1, dp)]["inside"])
    for tp in (0, 1):  # the same seed on every data rank: the user's choice
        assert torch.equal(streams[(tp, 0)]["inside"], streams[(tp, 1)]["inside"])


def test_deepspeed_utils_groups_answer_with_the_mpus_groups(world4: list[dict[str, Any]]) -> None:
    # deepspeed.utils.groups: with an mpu, the data-parallel group is the mpu's, not the world
    for out in world4:
        data_size, data_rank, model_size, grid_data_rank = out["streams"]["groups"]
        assert (data_size, model_size, data_rank) == (2, 2, grid_data_rank)


def test_bad_input_is_refused_naming_the_numbers(world4: list[dict[str, Any]]) -> None:
    for r in world4:
        bad = r["bad"]
        assert bad["batch"] == (
            "ConfigError: train_batch_size: 5 is not divisible by the data-parallel size 2 (model-parallel "
            "size 2 x data-parallel size 2 = 4 ranks)"
        )
        assert bad["autotp_stage3"] == (
            "ConfigError: zero_optimization.stage: 3 with tensor parallelism (AutoTP) (model-parallel size "
            "2 x data-parallel size 2) is not supported; use stage 0, 1 or 2"
        )
        assert bad["pipeline"] == (
            "MpuError: the mpu (ParallelGrid) has 2 pipeline stages (get_pipe_parallel_world_size()); "
            "initialize(mpu=...) trains tensor x data parallelism only"
        )
        assert bad["size_lies"] == (
            "MpuError: the mpu (_SizeLies): get_data_parallel_group() is a group of 2 ranks, but "
            "get_data_parallel_world_size() says 3"
        )
        assert bad["product"] == (
            "MpuError: the mpu (_SmallData) describes 2 model-parallel x 1 data-parallel = 2 ranks, but "
            "the job has 4"
        )
        assert bad["autotp"] == (
            "ConfigError: tensor_parallel.autotp_size: initialize got both mpu=... and "
            "tensor_parallel.autotp_size > 1: the mpu's model already is tensor parallel; pass one of them"
        )


def test_an_mpu_without_the_methods_is_refused_by_name() -> None:
    from runtime.parallel.mpu import MpuError, resolve_mpu

    with pytest.raises(MpuError) as info:
        resolve_mpu(object(), world_size=4)
    assert str(info.value) == (
        "the mpu (object) has no get_data_parallel_group(), get_data_parallel_world_size(), "
        "get_data_parallel_rank(), get_model_parallel_group(), get_model_parallel_world_size(), "
        "get_model_parallel_rank()"
    )
