"""Which device the suite trains on: the CPU over gloo by default, on every machine; CUDA over NCCL only in
tests marked `gpu` (see tests/conftest.py).

On a GPU host the engine would otherwise pick cuda:LOCAL_RANK while a test feeds it CPU tensors. The CPU
tests here pretend that torch sees two GPUs (`_pretend_two_gpus`, inside a worker process or undone
after the test), so that any path that consults CUDA instead of `DS_ACCELERATOR` fails on this machine
too; nothing CUDA ever runs under the pretence, since `DS_ACCELERATOR=cpu` decides before it is read.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch
from tests.support.paths import REPO

ROOT = REPO
ROWS = 12


def _pretend_two_gpus(patch: pytest.MonkeyPatch | None = None) -> None:
    """torch.cuda reports two devices (in this process: a worker's, or undone by `patch`)."""
    for name, value in (("is_available", lambda: True), ("device_count", lambda: 2)):
        if patch is None:
            setattr(torch.cuda, name, value)
        else:
            patch.setattr(torch.cuda, name, value)


def test_the_session_trains_on_the_cpu_and_every_subprocess_inherits_it() -> None:
    assert os.environ["DS_ACCELERATOR"] == "cpu"  # set by conftest for the whole session
    probe = (
        "import os, runtime.distributed as d; "
        "print(os.environ['DS_ACCELERATOR'], d.accelerator(), d.current_device())"
    )
    env = {**os.environ, "LOCAL_RANK": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpu", "cpu", "cpu"]


def _engine_on_local_rank_1(rank: int, world_size: int) -> dict:
    import runtime

    _pretend_two_gpus()
    os.environ["LOCAL_RANK"] = "1"  # the second GPU's rank on a two-GPU host
    model = make_model(0)
    config = {
        "train_batch_size": ROWS,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    x, y = rank_batch(0, 0, ROWS, rank, world_size)  # CPU tensors, as every CPU test feeds
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
    out = {
        "device": str(engine.device),
        "params": sorted({str(p.device) for p in engine.module.parameters()}),
        "loss": float(loss),
        "steps": engine.global_steps,
    }
    engine.destroy()
    return out


def test_the_engine_trains_on_the_cpu_whatever_local_rank_says_when_ds_accelerator_is_cpu() -> None:
    got = run_distributed(_engine_on_local_rank_1, 1, timeout=120)[0]
    assert got["device"] == "cpu" and got["params"] == ["cpu"], got
    assert got["steps"] == 1 and 0.0 < got["loss"] < 10.0, got


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"{name}_under_test", ROOT / "scripts" / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_benchmarks_train_where_ds_accelerator_says_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --device the throughput and offload benchmarks follow DS_ACCELERATOR (CUDA where torch
    sees a GPU, unless it says cpu); --device wins, and the throughput bench checks its value."""
    throughput, offload = _bench("train_throughput"), _bench("offload")
    _pretend_two_gpus(monkeypatch)
    assert throughput.parse_args([]).device == torch.device("cpu")
    assert offload.parse_args([]).device == "cpu"
    monkeypatch.delenv("DS_ACCELERATOR")
    assert throughput.parse_args([]).device == torch.device("cuda", 0)
    assert offload.parse_args([]).device == "cuda"
    assert throughput.parse_args(["--device", "cpu"]).device == torch.device("cpu")
    assert throughput.parse_args(["--device", "cuda:1"]).device == torch.device("cuda", 1)
    assert offload.parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        throughput.parse_args(["--device", "xpu"])


def _engine_on_cuda(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import runtime

    model = make_model(0)
    config = {"train_batch_size": ROWS, "steps_per_print": 0, "optimizer": {"type": "AdamW"}}
    engine, *_ = runtime.initialize(model=model, model_parameters=param_groups(model), config=config)
    x, y = (t.to(engine.device) for t in rank_batch(0, 0, ROWS, rank, world_size))
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    out = {
        "device": str(engine.device),
        "backend": dist.get_backend(),
        "accelerator": os.environ["DS_ACCELERATOR"],
    }
    engine.destroy()
    return out


@pytest.mark.gpu
def test_a_gpu_test_trains_on_cuda_over_nccl() -> None:
    assert os.environ["DS_ACCELERATOR"] == "cuda"  # set by conftest for this test alone
    got = run_distributed(_engine_on_cuda, 1, timeout=120, device="cuda")[0]
    assert got == {"device": "cuda:0", "backend": "nccl", "accelerator": "cuda"}, got
