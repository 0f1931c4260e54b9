"""The public runtime API: environment discovery, initialize(), the engine's accessors and logging,
client optimizers and schedulers, communication volume, and the errors users hit.

Unit tests need no processes; the rest share one 2-rank world started through
runtime.init_distributed() from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (the way a launched job starts).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest
import torch
from torch import nn

import runtime
from runtime.distributed import DistEnvError, first_slurm_host, resolve_dist_env
from tests.support.dist import run_distributed
from tests.support.logs import captured_log
from tests.support.models import loss_fn, make_model, param_groups, rank_batch

# -- environment discovery (pure) ---------------------------------------------------------------------


def test_launcher_and_torchrun_variables() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    got = resolve_dist_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.master_port) == (
        3,
        4,
        1,
        "10.0.0.1",
        1234,
    )
    assert got.source == "env"


def test_no_variables_is_a_one_process_world() -> None:
    got = resolve_dist_env({})
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.source) == (
        0,
        1,
        0,
        None,
        "single-process",
    )


def test_slurm_variables_and_nodelist() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[03-04,09]",
    }
    got = resolve_dist_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr, got.source) == (
        5,
        8,
        1,
        "gpu03",
        "slurm",
    )
    assert first_slurm_host("node7,node8") == "node7"
    assert first_slurm_host("a-b[1-2]") == "a-b1"


def test_openmpi_on_one_host_needs_no_master_addr() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    got = resolve_dist_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.master_addr) == (1, 2, 1, "127.0.0.1")


def test_explicit_rank_wins_over_mpi_and_slurm() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "7", "SLURM_PROCID": "9"}
    assert resolve_dist_env(env).source == "env"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0"}, "WORLD_SIZE is missing"),
        ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}, "rank 4 is not in"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "MASTER_ADDR is not set"),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h"}, "LOCAL_RANK is not set"),
    ],
)
def test_impossible_environments_are_explained(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistEnvError, match=message):
        resolve_dist_env(env)


def test_ds_accelerator_chooses_the_device_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.distributed import current_device, device_for

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # CPU even where GPUs are visible, whatever LOCAL_RANK
    assert device_for(3) == torch.device("cpu") and current_device() == torch.device("cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(DistEnvError, match="DS_ACCELERATOR='xpu' is not supported here; use 'cuda' or 'cpu'"):
        device_for(0)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    if torch.cuda.is_available():
        assert device_for(0) == torch.device("cuda", 0)
    else:
        with pytest.raises(DistEnvError, match="DS_ACCELERATOR=cuda, but torch sees no CUDA device"):
            device_for(0)


# -- initialize(): arguments, before any process group exists ------------------------------------------


def test_config_arguments_parse_like_deepspeed() -> None:
    parser = runtime.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"


def test_config_arguments_take_the_local_rank_every_launcher_passes() -> None:
    """dslaunch and DeepSpeed's launcher append --local_rank=N, torch.distributed.launch --local-rank=N."""
    parser = runtime.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).local_rank == -1
    assert parser.parse_args(["--local_rank=1"]).local_rank == 1
    assert parser.parse_args(["--local-rank", "3"]).local_rank == 3
    # a DeepSpeed script declares its own, before or after the call: it keeps it (and its default)
    before = argparse.ArgumentParser()
    before.add_argument("--local_rank", type=int, default=0)
    runtime.add_config_arguments(before)
    assert before.parse_args([]).local_rank == 0 and before.parse_args(["--local-rank=2"]).local_rank == 2
    after = runtime.add_config_arguments(argparse.ArgumentParser())
    after.add_argument("--local_rank", type=int, default=7, help="mine")
    assert after.parse_args([]).local_rank == 7 and after.parse_args(["--local_rank=2"]).local_rank == 2
    assert "mine" in after.format_help()


def test_input_errors_are_user_errors_and_keep_their_old_bases() -> None:
    from runtime.checkpoint import CheckpointCorrupted, CheckpointError
    from runtime.checkpoint.tensorfile import TensorFileError
    from runtime.config import BatchSizeError, ConfigError
    from runtime.data import DataError

    for cls, old in [
        (ConfigError, ValueError),
        (BatchSizeError, ValueError),
        (DataError, ValueError),
        (TensorFileError, ValueError),
        (CheckpointError, RuntimeError),
        (CheckpointCorrupted, RuntimeError),
        (DistEnvError, RuntimeError),
    ]:
        assert issubclass(cls, runtime.UserError) and issubclass(cls, old), cls
        assert cls.hint, cls  # every one says what to do
    assert ConfigError("a.b", "bad", hint="do x").hint == "do x"
    # training failures the user fixes in the config: one line and a hint too, and still RuntimeErrors
    from runtime.precision.errors import InputDtypeError, LossScaleError, NonfiniteGradientsError

    for cls in (NonfiniteGradientsError, LossScaleError, InputDtypeError):
        assert issubclass(cls, runtime.UserError) and issubclass(cls, RuntimeError), cls
    assert NonfiniteGradientsError("step 3: nan", "lower the LR").hint == "lower the LR"
    from runtime.config import load_config

    with pytest.raises(BatchSizeError, match=r"train_batch_size \(8\) != .* = 6") as info:
        load_config(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1},
            world_size=2,
        )
    assert "micro_batch_size_per_gpu x gradient_accumulation_steps" in info.value.hint


def test_config_given_twice_or_never_is_refused() -> None:
    args = argparse.Namespace(deepspeed_config="ds.json")
    with pytest.raises(ValueError, match="config twice"):
        runtime.initialize(args=args, model=nn.Linear(2, 2), config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="needs a config"):
        runtime.initialize(model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs model"):
        runtime.initialize(config={"train_batch_size": 1})


# -- one 2-rank world for everything that needs a process group -------------------------------------------


def _config(**overrides: Any) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 700},
    }
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def _train(engine: Any, rank: int, world_size: int, steps: int, micro_steps: int = 1) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(micro_steps):
            x, y = rank_batch(step, micro, 3 * world_size, rank, world_size)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _checks(rank: int, world_size: int) -> dict:
    out: dict = {}

    # data loader: DistributedSampler with the micro batch size, disjoint across ranks
    dataset = torch.utils.data.TensorDataset(torch.arange(12.0))
    model = make_model(0)
    engine, optimizer, loader, scheduler = runtime.initialize(
        model=model, training_data=dataset, config=_config()
    )
    out["loader"] = [batch[0].tolist() for batch in loader]
    out["sampler"] = isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    out["returned"] = (optimizer is engine.optimizer, scheduler is None)
    out["device"] = str(engine.device)
    engine.destroy()

    # accessors over an accumulation window of 2
    model = make_model(0)
    engine, _, _, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=_config(gradient_accumulation_steps=2)
    )
    boundaries = []
    for micro in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        x, y = rank_batch(0, micro, 3 * world_size, rank, world_size)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    out["accessors"] = {
        "boundaries": boundaries,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "sizes": (
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ),
        "lr": engine.get_lr(),
        "applied": engine.was_step_applied(),
        "norm_without_clipping": engine.get_global_grad_norm(),
        "loss_scale": engine.loss_scale,
        "state_dict_keys": sorted(engine.full_state_dict(rank0_only=False)) == sorted(model.state_dict()),
        "full_dtypes": {str(t.dtype) for t in engine.full_state_dict(rank0_only=False).values()},
    }
    engine.destroy()

    # a client optimizer is rebuilt on the shards: same class, defaults and per-group options, same result
    results = {}
    for source in ("config", "client", "callable"):
        model = make_model(0)
        groups = param_groups(model, weight_decay=0.3)
        cfg = _config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99]}})
        if source == "client":
            client = torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.99), fused=True)  # as the config's
            engine, optimizer, _, _ = runtime.initialize(
                model=model, optimizer=client, config=_without_optimizer(cfg)
            )
        elif source == "callable":
            engine, optimizer, _, _ = runtime.initialize(
                model=model,
                model_parameters=groups,
                optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.99), fused=True),
                config=_without_optimizer(cfg),
            )
        else:
            engine, optimizer, _, _ = runtime.initialize(model=model, model_parameters=groups, config=cfg)
        _train(engine, rank, world_size, steps=3)
        results[source] = {
            "class": type(optimizer).__name__,
            "weight_decay": [g["weight_decay"] for g in optimizer.param_groups],
            "betas": [tuple(g["betas"]) for g in optimizer.param_groups],
            "masters_are_shards": all(
                p.dtype == torch.float32 and p.dim() == 1 for g in optimizer.param_groups for p in g["params"]
            ),
            "weights": engine.full_state_dict(rank0_only=False),
        }
        engine.destroy()
    out["optimizers"] = results

    # a client scheduler built on the client optimizer drives the engine's learning rate
    model = make_model(0)
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 0.5**s)
    engine, _, _, returned = runtime.initialize(
        model=model, optimizer=client, lr_scheduler=sched, config=_without_optimizer(_config())
    )
    lrs = [engine.get_lr()[0]]
    for _ in range(3):
        _train(engine, rank, world_size, steps=1)
        lrs.append(engine.get_lr()[0])
    out["client_scheduler"] = (returned is sched, lrs)
    engine.destroy()

    # communication volume per step: stage 0 all-reduces the gradients once per step; stage 1
    # reduce-scatters once per step and all-gathers the weights; stage 2 reduce-scatters every micro-step
    volume = {}
    for stage in (0, 1, 2):
        model = make_model(0)
        engine, _, _, _ = runtime.initialize(
            model=model,
            config=_config(
                gradient_accumulation_steps=2,
                bf16={"enabled": True},
                zero_optimization={"stage": stage, "reduce_bucket_size": 700},
            ),
        )
        _train(engine, rank, world_size, steps=1, micro_steps=2)  # warm-up: optimizer state exists
        flat_bytes = sum(g.working.numel() * g.working.element_size() for g in engine.groups)
        engine.comm.counter.reset()
        _train(engine, rank, world_size, steps=1, micro_steps=2)
        counter = engine.comm.counter
        volume[stage] = {
            op: counter.bytes[op] / flat_bytes for op in ("all_reduce", "reduce_scatter", "all_gather")
        }
        volume[stage]["small_all_reduces"] = counter.calls["all_reduce"] if stage else 0
        engine.destroy()
    out["volume"] = volume

    # logging every steps_per_print steps on rank 0, with the wall-clock breakdown
    with captured_log("runtime") as records:
        model = make_model(0)
        engine, _, _, _ = runtime.initialize(
            model=model, config=_config(steps_per_print=2, wall_clock_breakdown=True, gradient_clipping=1.0)
        )
        out["logged_losses"] = _train(engine, rank, world_size, steps=4)
    out["log"] = records
    out["norm_with_clipping"] = engine.get_global_grad_norm()
    engine.destroy()

    # per-tensor optimizers (Lamb) get one master view per parameter at stage 0, and match plain Lamb
    model = make_model(0)
    reference = copy.deepcopy(model)
    lamb = {"type": "Lamb", "params": {"lr": 1e-2}}
    engine, optimizer, _, _ = runtime.initialize(
        model=model, config=_config(optimizer=lamb, zero_optimization={"stage": 0})
    )
    _train(engine, rank, world_size, steps=3)
    from runtime.config import load_config
    from runtime.optim import build_optimizer

    ref_opt = build_optimizer(
        load_config(_config(optimizer=lamb, zero_optimization={"stage": 0}), world_size=1).optimizer,
        reference.parameters(),
    )
    for step in range(3):
        from tests.support.models import global_batch

        x, y = global_batch(step, 0, 3 * world_size)
        loss_fn(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = engine.full_state_dict(rank0_only=False)
    out["lamb"] = {
        "views": [len(g["params"]) for g in optimizer.param_groups],
        "max_diff": max(float((full[n] - p).abs().max()) for n, p in reference.named_parameters()),
    }
    engine.destroy()

    # errors users can cause
    errors = {}
    model = make_model(0)
    engine, _, _, _ = runtime.initialize(model=model, config=_config())
    x, y = rank_batch(0, 0, 3 * world_size, rank, world_size)
    engine.backward(loss_fn(engine(x), y))
    model.zero_grad()  # replaces the engine's gradient views
    errors["model_zero_grad"] = _error_of(engine.step)
    engine.destroy()
    errors["lamb_sharded"] = _error_of(
        lambda: runtime.initialize(
            model=(m := make_model(0)), optimizer=_lamb(m), config=_without_optimizer(_config())
        )
    )
    errors["bad_loss"] = _error_of(lambda: _bad_backward(rank, world_size))
    errors["reentrant_checkpoint"] = _error_of(_reentrant_backward)
    out["errors"] = errors
    return out


class _CheckpointedTwice(nn.Module):
    """Uses one Linear inside a reentrant checkpoint and again outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
        return self.lin(hidden).sum()


def _reentrant_backward() -> None:
    engine, _, _, _ = runtime.initialize(
        model=_CheckpointedTwice(), config=_config(zero_optimization={"stage": 2})
    )
    try:
        engine.backward(engine(torch.randn(2, 4, requires_grad=True)))
    finally:
        engine.destroy()


def _lamb(model: nn.Module) -> torch.optim.Optimizer:
    from runtime.optim import Lamb

    return Lamb(model.parameters(), lr=1e-2)


def _bad_backward(rank: int, world_size: int) -> None:
    engine, _, _, _ = runtime.initialize(model=make_model(0), config=_config())
    try:
        x, _ = rank_batch(0, 0, 3 * world_size, rank, world_size)
        engine.backward(engine(x))  # not a scalar
    finally:
        engine.destroy()


def _without_optimizer(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "optimizer"}


def _error_of(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(_checks, 2, timeout=180, rendezvous="env")


def test_dataloader_splits_the_dataset_over_ranks(world: list[dict]) -> None:
    assert [out["sampler"] for out in world] == [True, True]  # a DistributedSampler (resumable)
    batches = [out["loader"] for out in world]
    assert all(len(b) == 3 for batches_of_rank in batches for b in batches_of_rank[:-1])
    seen = sorted(v for batches_of_rank in batches for b in batches_of_rank for v in b)
    assert seen == [float(i) for i in range(12)]  # every sample once, across both ranks
    assert world[0]["returned"] == (True, True)
    assert world[0]["device"] == "cpu"


def test_accessors_follow_the_accumulation_window(world: list[dict]) -> None:
    acc = world[0]["accessors"]
    assert acc["boundaries"] == [False, True, False, True]
    assert acc["global_steps"] == 2 and acc["global_samples"] == 2 * 12
    assert acc["sizes"] == (12, 3, 2)
    assert acc["lr"] == [1e-2, 1e-2]  # one entry per param group
    assert acc["applied"] is True
    assert acc["norm_without_clipping"] is not None  # computed for the non-finite check (bf16 section)
    assert acc["loss_scale"] == 1.0
    assert acc["state_dict_keys"] and acc["full_dtypes"] == {"torch.float32"}


def test_client_and_callable_optimizers_equal_the_config_optimizer(world: list[dict]) -> None:
    for rank_out in world:
        results = rank_out["optimizers"]
        for source in ("client", "callable"):
            got, want = results[source], results["config"]
            assert got["class"] == want["class"] == "AdamW"
            assert got["weight_decay"] == [0.3, 0.0] and got["betas"] == [(0.8, 0.99)] * 2
            assert got["masters_are_shards"]
            for name, tensor in want["weights"].items():
                assert torch.equal(got["weights"][name], tensor), (source, name)


def test_client_scheduler_drives_the_engine(world: list[dict]) -> None:
    returned, lrs = world[0]["client_scheduler"]
    assert returned
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125])


def test_communication_volume_per_step(world: list[dict]) -> None:
    volume = world[0]["volume"]
    # units: the bytes of the whole flat gradient/parameter buffer
    assert volume[0] == {"all_reduce": 1.0, "reduce_scatter": 0.0, "all_gather": 0.0, "small_all_reduces": 0}
    assert volume[1]["reduce_scatter"] == 1.0 and volume[1]["all_gather"] == 1.0
    assert volume[2]["reduce_scatter"] == 2.0 and volume[2]["all_gather"] == 1.0  # 2 micro-steps
    for stage in (1, 2):
        # one scalar a step: the squared gradient norm the non-finite check reads (bf16.check_grad_overflow)
        assert volume[stage]["small_all_reduces"] == 1


def test_rank0_logs_every_steps_per_print(world: list[dict]) -> None:
    lines = world[0]["log"]
    assert len(lines) == 2 and lines[0].startswith("step=2 ") and lines[1].startswith("step=4 ")
    for part in (
        "loss=",
        "lr=[",
        "grad_norm=",
        "skipped=0",
        "samples/s=",
        "forward_ms=",
        "backward_ms=",
        "step_ms=",
    ):
        assert part in lines[0], (part, lines[0])
    assert world[1]["log"] == []  # other ranks stay quiet
    # the loss is the step's, averaged over every rank (what a script averaging over ranks prints)
    for line, step in zip(lines, (1, 3), strict=True):
        every = [rank_out["logged_losses"][step] for rank_out in world]
        logged = float(line.split("loss=")[1].split()[0])
        assert logged == pytest.approx(sum(every) / len(every), abs=1e-4), line
    assert isinstance(world[0]["norm_with_clipping"], float)


def test_per_tensor_optimizer_gets_one_view_per_parameter(world: list[dict]) -> None:
    lamb = world[0]["lamb"]
    assert lamb["views"] == [8]  # UnevenNet has 8 parameter tensors
    assert lamb["max_diff"] < 1e-5


def test_user_errors_are_explained(world: list[dict]) -> None:
    errors = world[0]["errors"]
    kind, message = errors["model_zero_grad"]
    assert kind == "GradientViewsReplaced" and "engine.zero_grad()" in message
    kind, message = errors["lamb_sharded"]
    assert kind == "ValueError" and "zero_allow_untested_optimizer" in message
    kind, message = errors["bad_loss"]
    assert kind == "ValueError" and "scalar loss" in message
    kind, message = errors["reentrant_checkpoint"]
    assert kind == "RuntimeError" and "twice in one backward" in message and "use_reentrant=False" in message


# -- disable_python_gc ----------------------------------------------------------------------------------


def _python_gc(rank: int, world_size: int) -> dict:
    import gc

    def engine(off: bool) -> Any:
        model = make_model(0)
        config = {**_config(), "disable_python_gc": off}
        return runtime.initialize(model=model, model_parameters=param_groups(model), config=config)[0]

    seen = {"before": gc.isenabled()}
    first, second = engine(True), engine(True)
    _train(first, rank, world_size, steps=1)
    cycle: list[Any] = []
    cycle.append(cycle)  # garbage only the cyclic collector frees
    del cycle
    seen["training"] = gc.isenabled()
    seen["collected"] = first.collect_python_gc()
    first.destroy()
    seen["one engine left"] = gc.isenabled()
    second.destroy()
    seen["after"] = gc.isenabled()
    plain = engine(False)
    seen["without the key"] = gc.isenabled()
    plain.destroy()
    return seen


def test_disable_python_gc_holds_the_collector_off_while_an_engine_lives() -> None:
    """DeepSpeed's `disable_python_gc`: no cyclic collection starts by itself while an engine that asked
    lives (two engines: until both are destroyed), `engine.collect_python_gc()` collects where the loop
    chooses, and the process gets its collector back as it was."""
    (seen,) = run_distributed(_python_gc, 1)
    assert seen["before"] and not seen["training"] and not seen["one engine left"]
    assert seen["collected"] >= 1  # the cycle made during training
    assert seen["after"] and seen["without the key"]


# -- the multi-process test helper itself ---------------------------------------------------------------


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("boom from rank one")
    return rank


def _hang_on_rank_zero(rank: int, world_size: int) -> int:
    import time

    if rank == 0:
        time.sleep(60)
    return rank


def test_dist_helper_reraises_the_failing_rank_with_its_traceback() -> None:
    from tests.support.dist import WorkerFailed

    with pytest.raises(WorkerFailed) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    assert info.value.rank == 1
    assert "KeyError: 'boom from rank one'" in str(info.value) and "_fail_on_rank_one" in str(info.value)


def test_dist_helper_times_out_on_a_hang() -> None:
    from tests.support.dist import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"ranks \[0\] did not finish within 3 s"):
        run_distributed(_hang_on_rank_zero, 2, timeout=3)
