"""PyTorch Lightning's ``DeepSpeedStrategy`` on dslaunch through the `deepspeed` compat package, as its users
run it (``python train.py``; Lightning starts the second process), on CPU over gloo (tests/scripts/
lightning_fit.py says what it lifts of Lightning's CUDA-only checks): Lightning's default DeepSpeed config
(its "aio" section included), ``deepspeed.utils.logging``, ``init_distributed``, ``zero.Init`` around
``configure_model``, the engine's backward and step through Lightning's precision plugin.

ZeRO stages 2 and 3 at 2 processes train with the loss of every step equal to Lightning's DDP strategy, at
stage 3 also with the model built in ``configure_model`` (inside ``zero.Init``, then ``module.to(dtype)``).
ModelCheckpoint saves every epoch through ``engine.save_checkpoint(..., exclude_frozen_parameters=...)``,
and ``trainer.fit(..., ckpt_path=...)`` resumes from epoch 1 with the same curve as the run that went on
(``engine.load_checkpoint`` with Lightning's arguments). A checkpoint saved without its frozen parameters
holds none of them, and loads only non-strictly (DeepSpeed's rule; Lightning's ``strict_loading``). A DDP
run's one-file checkpoint loads into ZeRO-3 with ``load_full_weights=True`` (weights only, as Lightning says).
Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` turns a ZeRO-3 folder into the file DDP saved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.checkpoint.load import read_engine_state
from tests.support.paths import REPO

REPO = REPO
SCRIPT = REPO / "tests" / "scripts" / "lightning_fit.py"
FIRST = "epoch=0-step=5.ckpt"
LAST = "epoch=1-step=10.ckpt"


def run_all(jobs: dict[str, list[str]], cwd: Path) -> dict[str, tuple[int, str]]:
    # CPU workers; a GPU host hides its GPUs. Lightning's own launcher picks a free port.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, "--out", f"{name}.json"],
            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, args in jobs.items()
    }  # fmt: skip
    return {name: (proc.wait(timeout=240), proc.communicate()[0]) for name, proc in procs.items()}


def losses(cwd: Path, name: str, runs: dict[str, tuple[int, str]]) -> list[float]:
    code, output = runs[name]
    assert code == 0, output[-4000:]
    got = json.loads((cwd / f"{name}.json").read_text())
    assert got["global_step"] == 10
    return got["losses"]


def assert_equal(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def test_lightning_deepspeed_stages_2_and_3_match_ddp_and_resume(tmp_path: Path) -> None:
    runs = run_all(
        {
            "ddp": ["--strategy", "ddp", "--save", "ddp"],
            "z2": ["--strategy", "z2", "--exclude_frozen", "--save", "z2"],
            "z3": ["--strategy", "z3", "--save", "z3", "--evaluate"],
            # built in configure_model, inside zero.Init; Lightning's precision plugin's module.to(dtype)
            # and its teardown's module.cpu() then meet sharded parameters (no-op conversions)
            "z3-configure": ["--strategy", "z3", "--configure_model"],
        },
        tmp_path,
    )
    ddp = losses(tmp_path, "ddp", runs)
    assert ddp[-1] < ddp[0] and len(ddp) == 10
    for stage in ("z2", "z3", "z3-configure"):
        assert_equal(losses(tmp_path, stage, runs), ddp)

    def frozen_saved(stage: str) -> set[str]:
        extras = read_engine_state(tmp_path / stage / FIRST / "checkpoint")["module_extras"]
        return {key for key in extras if key.startswith("frozen.")}

    assert frozen_saved("z2") == set()  # exclude_frozen_parameters=True
    assert frozen_saved("z3") == {"frozen.weight", "frozen.bias"}
    assert_converts_as_ddp_saved(tmp_path)

    resumed = run_all(
        {
            "z2-resume": ["--strategy", "z2", "--exclude_frozen", "--resume", f"z2/{FIRST}"],
            "z3-resume": ["--strategy", "z3", "--resume", f"z3/{FIRST}"],
            "z2-strict": ["--strategy", "z2", "--resume", f"z2/{FIRST}"],
            "z3-full": ["--strategy", "z3", "--load_full_weights", "--resume", f"ddp/{FIRST}"],
            # validate/test/predict in a fresh process: an engine without an optimizer loads the weights
            "z3-eval": ["--strategy", "z3", "--epochs", "0", "--evaluate", "--resume", f"z3/{LAST}"],
        },
        tmp_path,
    )
    for stage in ("z2", "z3"):
        assert_equal(losses(tmp_path, f"{stage}-resume", resumed), ddp[5:])
    # DDP's one-file checkpoint into ZeRO-3 (load_full_weights): the weights, not the optimizer state,
    # as Lightning warns: the first step's loss is DDP's, the curve then goes its own way.
    full = losses(tmp_path, "z3-full", resumed)
    assert len(full) == 5 and abs(full[0] - ddp[5]) <= 1e-5 * ddp[5] and full[1] != ddp[6]
    # After fit in the same process, and from the ZeRO-3 folder in a new one: the numbers plain PyTorch
    # gives with the weights DDP saved at the end
    after_fit = json.loads((tmp_path / "z3.json").read_text())
    code, output = resumed["z3-eval"]
    assert code == 0, output[-4000:]
    from_folder = json.loads((tmp_path / "z3-eval.json").read_text())
    assert from_folder["losses"] == []  # nothing trained
    want = evaluated_by_hand(tmp_path / "ddp" / LAST)
    for got in (after_fit, from_folder):
        for key in ("val", "test"):
            assert abs(got[key] - want[key]) <= 1e-5 * want[key], (key, got[key], want[key])
        assert len(got["predict"]) == len(want["predict"]) == 10
        assert all(abs(a - b) <= 1e-5 for a, b in zip(got["predict"], want["predict"], strict=True))
    code, output = resumed["z2-strict"]
    assert code != 0
    assert "missing in the checkpoint: frozen.bias, frozen.weight" in output, output[-3000:]


def evaluated_by_hand(checkpoint: Path) -> dict:
    """What validate, test and predict give on 2 ranks, computed in this process from a DDP checkpoint:
    Lightning's DistributedSampler gives rank r every other sample from r; logged means are over all 20
    samples (equal batches), and rank 0 writes its own predictions."""
    import torch

    spec = importlib.util.spec_from_file_location("lightning_fit", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = script.Regression()
    model.load_state_dict(torch.load(checkpoint, weights_only=False)["state_dict"])
    x, y = script.data().dataset.tensors
    with torch.no_grad():
        out = model(x)
    return {
        "val": torch.nn.functional.mse_loss(out, y).item(),
        "test": torch.nn.functional.l1_loss(out, y).item(),
        "predict": out[0::2].flatten().tolist(),
    }


def assert_converts_as_ddp_saved(tmp_path: Path) -> None:
    """Lightning's one-file recipe for a ZeRO checkpoint folder (its DeepSpeed docs): the file holds the
    same weights and Lightning state as DDP's checkpoint of the same epoch, and loads as Lightning's own."""
    import torch
    from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    ddp = torch.load(tmp_path / "ddp" / FIRST, weights_only=False)
    out = tmp_path / "z3.pt"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "z3" / FIRST, out)
    got = torch.load(out, weights_only=False)
    assert (got["epoch"], got["global_step"]) == (ddp["epoch"], ddp["global_step"]) == (0, 5)
    assert got["pytorch-lightning_version"] == ddp["pytorch-lightning_version"]
    assert got["loops"]["fit_loop"]["epoch_progress"] == ddp["loops"]["fit_loop"]["epoch_progress"]
    assert got["state_dict"].keys() == ddp["state_dict"].keys()  # frozen parameters included
    for key, want in ddp["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], want, rtol=1e-5, atol=1e-6, msg=key)
    spec = importlib.util.spec_from_file_location("lightning_fit", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    loaded = script.Regression.load_from_checkpoint(out)  # Lightning's loader, its default weights_only
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in got["state_dict"].items())


def test_every_lightning_deepspeed_strategy_config_is_read_and_nvme_still_refused() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    from runtime.config import ConfigError, load_config

    names = [name for name in StrategyRegistry.available_strategies() if name.startswith("deepspeed")]
    assert "deepspeed_stage_3_offload_nvme" in names and len(names) == 7
    for name in names:
        config = StrategyRegistry.get(name).config
        assert "aio" in config  # Lightning writes it whatever is offloaded
        # Lightning adds the micro-batch size before it calls deepspeed.initialize
        config = {**config, "train_micro_batch_size_per_gpu": 1}
        if name.endswith("nvme"):
            with pytest.raises(ConfigError, match=r'offload_optimizer\.device: "nvme" is not supported'):
                load_config(config, world_size=2)
            continue
        read = load_config(config, world_size=2)
        assert read.zero_optimization.stage == config["zero_optimization"]["stage"], name
        offloaded = "offload" in name
        assert (read.zero_optimization.offload_optimizer.device == "cpu") == offloaded, name
