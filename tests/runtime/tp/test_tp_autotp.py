"""AutoTP (`tp_model_init`) on GPT-2-style Conv1D and Llama-style Linear blocks equals the unsharded model.

Runs in the shared spawn of 4 gloo ranks (tests/support/pipe_world4.py), laid out tp2 x dp2
(`topology_for(4, tp=2)`). Two kinds of check, 8 steps each:
- `tp_model_init` alone: each model group trains a sharded copy on its own data next to the whole model
  (the reference) on the same data: losses to 1e-5 relative, the gathered Hugging Face-layout weights
  (so the fused q|k|v reordering is undone), per-rank parameter elements against the plan (sharded
  projections / 2), local head counts, and the errors for degrees that do not divide;
- the engine with AutoTP's parallel plan (`"tensor_parallel": {"autotp_size": 2}`): ZeRO-0/1/2 over
  data, clipping by the norm over the whole grid, and a client AdamW with two param groups built on the
  whole model before sharding, against one process training on the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.pipe_world4 import part
from tests.support.tp_models import (
    DIM,
    HEADS,
    KV_HEADS,
    GPT2Attention,
    GPT2Block,
    LlamaBlock,
    TinyLM,
    layers_3d,
    lm_batch,
    lm_loss,
    pipeline_3d,
)

STEPS = 8


def _sharded_numel(model: nn.Module) -> int:
    """Elements the plan splits: every planned weight, plus the biases of column-wise projections."""
    from runtime.tensor_parallel.autotp import ROWWISE_NAMES, tp_plan

    total = 0
    for name in tp_plan(model):
        module = model.get_submodule(name)
        total += module.weight.numel()
        if getattr(module, "bias", None) is not None and name.rsplit(".", 1)[-1] not in ROWWISE_NAMES:
            total += module.bias.numel()
    return total


def _train_pair(block: type[nn.Module], mesh: object, dp_rank: int) -> dict:
    from runtime.tensor_parallel import full_state_dict, local_numel, tp_model_init

    torch.manual_seed(0)
    reference = TinyLM(block)
    model = copy.deepcopy(reference)
    whole = sum(p.numel() for p in reference.parameters())
    expected_local = whole - _sharded_numel(reference) // 2
    tp_model_init(model, 2, mesh=mesh)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(STEPS):
        tokens, labels = lm_batch(step, dp_rank)
        for m, o, log in ((reference, opt_ref, ref_losses), (model, opt, losses)):
            loss = lm_loss(m, tokens, labels)
            loss.backward()
            o.step()
            o.zero_grad()
            log.append(float(loss.detach()))
    got, want = full_state_dict(model), reference.state_dict()
    attn = model.h[0].attn if block is GPT2Block else model.h[0].self_attn
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "max_diff": max(float((got[k] - want[k]).abs().max()) for k in want),
        "same_keys": sorted(got) == sorted(want),
        "local": local_numel(model),
        "expected_local": expected_local,
        "heads": (
            attn.num_heads,
            getattr(attn, "num_key_value_heads", None),
            getattr(attn, "split_size", None),
        ),
    }


# GPT-2 trains with SGD: its key bias gets a zero gradient in exact arithmetic (softmax ignores a shift
# shared by all keys), and Adam would turn the rounding noise in it into full-size steps
# "client": a torch AdamW over two param groups (weight decay on the matrices), passed as optimizer=
ENGINE_CASES = [
    ("gpt2", 0, 0.0, "SGD"),
    ("llama", 1, 0.3, "Adam"),
    ("gpt2", 1, 0.3, "SGD"),
    ("gpt2", 2, 0.3, "SGD"),
    ("llama", 2, 0.3, "Adam"),
    ("llama", 1, 0.3, "client"),
]


def _client_groups(model: nn.Module) -> list[dict]:
    """Weight decay on the matrices, none on norms, biases and the embedding (by name, before sharding)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "wte" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _engine_run(kind: str, stage: int, clip: float, optimizer: str) -> dict:
    """tp2 x dp2 through AutoTP's parallel plan: ZeRO over data, clipping by the norm over the whole grid."""
    import torch.distributed as dist

    from runtime.engine import Engine
    from runtime.parallel.plan import build_parallel_plan

    torch.manual_seed(0)
    model = TinyLM(GPT2Block if kind == "gpt2" else LlamaBlock)
    lr = 0.2 if optimizer == "SGD" else 0.02
    params = {"lr": lr, "momentum": 0.9} if optimizer == "SGD" else {"lr": lr}
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 0,
        "gradient_clipping": clip,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        "tensor_parallel": {"autotp_size": 2},
    }
    client = None
    if optimizer == "client":
        del config["optimizer"]
        client = torch.optim.AdamW(_client_groups(model), lr=lr)
    plan, loaded = build_parallel_plan(model, config)
    engine = Engine(model, loaded, optimizer=client, parallel=plan)
    dp_rank = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = lm_batch(step, dp_rank)
        loss = lm_loss(engine, tokens, labels)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=engine.grid.get_data_parallel_group())
        losses.append(float(mean) / 2)
        norms.append(engine.get_global_grad_norm())
    decays = [group.get("weight_decay") for group in engine.optimizer.param_groups]
    return {"losses": losses, "norms": norms, "state": engine.hf_state_dict(), "decays": decays}


def _engine_reference(kind: str, clip: float, optimizer: str) -> dict:
    torch.manual_seed(0)
    model = TinyLM(GPT2Block if kind == "gpt2" else LlamaBlock)
    lr = 0.2 if optimizer == "SGD" else 0.02
    if optimizer == "SGD":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    elif optimizer == "client":
        opt = torch.optim.AdamW(_client_groups(model), lr=lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(STEPS):
        batches = [lm_batch(step, d) for d in range(2)]
        tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        loss = lm_loss(model, tokens, labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


CLIP_3D = 0.3


def _pipeline_3d(rank: int) -> dict:
    """pp2 x tp2 (dp1): stage 0 = tied embedding + GPT-2 block, stage 1 = Llama block, norm, tied head."""
    from runtime.pipe import PipelineEngine
    from runtime.tensor_parallel.autotp import full_state_dict
    from tests.support.pipe_cases import data_iterator

    module = pipeline_3d("type:Block")
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 0,
        "gradient_clipping": CLIP_3D,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine = PipelineEngine(module, config)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(data_iterator("gpt", step, 2, 4, 0, 1))))
        norms.append(engine.get_global_grad_norm())
    return {
        "losses": losses,
        "norms": norms,
        "state": full_state_dict(engine.module),
        "stage": engine.stage_id,
    }


def _reference_3d() -> dict:
    from tests.support.pipe_cases import ReferenceModel, global_micro_batch, token_loss

    model = ReferenceModel(layers_3d())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(2):
            tokens, labels = global_micro_batch("gpt", step, micro, 4)
            loss = token_loss(model(tokens), labels)
            (loss / 2).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_3D)))
        opt.step()
        opt.zero_grad()
        losses.append(total / 2)
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _worker(rank: int, world_size: int) -> dict:
    from runtime.parallel import ParallelGrid, topology_for
    from runtime.tensor_parallel import tp_model_init

    grid = ParallelGrid(topology_for(world_size, tp=2))
    mesh = grid.mesh["model"]
    out: dict = {"engine": [_engine_run(*case) for case in ENGINE_CASES], "pipeline_3d": _pipeline_3d(rank)}
    out |= {
        "gpt2": _train_pair(GPT2Block, mesh, grid.get_data_parallel_rank()),
        "llama": _train_pair(LlamaBlock, mesh, grid.get_data_parallel_rank()),
    }
    try:
        tp_model_init(TinyLM(lambda: GPT2Block(heads=8)), 2, mesh=mesh)  # 8 heads of width 2: fine
        tp_model_init(_OddHeads(), 2, mesh=mesh)
        out["odd_heads"] = "no error"
    except ValueError as error:
        out["odd_heads"] = str(error)
    try:
        tp_model_init(TinyLM(GPT2Block), 3)
        out["odd_degree"] = "no error"
    except ValueError as error:
        out["odd_degree"] = str(error)
    return out


class _OddHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = GPT2Attention(heads=1)


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return part("tp")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sharded_model_trains_like_the_whole_one(results: list[dict], kind: str) -> None:
    for rank, r in enumerate(results):
        got = r[kind]
        assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5), f"rank {rank}"
        assert got["same_keys"], f"rank {rank}: full_state_dict keys differ from the model's"
        assert got["max_diff"] < 1e-5, f"rank {rank}: weights differ by {got['max_diff']:.2e}"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_each_rank_holds_its_share_of_the_projections(results: list[dict], kind: str) -> None:
    for r in results:
        assert r[kind]["local"] == r[kind]["expected_local"]
    assert results[0]["gpt2"]["heads"] == (HEADS // 2, None, DIM // 2)
    assert results[0]["llama"]["heads"] == (HEADS // 2, KV_HEADS // 2, None)


@pytest.mark.parametrize("index", range(len(ENGINE_CASES)), ids=[str(c) for c in ENGINE_CASES])
def test_engine_tp2_dp2_matches_single_process(results: list[dict], index: int) -> None:
    kind, _, clip, optimizer = ENGINE_CASES[index]
    ref = _engine_reference(kind, clip, optimizer)
    for rank, r in enumerate(results):
        got = r["engine"][index]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
        if clip > 0:
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank}"
        assert sorted(got["state"]) == sorted(ref["state"])
        for key, want in ref["state"].items():
            torch.testing.assert_close(
                got["state"][key], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}"
            )


def test_engine_rebuilds_a_client_optimizer_over_the_shards_with_its_groups(results: list[dict]) -> None:
    """The client AdamW's two groups (built on the whole model) keep their weight decay on the shards:
    the matrices' group splits into its sharded projections and the replicated lm_head."""
    got = results[0]["engine"][ENGINE_CASES.index(("llama", 1, 0.3, "client"))]
    assert got["decays"] == [0.1, 0.1, 0.0]


def test_pipeline_with_tensor_parallel_matches_single_process(results: list[dict]) -> None:
    """pp2 x tp2: losses, the clipped norm (ties and replicated weights once), the gathered weights."""
    ref = _reference_3d()
    seen = set()
    for rank, r in enumerate(results):
        got = r["pipeline_3d"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {rank}"
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), f"rank {rank}"
        for key, value in got["state"].items():
            seen.add(key)
            torch.testing.assert_close(
                value, ref["state"][key], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}"
            )
    assert seen == set(ref["state"])


def test_degrees_that_do_not_divide_are_refused(results: list[dict]) -> None:
    for r in results:
        assert r["odd_heads"] == "tensor_parallel.autotp_size 2 does not divide attn.num_heads = 1"
        assert r["odd_degree"] == (
            "1 pipeline stages x tensor-parallel degree 3 = 3 ranks per replica does not divide the "
            "world size 4"
        )
