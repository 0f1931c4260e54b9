"""Every DeepSpeed name issue 20 lists, called through the `deepspeed` compat package, on 2 gloo ranks,
with what each returns checked against DeepSpeed's documented meaning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.dist import run_distributed
from tests.support.paths import REPO


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **extra},
        "steps_per_print": float("inf"),  # what Accelerate writes for "never"
    }


def _step(engine: Any, rank: int) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()


def _comm_and_accelerator(rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed
    import deepspeed.comm as dscomm
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    dist.destroy_process_group()  # init_distributed must build the group itself, from the environment
    assert not dscomm.is_initialized()
    dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    assert dscomm.is_initialized() and dscomm.get_backend() == "gloo"
    assert (dscomm.get_rank(), dscomm.get_world_size(), dscomm.get_local_rank()) == (rank, world_size, rank)
    dscomm.barrier()
    t = torch.tensor([float(rank + 1)])
    dscomm.all_reduce(t, op=dscomm.ReduceOp.SUM, prof=False, log_name="x")  # logger keywords accepted
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dscomm.all_gather(gathered, torch.tensor([float(rank)]))
    b = torch.tensor([float(rank + 10)])
    dscomm.broadcast(b, src=1)
    out = torch.zeros(1)
    dscomm.reduce_scatter_fn(out, torch.tensor([1.0, 2.0]) * (rank + 1))
    flat = torch.zeros(world_size)
    dscomm.allgather_fn(flat, torch.tensor([float(rank)]))

    accel = get_accelerator()
    return {
        "sum": t.item(),
        "gathered": [g.item() for g in gathered],
        "broadcast": b.item(),
        "reduce_scatter": out.item(),
        "allgather_fn": flat.tolist(),
        "accelerator": (accel.device_name(), accel.device_name(rank), accel.current_device_name(),
                        accel.communication_backend_name(), accel.is_available(), accel.device_count()),
        "version": deepspeed.__version__,
    }  # fmt: skip


def test_comm_and_accelerator() -> None:
    results = run_distributed(_comm_and_accelerator, 2)
    for rank, r in enumerate(results):
        assert r["sum"] == 3.0
        assert r["gathered"] == [0.0, 1.0]
        assert r["broadcast"] == 11.0
        assert r["reduce_scatter"] == [3.0, 6.0][rank]  # chunk `rank` of (1+2)*[1, 2]
        assert r["allgather_fn"] == [0.0, 1.0]
        assert r["accelerator"] == ("cpu", "cpu", "cpu", "gloo", True, 2)
        assert r["version"] == "0.20.2+dslaunch.0.1.0"


def _engine_names(rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed.utils import (
        RepeatingLoader,
        log_dist,
        logger,
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        zero_to_fp32,
    )

    from runtime.deepspeed_api.unsupported import UnsupportedFeature

    seen: dict[str, Any] = {}
    model = _model()
    engine, _, _, _ = deepspeed.initialize(model=model, config_params=_config(2))
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)
    seen["accessors"] = (
        engine.local_rank,
        engine.global_rank,
        engine.world_size,
        engine.fp16_enabled(),
        engine.bfloat16_enabled(),
        engine.zero_optimization_stage(),
        engine.steps_per_print(),
    )
    seen["config_get"] = (
        engine.config.get("zero_optimization")["stage"],
        engine.config.get("no_such", "dflt"),
    )
    _step(engine, rank)
    probe = torch.ones(3, 4)
    before = engine(probe).detach()
    engine.compile(backend="eager")  # in place: the engine's gradient hooks stay
    seen["compiled"] = (engine.is_compiled, torch.equal(engine(probe).detach(), before))
    _step(engine, rank)

    weight = model[0].weight
    full = safe_get_full_fp32_param(weight)
    seen["fp32_param_equal"] = torch.equal(full, weight.detach().float())
    # ZeRO-2 shards Adam's state over the 2 ranks: the full tensor is put back together from both shards
    seen["exp_avg_sq"] = safe_get_full_optimizer_state(weight, "exp_avg_sq")
    safe_set_full_fp32_param(weight, torch.full_like(full, 0.25))
    seen["after_set"] = (
        safe_get_full_fp32_param(weight).unique().tolist(),
        weight.detach().unique().tolist(),
    )
    try:
        safe_get_full_grad(weight)
        seen["full_grad_stage2"] = "returned"
    except UnsupportedFeature as error:
        seen["full_grad_stage2"] = str(error)

    # zero_to_fp32 reads the engine's own checkpoint back whole, without a process group
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt") if rank == 0 else None
        import torch.distributed as dist

        box = [path]
        dist.broadcast_object_list(box, src=0)
        engine.save_checkpoint(box[0])
        whole = engine.full_state_dict()
        dist.barrier()
        if rank == 0:
            restored = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(box[0])
            seen["zero_to_fp32_equal"] = sorted(restored) == sorted(whole) and all(
                torch.equal(restored[k], whole[k]) for k in whole
            )
        dist.barrier()

    big = torch.arange(100.0)
    cloned = clone_tensors_for_torch_save({"a": [big[:3]], "b": (big[5:6],)})
    seen["clone"] = (cloned["a"][0].untyped_storage().nbytes(), cloned["b"][0].tolist())
    seen["schedules"] = sorted(VALID_LR_SCHEDULES)
    seen["logger"] = (isinstance(logger, logging.Logger), logger.name)
    log_dist("compat api test", ranks=[0])
    loader = RepeatingLoader([1, 2])
    seen["repeating"] = [next(loader) for _ in range(5)]
    ds_config = DeepSpeedConfig(_config(2))
    seen["ds_config"] = (
        ds_config.train_batch_size,
        ds_config.zero_optimization_stage,
        ds_config.zero_enabled,
    )
    see_memory_usage("compat api test", force=True)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "lr": 1}
    )
    seen["moe_groups"] = (len(groups), len(groups[0]["params"]), groups[0]["lr"])
    return seen


def test_engine_and_utility_names() -> None:
    results = run_distributed(_engine_names, 2)
    for rank, seen in enumerate(results):
        assert seen["accessors"] == (rank, rank, 2, False, False, 2, 0)
        assert seen["config_get"] == (2, "dflt")
        assert seen["compiled"] == (True, True)
        assert seen["fp32_param_equal"] is True
        assert seen["after_set"] == ([0.25], [0.25])
        assert "safe_get_full_grad under ZeRO stage 2" in seen["full_grad_stage2"]
        assert seen["clone"] == (3 * 4, [5.0])
        assert seen["schedules"] == ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
        assert seen["logger"] == (True, "DeepSpeed")
        assert seen["repeating"] == [1, 2, 1, 2, 1]
        assert seen["ds_config"] == (4, 2, True)
        assert seen["moe_groups"] == (1, 4, 1)
    assert results[0]["zero_to_fp32_equal"] is True
    # the reference: plain AdamW fed both ranks' batches for the same two steps
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        loss = sum(model(x).square().mean() for x in xs) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    want = opt.state[model[0].weight]["exp_avg_sq"]
    for seen in results:
        assert seen["exp_avg_sq"].shape == want.shape
        assert torch.allclose(seen["exp_avg_sq"], want, rtol=1e-3, atol=1e-9), (seen["exp_avg_sq"], want)


def _zero3_names(rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters

    from runtime.deepspeed_api.unsupported import UnsupportedFeature

    seen: dict[str, Any] = {}
    config = _config(3, stage3_gather_16bit_weights_on_model_save=True,
                     offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})  # fmt: skip
    seen["same_init"] = deepspeed.zero.Init is partition_parameters.Init
    with deepspeed.zero.Init(remote_device="cpu", pin_memory=True, config_dict_or_path=config):
        model = _model()
    reference = _model()  # the same seed, built whole
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config_params=config)
    seen["gather_on_save"] = engine.zero_gather_16bit_weights_on_model_save()
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        seen["consolidated_equal"] = sorted(state) == sorted(reference.state_dict()) and all(
            torch.equal(state[k], v) for k, v in reference.state_dict().items()
        )
    else:
        seen["consolidated_equal"] = state == {}
    with deepspeed.zero.GatheredParameters([model[2].bias], modifier_rank=0):
        if rank == 0:
            model[2].bias.data.fill_(7.0)
    with deepspeed.zero.GatheredParameters([model[2].bias]):
        seen["modified_bias"] = model[2].bias.detach().unique().tolist()
    try:
        deepspeed.zero.register_external_parameter(model[0], model[2].weight)
        seen["external"] = "accepted"
    except UnsupportedFeature as error:
        seen["external"] = str(error)
    plain = _model()
    deepspeed.zero.register_external_parameter(plain[0], plain[2].weight)  # whole parameters: nothing to do
    _step(engine, rank)
    return seen


def test_zero3_names() -> None:
    results = run_distributed(_zero3_names, 2)
    for seen in results:
        assert seen["same_init"] is True
        assert seen["gather_on_save"] is True
        assert seen["consolidated_equal"] is True
        assert seen["modified_bias"] == [7.0]
        assert "register_external_parameter for a ZeRO-3-sharded parameter" in seen["external"]


def _pipeline_through_initialize(rank: int, world_size: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, 4, 8), nn.ReLU(), LayerSpec(nn.Linear, 8, 1)]
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.functional.mse_loss)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    initial = {name: value.clone() for name, value in module.state_dict().items()}  # this stage's layers
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(2)]
    loss = engine.train_batch(iter(batches))
    out = {"engine": type(engine).__name__, "loss": float(loss), "stage": engine.stage_id, "initial": initial}
    try:
        deepspeed.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 2, "tensor_parallel": {
            "autotp_size": 4}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})  # fmt: skip
    except Exception as error:
        out["tp_error"] = str(error)
    return out


def test_pipeline_and_tensor_parallel_configs_reach_their_engines_through_initialize() -> None:
    import deepspeed
    import deepspeed.runtime.pipe.topology

    from runtime.pipe import PipelineModule
    from runtime.tensor_parallel import tp_model_init

    assert deepspeed.PipelineModule is PipelineModule and deepspeed.tp_model_init is tp_model_init
    assert deepspeed.runtime.pipe.topology.PipeDataParallelTopology(2, 1).get_dim("pipe") == 2
    results = run_distributed(_pipeline_through_initialize, 2)
    # the reference: the same two micro-batches through the whole model (the stages' initial weights, by
    # global layer index), averaged
    initial = {**results[0]["initial"], **results[1]["initial"]}
    first, second = nn.Linear(4, 8), nn.Linear(8, 1)
    first.load_state_dict({"weight": initial["0.weight"], "bias": initial["0.bias"]})
    second.load_state_dict({"weight": initial["2.weight"], "bias": initial["2.bias"]})
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen)) for _ in range(2)]
    with torch.no_grad():
        want = sum(float(nn.functional.mse_loss(second(torch.relu(first(x))), y)) for x, y in batches) / 2
    assert [r["engine"] for r in results] == ["PipelineEngine"] * 2
    assert [r["stage"] for r in results] == [0, 1]
    assert all(r["loss"] == pytest.approx(want, rel=1e-6) for r in results), (results, want)
    assert all(
        r["tp_error"] == "tensor_parallel.autotp_size: 4 does not divide the world size 2: each "
        "data-parallel replica needs 4 ranks"
        for r in results
    ), results


@pytest.mark.parametrize(
    ("call", "feature", "alternative"),
    [
        (lambda ds: ds.init_inference(nn.Linear(2, 2)), "inference engine", "plain PyTorch"),
        (lambda ds: ds.moe.layer.MoE(hidden_size=4), "Mixture-of-Experts layers", "dense model"),
        (lambda ds: ds.ops.lion.DeepSpeedCPULion([]), "Lion optimizer", "Adam"),
        (
            lambda ds: ds.utils.set_z3_leaf_modules(nn.Linear(2, 2), [nn.Linear]),
            "set_z3_leaf_modules",
            "unit",
        ),
        (
            lambda ds: ds.accelerator.get_accelerator().create_op_builder("CPUAdamBuilder"),
            "op builder",
            "runtime.ops",
        ),
        (lambda ds: ds.runtime.fp16.onebit.adam.OnebitAdam([]), "1-bit Adam", "Adam/AdamW"),
        (lambda ds: ds.DeepSpeedHybridEngine, "deepspeed.DeepSpeedHybridEngine", "Coming from DeepSpeed"),
        (lambda ds: ds.utils.groups._get_sequence_parallel_group(), "sequence-parallel", "data parallelism"),
    ],
)
def test_unsupported_features_raise_by_name(call: Any, feature: str, alternative: str) -> None:
    import deepspeed
    import deepspeed.moe.layer
    import deepspeed.ops.lion
    import deepspeed.runtime.fp16.onebit.adam

    from runtime.deepspeed_api.unsupported import UnsupportedFeature

    with pytest.raises(UnsupportedFeature) as info:
        call(deepspeed)
    message = str(info.value)
    assert message.startswith("DeepSpeed's ") and "is not supported by dslaunch; " in message
    assert feature in message and alternative in message
    assert isinstance(info.value, NotImplementedError)  # what DeepSpeed-aware code catches


def test_missing_module_names_raise_by_name_and_keep_hasattr_working() -> None:
    import deepspeed

    from runtime.deepspeed_api.unsupported import UnsupportedName

    assert not hasattr(deepspeed, "DeepSpeedHybridEngine")  # probing integrations still get False
    assert getattr(deepspeed.utils, "no_such_helper", "fallback") == "fallback"
    with pytest.raises(UnsupportedName, match=r"^DeepSpeed's deepspeed.zero.TiledLinear is not supported"):
        deepspeed.zero.TiledLinear  # noqa: B018


@pytest.mark.parametrize(
    ("extra", "path", "feature"),
    [
        ({"autotuning": {"enabled": True}}, "autotuning", "autotuning"),
        ({"compression_training": {"x": {}}}, "compression_training", "compression training"),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}},
         "zero_optimization.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
         "zero_optimization.zero_quantized_gradients", "ZeRO++ quantized gradients"),
    ],
)  # fmt: skip
def test_config_names_deepspeed_options_it_does_not_support(extra: dict, path: str, feature: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    from runtime.config import ConfigError

    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **extra})
    assert str(info.value).startswith(f"{path}: a DeepSpeed option dslaunch does not support: {feature}")
    assert "did you mean" not in str(info.value)


def test_config_unknown_key_is_a_typo_not_an_unsupported_option() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    from runtime.config import ConfigError

    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "gradient_clippin": 1.0})
    assert str(info.value) == 'gradient_clippin: unknown key; did you mean "gradient_clipping"?'


def test_memory_estimators_under_deepspeed_names(capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    from runtime.estimator import estimate_all, model_sizes

    model = _model()
    live = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    want = estimate_all(model_sizes(model), num_gpus_per_node=2, num_nodes=1, stages=(3,))
    assert [e.per_gpu_bytes for e in live] == [e.per_gpu_bytes for e in want]
    cold = estimate_zero2_model_states_mem_needs_all_cold(int(1.5e9), num_gpus_per_node=8)
    assert cold and all(e.per_gpu_bytes > 0 for e in cold)
    printed = capsys.readouterr().out
    assert printed.count("Model states of ") == 2 and "8 GPU(s) per node x 1 node(s)" in printed


def test_compat_alone_says_what_to_install(tmp_path: Path) -> None:
    # only compat/ importable (-S: no site-packages, so no installed dslaunch; run from an empty folder)
    compat = REPO / "compat"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(compat)}
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import deepspeed"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ImportError: this `deepspeed` is dslaunch's compatibility package and needs dslaunch's `runtime` "
        "package: install dslaunch too (pip install <dslaunch checkout> <dslaunch checkout>/compat)"
    )
