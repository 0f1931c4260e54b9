"""The memory estimator against what the engine really allocates, and against the ZeRO paper.

One 3-rank spawn builds engines over the whole world, a 2-rank subgroup and a 1-rank subgroup, for
ZeRO stages 0, 1 and 2 (and 3 once the engine has it) in bf16 and fp32, with the default reduce bucket
and with small buckets (several buckets: fp32 master weights are then a separate copy), and stages 1
and 2 with the optimizer offloaded to the CPU. After one step (the optimizer state exists), each rank's
``engine.memory_breakdown()`` must be within 5% of the estimate, field by field (device and host), both
from the model (exact flat layout) and from the parameter count alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from runtime.estimator import (
    ModelSizes,
    estimate,
    estimate_all,
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
    main,
    model_sizes,
)
from runtime.estimator.fit import gpt_sizes
from runtime.models import GPT, GPTConfig
from tests.support.dist import run_distributed

MODEL = GPTConfig(n_layer=2, n_head=4, n_embd=96, vocab_size=256, max_seq_len=64)
FIELDS = ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes")
HOST = ("host_bytes", "host_buffer_bytes")  # of the model states, those in host memory; landing buffers
CASES = [
    (stage, dtype, bucket, False)
    for stage in (0, 1, 2, 3)
    for dtype in ("bf16", "fp32")
    for bucket in (500_000_000, 20_000)
] + [(stage, dtype, 500_000_000, True) for stage in (1, 2) for dtype in ("bf16", "fp32")]


def _measure(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from runtime.comm import Comm
    from runtime.config import load_config
    from runtime.engine import Engine

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), 3: dist.group.WORLD}
    out: dict[Any, Any] = {}
    for n, group in groups.items():
        if rank >= n:
            continue
        for stage, dtype, bucket, offload in CASES:
            zero = {"stage": stage, "reduce_bucket_size": bucket}
            if stage == 3:
                zero["stage3_param_persistence_threshold"] = 0  # every unit sharded, as in a large model
            if offload:
                zero["offload_optimizer"] = {"device": "cpu"}
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "steps_per_print": 0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": zero,
            }
            if dtype == "bf16":
                config["bf16"] = {"enabled": True}
            torch.manual_seed(0)
            model = GPT(MODEL)
            try:
                engine = Engine(model, load_config(config, world_size=n), comm=Comm(group))
            except NotImplementedError:
                out[(n, stage, dtype, bucket, offload)] = None  # stage 3 before it lands
                continue
            idx = torch.randint(0, MODEL.vocab_size, (2, 32))
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            breakdown = engine.memory_breakdown()
            out[(n, stage, dtype, bucket, offload)] = {f: getattr(breakdown, f) for f in FIELDS + HOST}
            engine.destroy()
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(_measure, 3, timeout=240)


def _expected(
    sizes: ModelSizes, n: int, stage: int, dtype: str, bucket: int, offload: bool
) -> dict[str, int]:
    e = estimate(
        sizes,
        stage=stage,
        num_gpus_per_node=n,
        dtype=dtype,
        reduce_bucket_size=bucket,
        offload_optimizer=offload,
    )
    host = e.host_per_rank
    if not offload:
        assert host.total == 0  # everything is on the device
    return {
        "param_bytes": e.gpu.params + host.params,
        "grad_bytes": e.gpu.grads,
        "master_bytes": e.gpu.master + host.master,
        "optimizer_bytes": e.gpu.optimizer + host.optimizer,
        "host_bytes": host.params + host.master + host.optimizer,
        "host_buffer_bytes": host.grads,
    }


def _check(got: dict[str, int], want: dict[str, int], where: str) -> None:
    total_got = sum(got[f] for f in FIELDS)
    total_want = sum(want[f] for f in FIELDS)
    assert abs(total_got - total_want) <= 0.05 * total_want, f"{where}: engine {total_got} vs {total_want}"
    for field in FIELDS + HOST:
        tolerance = 0.05 * max(want[field], 1)
        assert abs(got[field] - want[field]) <= tolerance, f"{where}: {field} {got[field]} vs {want[field]}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_estimate_matches_engine_memory_breakdown(measured: list[dict], stage: int) -> None:
    torch.manual_seed(0)
    sizes = model_sizes(GPT(MODEL))
    count_only = ModelSizes(sizes.total_params, sizes.largest_layer_params)
    checked = 0
    for rank, per_rank in enumerate(measured):
        for (n, s, dtype, bucket, offload), got in per_rank.items():
            if s != stage:
                continue
            if got is None:
                pytest.skip("the engine has no ZeRO stage 3 yet")
            where = f"rank {rank}, N={n}, stage {stage}, {dtype}, bucket {bucket}, offload {offload}"
            _check(got, _expected(sizes, n, stage, dtype, bucket, offload), where + " (model)")
            _check(got, _expected(count_only, n, stage, dtype, bucket, offload), where + " (count)")
            checked += 1
    offloaded = 2 if stage in (1, 2) else 0  # dtypes with the optimizer offloaded
    assert checked == (2 * 2 + offloaded) * (1 + 2 + 3)  # x ranks of N = 1, 2, 3


def test_zero_paper_bytes_per_parameter() -> None:
    psi, n = 1.5e9, 8
    per_param = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}
    for stage, expected in per_param.items():
        sizes = ModelSizes(int(psi), largest_layer_params=10**8)
        e = estimate(sizes, stage=stage, num_gpus_per_node=n)
        assert e.gpu.total == pytest.approx(expected * psi, rel=1e-6), stage
    e3 = estimate(ModelSizes(int(psi), 10**8), stage=3, num_gpus_per_node=n)
    # bf16: two gathered units, three staged for their reduce-scatters, one parameter's whole gradient (not
    # known here: taken as the largest layer)
    assert e3.gpu_transient == 2 * (2 + 3 + 1) * 10**8
    one = estimate(ModelSizes(int(psi), 10**8, largest_param=4 * 10**7), stage=3, offload_optimizer=True,
                   offload_param=True)  # fmt: skip
    assert one.gpu_transient == 2 * (2 * 10**8 + 4 * 10**7)  # one rank adds gradients into its shard
    assert estimate(ModelSizes(int(psi), 10**8), stage=3).gpu_transient == 0  # the replicated path
    # fp32 on one GPU: the master weights are the working buffer itself
    fp32 = estimate(int(psi), stage=0, dtype="fp32")
    assert fp32.gpu.master == 0 and fp32.gpu.total == pytest.approx(16 * psi)
    # offload: master 4 + Adam 8 + landing 2 bytes per parameter / N on the host of each rank
    off = estimate(int(psi), stage=2, num_gpus_per_node=4, num_nodes=2, offload_optimizer=True)
    assert off.host_per_rank.total == pytest.approx(14 * psi / 8, rel=1e-6)
    assert off.per_host_bytes == 4 * max(off.host_per_rank.total, off.host_init_per_rank)
    # the bf16 working weights and the stage-2 gradient shard stay on the GPU
    assert off.gpu.total == pytest.approx((2 + 2 / 8) * psi, rel=1e-6)
    full = estimate(ModelSizes(int(psi), 10**8), stage=3, num_gpus_per_node=8, offload_optimizer=True,
                    offload_param=True)  # fmt: skip
    assert full.gpu.params == 0 and full.host_per_rank.params == pytest.approx(2 * psi / 8, rel=1e-6)
    # DeepSpeed-named wrappers return (host bytes x buffer factor, bytes per GPU[, largest layer])
    cpu, gpu = estimate_zero2_model_states_mem_needs(
        int(psi), 8, 1, cpu_offload=False, additional_buffer_factor=1.0
    )
    plain = estimate(int(psi), stage=2, num_gpus_per_node=8)
    assert (cpu, gpu) == (plain.per_host_bytes, plain.per_gpu_bytes)
    assert len(estimate_zero3_model_states_mem_needs(int(psi), 10**8, 8)) == 3
    # every stage and offload choice; stage 3 only when the largest layer is known
    assert [(e.stage, e.offload_optimizer) for e in estimate_all(int(psi))] == [
        (0, False), (1, False), (1, True), (2, False), (2, True)
    ]  # fmt: skip


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="largest_layer_params"):
        estimate(10**9, stage=3)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO stage 1, 2 or 3"):
        estimate(10**9, stage=0, offload_optimizer=True)
    with pytest.raises(ValueError, match="num_gpus_per_node must be a positive integer"):
        estimate(10**9, stage=1, num_gpus_per_node=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        estimate(10**9, stage=1, dtype="fp8")


def test_model_sizes_of_a_gpt() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig.named("xl"))
    sizes = model_sizes(model)
    config = GPTConfig.named("xl")
    assert sizes.total_params == config.num_params()  # the tied head counted once
    assert sizes.largest_layer_params == config.vocab_size * config.n_embd  # the token embedding
    # a wide GPT: stage 3 gathers a whole block (attention, MLP, two norms), larger than any one layer
    # and than the embedding, and both ways of sizing a GPT say so
    wide = GPTConfig(n_embd=512, n_head=8, n_layer=2, vocab_size=256, max_seq_len=64)
    with torch.device("meta"):
        block = sum(p.numel() for p in GPT(wide).blocks[0].parameters())
        assert model_sizes(GPT(wide)).largest_layer_params == block == 12 * 512 * 512 + 13 * 512
    assert gpt_sizes(wide).largest_layer_params == block


def test_cli_table_json_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "1.5e9", "--num_gpus", "8", "--num_nodes", "1"]) == 0
    table = capsys.readouterr().out
    assert "1.500B parameters" in table and "stage 3 needs --largest_layer_params" in table
    assert f"{24e9 / 2**30:.2f} GiB" in table  # stage 0: 16 bytes per parameter
    assert main(["--model_size", "xl", "--num_gpus", "8", "--num_nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["total_params"] == GPTConfig.named("xl").num_params()
    assert {e["stage"] for e in data["estimates"]} == {0, 1, 2, 3}
    assert all(e["num_nodes"] == 2 and e["gpus_per_node"] == 8 for e in data["estimates"])
    for argv, message in (
        (["--params", "-3"], "expected a positive number"),
        (["--model_size", "huge"], "unknown model size 'huge'"),
        (["--params", "1e9", "--num_gpus", "0"], "expected a positive integer"),
        (["--params", "1e9", "--stages", "0,4"], "--stages"),
        ([], "one of the arguments --params --model_size --largest --gpt --longest_seq is required"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_module_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.estimator", "--model_size", "small", "--num_gpus", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Model states of 0.124B parameters, largest layer 38.6M")
    rows = [line for line in lines if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 8  # 1 + 2 + 2 + 3 configurations


# ------------------------------------------------------------------------- pipeline and tensor parallelism


def test_pipeline_and_tensor_parallel_divide_what_each_rank_holds() -> None:
    """Per rank: (replicated + sharded / tp) / pp parameters; ZeRO over the data ranks that remain."""
    psi, sharded, gpus = 1_200_000_000, 1_000_000_000, 8
    sizes = ModelSizes(psi, tensor_parallel_params=sharded)
    local = (psi - sharded + sharded // 2) // 2  # pp 2 x tp 2 x data 2
    plain = estimate(sizes, stage=0, num_gpus_per_node=gpus)
    e0 = estimate(sizes, stage=0, num_gpus_per_node=gpus, pipeline_parallel=2, tensor_parallel=2)
    e1 = estimate(sizes, stage=1, num_gpus_per_node=gpus, pipeline_parallel=2, tensor_parallel=2)
    assert plain.gpu.total == 16 * psi
    assert e0.gpu.total == pytest.approx(16 * local, rel=1e-6)
    assert e1.gpu.total == pytest.approx((4 + 12 / 2) * local, rel=1e-6)  # ZeRO-1 over 2 data ranks
    assert (e1.pipeline_parallel, e1.tensor_parallel) == (2, 2)
    pp_only = estimate(psi, stage=0, num_gpus_per_node=gpus, pipeline_parallel=4)
    assert pp_only.gpu.params == pytest.approx(2 * psi / 4, rel=1e-6)
    # the engines train pipelines and tensor parallelism with stage 0 or 1, without offload
    both = estimate_all(sizes, num_gpus_per_node=gpus, pipeline_parallel=2, tensor_parallel=2)
    assert [(e.stage, e.offload_optimizer) for e in both] == [(0, False), (1, False)]
    for kwargs, message in (
        ({"stage": 2, "pipeline_parallel": 2}, "stage 0 or 1 without offload, not stage 2"),
        ({"stage": 0, "pipeline_parallel": 3}, "pipeline_parallel 3 x tensor_parallel 1 = 3 does not divide"),
        ({"stage": 0, "tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            estimate(sizes, num_gpus_per_node=gpus, **kwargs)
    with pytest.raises(ValueError, match="needs the parameters of the sharded projections"):
        estimate(psi, stage=0, num_gpus_per_node=gpus, tensor_parallel=2)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 16)  # colwise: weight and bias sharded
        self.o_proj = torch.nn.Linear(16, 8)  # rowwise: weight sharded, bias whole on every rank
        self.norm = torch.nn.LayerNorm(8)


def test_model_sizes_count_what_autotp_shards() -> None:
    sizes = model_sizes(_Attention())
    assert sizes.total_params == 8 * 16 + 16 + 16 * 8 + 8 + 2 * 8
    assert sizes.tensor_parallel_params == 8 * 16 + 16 + 16 * 8
    transformers = pytest.importorskip("transformers")
    d, layers = 64, 2
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=2))
    # ds_estimate --model_size counts the same share for a GPT-2 layout
    assert model_sizes(gpt2).tensor_parallel_params == layers * (12 * d * d + 7 * d)


def test_cli_pipeline_and_tensor_parallel(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model_size", "xl", "--num_gpus", "8", "--pipeline_parallel", "2", "--tensor_parallel", "2"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    config = GPTConfig.named("xl")
    d = config.n_embd
    sharded = config.n_layer * (12 * d * d + 7 * d)
    assert data["model"]["tensor_parallel_params"] == sharded
    local = -(-(config.num_params() - sharded + sharded // 2) // 2)
    assert [(e["stage"], e["pipeline_parallel"], e["tensor_parallel"]) for e in data["estimates"]] == [
        (0, 2, 2), (1, 2, 2)
    ]  # fmt: skip
    assert data["estimates"][0]["gpu"]["params"] == 2 * local  # bf16 working weights of this rank's share
    assert main(argv) == 0
    assert "pipeline 2 x tensor 2 x data 2" in capsys.readouterr().out
    for bad, message in (
        (["--params", "1e9", "--tensor_parallel", "2"], "needs --tensor_parallel_params"),
        (["--params", "1e9", "--num_gpus", "2", "--pipeline_parallel", "3"], "does not divide the 2 GPU(s)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(bad)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, bad


class _MLP(torch.nn.Module):
    """A block AutoTP shards by name: up_proj colwise, down_proj rowwise; the norm stays whole."""

    def __init__(self, dim: int = 96) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up_proj = torch.nn.Linear(dim, 4 * dim)
        self.down_proj = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.nn.functional.gelu(self.up_proj(self.norm(x))))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), target.float())


def _measure_model_parallel(rank: int, world_size: int, stage: int) -> dict:
    import runtime
    from runtime.pipe import LayerSpec, PipelineModule

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    out = {}
    torch.manual_seed(0)
    whole = torch.nn.Sequential(*(_MLP() for _ in range(4)))
    out["sizes"] = model_sizes(whole)
    pipe = PipelineModule([LayerSpec(_MLP) for _ in range(4)], num_stages=2, loss_fn=_mse)
    engine, *_ = runtime.initialize(model=pipe, model_parameters=pipe.parameters(), config=config)
    batches = iter([(torch.randn(2, 3, 96), torch.randn(2, 3, 96)) for _ in range(2)])
    engine.train_batch(batches)
    out["pp"] = {f: getattr(engine.memory_breakdown(), f) for f in FIELDS}
    tp_config = {**config, "gradient_accumulation_steps": 1, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = runtime.initialize(model=whole, model_parameters=whole.parameters(), config=tp_config)
    x = torch.randn(2, 3, 96)
    engine.backward(_mse(engine(x), x))
    engine.step()
    out["tp"] = {f: getattr(engine.memory_breakdown(), f) for f in FIELDS}
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_model_parallel_estimate_matches_the_engines(stage: int) -> None:
    """2 ranks as 2 pipeline stages, then as 2 tensor-parallel ranks: each rank's model states are what
    the estimate says (parameters / pp, sharded projections / tp), within 10%."""
    for rank, got in enumerate(run_distributed(_measure_model_parallel, 2, stage, timeout=240)):
        sizes = got["sizes"]
        assert sizes.tensor_parallel_params == 4 * (2 * 96 * 384 + 384)  # weights and the colwise bias
        for kind, degrees in (("pp", {"pipeline_parallel": 2}), ("tp", {"tensor_parallel": 2})):
            e = estimate(sizes, stage=stage, num_gpus_per_node=2, **degrees)
            want = {"param_bytes": e.gpu.params, "grad_bytes": e.gpu.grads, "master_bytes": e.gpu.master,
                    "optimizer_bytes": e.gpu.optimizer}  # fmt: skip
            total_got, total_want = sum(got[kind].values()), sum(want.values())
            assert abs(total_got - total_want) <= 0.10 * total_want, (rank, kind, got[kind], want)
            assert total_want <= 0.55 * estimate(sizes, stage=stage).gpu.total  # about half the model
