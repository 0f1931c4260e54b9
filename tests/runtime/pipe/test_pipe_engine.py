"""PipelineEngine.train_batch equals a single-process PyTorch run, at world 4 on gloo.

The shared spawn of 4 ranks (tests/support/pipe_world4.py) runs every case: pp2 x dp2 and pp4 (1F1B), GPipe,
a tiny GPT whose embedding and head share one weight across the first and last stage, ZeRO-1 with
clipping by the global norm, bf16; and the same with two chunks per stage (interleaved 1F1B, looped
BFS): pp2 (v=2) x dp2, pp4 (v=2), the GPT tied across chunks, pp2 x tp2 (v=2). Each
case trains 8 global batches and returns, per rank, the losses train_batch returned, the gradient norms,
and its stage's fp32 master weights; the test compares them with `tests.support.pipe_cases.reference_train`
(fp32: 1e-5 relative). The in-flight recorder on the first stage shows how many micro-batches of
activations were alive at once: at most the number of stages under 1F1B, all of them under GPipe, and
under the interleaved schedules what torch's schedule order for the first chunk says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import pytest
import torch

from tests.support.pipe_cases import (
    BASE_SEED,
    InFlightRecorder,
    data_iterator,
    layers_of,
    mse,
    reference_train,
    token_loss,
)
from tests.support.pipe_world4 import part

WORLD = 4
STEPS = 8
ROWS = 8  # global rows per micro-batch
FP16_SCALE_POWER = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    pp: int
    kind: str = "mlp"
    micro_batches: int = 4
    schedule: str | None = None  # None: the engine's default (1F1B, or interleaved 1F1B with chunks)
    optimizer: str = "SGD"
    stage: int = 0
    clip: float = 0.0
    partition: str = "parameters"
    interval: int = 0
    dtype: str = "fp32"
    chunks: int = 1  # chunks per stage (PipelineModule(chunks_per_stage=...))
    depth: int = 4  # of the MLP (tests.support.pipe_cases.mlp_layers)

    @property
    def lr(self) -> float:
        return 0.05 if self.optimizer == "SGD" else 0.01

    def config(self) -> dict:
        dp = WORLD // self.pp
        params = {"lr": self.lr, "momentum": 0.9} if self.optimizer == "SGD" else {"lr": self.lr}
        return {
            "train_batch_size": ROWS * self.micro_batches,
            "train_micro_batch_size_per_gpu": ROWS // dp,
            "gradient_accumulation_steps": self.micro_batches,
            "steps_per_print": 0,
            "gradient_clipping": self.clip,
            "optimizer": {"type": self.optimizer, "params": params},
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": 100},
            "pipeline": {"activation_checkpoint_interval": self.interval}
            | ({"schedule": self.schedule} if self.schedule else {}),
            "bf16": {"enabled": self.dtype == "bf16"},
            "fp16": {
                "enabled": self.dtype == "fp16",
                "auto_cast": True,
                "initial_scale_power": FP16_SCALE_POWER,
            },
        }


CASES = [
    Case(pp=2),  # pp2 x dp2
    Case(pp=4, optimizer="Adam", interval=2),  # pp4, activation checkpointing every 2 layers
    Case(pp=2, schedule="gpipe", micro_batches=8),
    Case(pp=4, micro_batches=8),  # 1F1B with more micro-batches than stages
    Case(pp=2, kind="gpt", optimizer="Adam", partition="type:Block"),  # tied embedding/head
    Case(pp=2, stage=1, clip=0.05, optimizer="Adam"),  # ZeRO-1 over data, clipping across stages
    Case(pp=2, kind="gpt", stage=1, clip=0.05),  # ties counted once in the clipped norm
    Case(pp=2, stage=1, clip=0.05, optimizer="Adam", dtype="bf16"),  # bf16 working weights, ZeRO-1
    Case(pp=4, clip=0.05, optimizer="Adam", dtype="fp16"),  # fp16 with loss scaling
    # two chunks per stage: interleaved 1F1B (the default then) and looped BFS
    Case(pp=2, chunks=2, depth=8),  # pp2 (v=2) x dp2
    Case(pp=4, chunks=2, depth=8, micro_batches=8, optimizer="Adam", interval=2),  # pp4 (v=2)
    Case(pp=4, chunks=2, depth=8, micro_batches=6),  # 6 micro-batches: one round of 6 (torch's flex rule)
    Case(pp=2, chunks=2, kind="gpt", partition="type:Block", stage=1, clip=0.05, optimizer="Adam"),  # tied
    Case(pp=2, chunks=2, stage=1, clip=0.05, optimizer="Adam", dtype="bf16"),  # depth 8 is past bf16's 5%
    Case(pp=2, chunks=2, depth=8, schedule="looped_bfs"),
    Case(pp=4, chunks=2, depth=8, clip=0.05, optimizer="Adam", dtype="fp16"),  # fp16 loss scaling, chunks
]
INTERLEAVED_PP2 = CASES.index(Case(pp=2, chunks=2, depth=8))


def _engine(case: Case) -> Any:
    from runtime.pipe import PipelineEngine, PipelineModule

    module = PipelineModule(
        layers_of(case.kind, case.depth),
        num_stages=case.pp,
        loss_fn=token_loss if case.kind == "gpt" else mse,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method=case.partition,
        chunks_per_stage=case.chunks,
    )
    return PipelineEngine(module, case.config())


def _scheduled_peak(engine: Any) -> int:
    """The most micro-batches alive at once in chunk 0 of stage 0 by torch's schedule order (forwards
    minus full backwards of virtual stage 0 on pipeline rank 0)."""
    alive = peak = 0
    for action in engine._schedule.pipeline_order[0]:
        if action is not None and action.stage_index == 0:
            alive += {"F": 1, "B": -1}.get(action.computation_type.value, 0)
            peak = max(peak, alive)
    return peak


def _batches(engine: Any, case: Case, step: int) -> Any:
    grid = engine.grid
    dp_rank, dp_size = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()
    return data_iterator(case.kind, step, case.micro_batches, ROWS, dp_rank, dp_size)


def _train(case: Case, rank: int) -> dict:
    engine = _engine(case)
    InFlightRecorder.log.clear()
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(_batches(engine, case, step))))
        if step == 0:  # the first step also ran one forward on placeholders to infer shapes
            InFlightRecorder.log.clear()
        norms.append(engine.get_global_grad_norm())
    peak = InFlightRecorder.max_in_flight() if engine.is_first_stage() else None
    state = engine.full_state_dict()
    own = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    chunk_params = [sum(p.numel() for p in chunk.parameters()) for chunk in engine.module.chunks]
    out = {
        "scheduled_peak": _scheduled_peak(engine) if case.chunks > 1 and engine.is_first_stage() else None,
        "chunk_params": chunk_params,
        "virtual_stages": engine.module.virtual_stages(),
        "parts": engine.module.parts,
        "losses": losses,
        "norms": norms,
        "state": state,
        "stage": engine.stage_id,
        "peak": peak,
        "skipped": engine.skipped_steps,
        "own_param_bytes": own,
    }
    engine.destroy()
    return out


RESUME_CASES = [
    Case(pp=2, stage=1, optimizer="Adam", clip=0.05),
    Case(pp=4, kind="gpt", optimizer="Adam"),
    Case(pp=2, chunks=2, kind="gpt", partition="type:Block", stage=1, optimizer="Adam"),  # interleaved
]


def _resume(case: Case, save_dir: str) -> dict:
    """Train 8 steps saving after 4; a fresh engine loading that checkpoint repeats steps 4-7 exactly."""
    first = _engine(case)
    straight = []
    for step in range(STEPS):
        if step == STEPS // 2:
            first.save_checkpoint(save_dir)
        straight.append(float(first.train_batch(_batches(first, case, step))))
    second = _engine(case)
    second.load_checkpoint(save_dir)
    resumed = [float(second.train_batch(_batches(second, case, s))) for s in range(STEPS // 2, STEPS)]
    a, b = first.full_state_dict(), second.full_state_dict()
    # consolidate every stage into one state dict, and continue at another pipeline degree from it
    from runtime.pipe import PipelineEngine, PipelineModule
    from runtime.pipe.checkpoint import get_fp32_state_dict_from_pipeline_checkpoint, load_stage_state_dict

    second.save_checkpoint(save_dir, tag="final")
    torch.distributed.barrier()
    whole = get_fp32_state_dict_from_pipeline_checkpoint(save_dir)
    other = dataclasses.replace(case, pp=2 if case.pp == 4 else 4, chunks=1)
    module = PipelineModule(
        layers_of(case.kind, case.depth),
        num_stages=other.pp,
        loss_fn=token_loss if case.kind == "gpt" else mse,
        partition_method=case.partition,
    )
    load_stage_state_dict(module, whole)
    continued = PipelineEngine(module, other.config()).full_state_dict()
    return {
        "straight": straight[STEPS // 2 :],
        "resumed": resumed,
        "equal_weights": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
        "steps": second.global_steps,
        "whole_matches_stage": all(torch.equal(whole[k], v) for k, v in b.items()),
        "whole_keys": sorted(whole),
        "continued_matches": all(torch.equal(whole[k], v) for k, v in continued.items()),
        "continued_keys": sorted(continued),
    }


def _run_cases(rank: int, world_size: int, cases: list[Case], save_root: str) -> dict:
    import os

    out = {
        "train": [_train(case, rank) for case in cases],
        "overflow": _overflow(rank),
        "resume": [_resume(case, os.path.join(save_root, str(i))) for i, case in enumerate(RESUME_CASES)],
    }
    try:  # the pp2 checkpoint at pp4
        _engine(Case(pp=4)).load_checkpoint(os.path.join(save_root, "0"))
        out["other_degree"] = "loaded"
    except Exception as error:
        out["other_degree"] = str(error)
    out["three_d"] = _three_d_chunks()
    try:  # the interleaved pp2 (v=2) checkpoint with one chunk per stage
        _engine(Case(pp=2, kind="gpt", partition="type:Block")).load_checkpoint(os.path.join(save_root, "2"))
        out["other_chunks"] = "loaded"
    except Exception as error:
        out["other_chunks"] = str(error)
    out["groups"] = _groups()
    return out


def _groups() -> dict:
    """deepspeed.utils.groups while a pp2 x dp2 pipeline engine lives, and after its destroy()."""
    from runtime.deepspeed_api import collectives  # deepspeed.utils.groups

    engine = _engine(Case(pp=2))
    during = [collectives._get_data_parallel_world_size(), collectives._get_data_parallel_rank(),
              collectives._get_model_parallel_world_size(), engine.grid.get_data_parallel_rank()]  # fmt: skip
    engine.destroy()
    return {
        "during": during,
        "after": [collectives._get_data_parallel_world_size(), collectives._get_data_parallel_rank()],
    }


def _three_d_chunks() -> dict:
    """pp2 x tp2 (AutoTP blocks, a tied embedding and head) with one and with two chunks per stage: the
    same model, so the same losses and clipped norms; and each (stage, model rank) its own folder."""
    from runtime.pipe import PipelineEngine
    from tests.support.tp_models import pipeline_3d

    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
              "gradient_clipping": 0.05, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2}}  # fmt: skip
    out: dict = {}
    for chunks in (1, 2):
        engine = PipelineEngine(pipeline_3d("uniform", chunks), config)
        out[chunks] = [float(engine.train_batch(data_iterator("gpt", s, 2, 4, 0, 1))) for s in range(4)]
        out[f"norm{chunks}"] = engine.get_global_grad_norm()
        out[f"folder{chunks}"] = engine.checkpoint_folder()[0]
        engine.destroy()
    return out


def _problems(case: Case, per_rank: list[dict]) -> list[str]:
    ref = reference_train(
        case.kind,
        depth=case.depth,
        steps=STEPS,
        micro_batches=case.micro_batches,
        rows=ROWS,
        optimizer=case.optimizer,
        lr=case.lr,
        clip=case.clip,
        dtype=DTYPES[case.dtype],
        loss_scale=2.0**FP16_SCALE_POWER if case.dtype == "fp16" else 1.0,
    )
    # fp32 is exact to 1e-5; bf16/fp16 accumulate gradients in 16 bits in another order (per data rank,
    # then summed), so their losses get 2e-2 and their weights are compared by the error of the update
    exact = case.dtype == "fp32"
    loss_tol = 1e-5 if exact else 2e-2
    problems = []
    for rank, got in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(got["losses"], ref.losses, strict=True)):
            if abs(a - b) > loss_tol * abs(b):
                problems.append(f"rank {rank} loss[{step}] {a:.7f} vs reference {b:.7f}")
                break
        if case.clip > 0:
            for step, (a, b) in enumerate(zip(got["norms"], ref.norms, strict=True)):
                if a is None or abs(a - b) > (1e-5 if exact else 3e-2) * b:
                    problems.append(f"rank {rank} grad norm[{step}] {a} vs reference {b:.7f}")
                    break
    seen: set[str] = set()
    for got in per_rank:
        for name, value in got["state"].items():
            seen.add(name)
            want = ref.params[name]
            if not exact:
                update = (want - ref.initial[name]).norm()
                if float((value - want).norm() / update) > 0.05:
                    problems.append(f"stage {got['stage']} {name}: update error above 5%")
            elif not torch.allclose(value, want, rtol=1e-5, atol=1e-6):
                problems.append(
                    f"stage {got['stage']} {name}: max diff {float((value - want).abs().max()):.3e}"
                )
    if seen != set(ref.params):
        problems.append(f"parameters {sorted(set(ref.params) - seen)} missing on every stage")
    for got in per_rank:
        if got["skipped"]:
            problems.append(f"stage {got['stage']} skipped {got['skipped']} steps")
    peak = per_rank[0]["peak"]
    if case.kind == "mlp":
        if case.chunks > 1:
            bound = per_rank[0]["scheduled_peak"]
        elif case.schedule == "gpipe":
            bound = case.micro_batches
        else:
            bound = min(case.pp, case.micro_batches)
        if peak != bound:
            problems.append(f"first stage held {peak} micro-batches of activations at once, expected {bound}")
    return problems


def _overflow(rank: int) -> dict:
    """An inf in one gradient of the last stage only, twice: every stage skips both steps, and the scale
    halves on the second (hysteresis 2, DeepSpeed's default) on every stage."""
    case = Case(pp=2, dtype="fp16", optimizer="Adam")
    engine = _engine(case)
    poison = [False]
    if engine.is_last_stage():
        weight = next(engine.module.parameters())
        weight.register_hook(lambda grad: grad * float("inf") if poison[0] else grad)
    engine.train_batch(_batches(engine, case, 0))
    before, scale = engine.full_state_dict(rank0_only=False), engine.loss_scale
    poison[0] = True
    engine.train_batch(_batches(engine, case, 1))
    engine.train_batch(_batches(engine, case, 2))
    after = engine.full_state_dict(rank0_only=False)
    return {
        "skipped": engine.skipped_steps,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "scale_ratio": engine.loss_scale / scale,
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return part("engine")


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(asdict(c)) for c in CASES])
def test_pipeline_matches_single_process(results: list[dict], index: int) -> None:
    problems = _problems(CASES[index], [r["train"][index] for r in results])
    assert not problems, "\n".join(problems)


def test_deepspeed_utils_groups_answer_with_the_pipeline_grid(results: list[dict]) -> None:
    # DeepSpeed hands a PipelineModule's grid to its groups as the mpu: the data group is the grid's (2
    # ranks at pp2 on 4), not the world, while the engine lives, and the model-parallel size is one
    # replica's ranks (its 2 stages), as DeepSpeed's grid counts them; after destroy() the world again
    for rank, r in enumerate(results):
        data_size, data_rank, model_size, grid_data_rank = r["groups"]["during"]
        assert (data_size, data_rank, model_size) == (2, grid_data_rank, 2), r["groups"]
        assert r["groups"]["after"] == [WORLD, rank]


@pytest.mark.parametrize("index", range(len(RESUME_CASES)), ids=[str(asdict(c)) for c in RESUME_CASES])
def test_resume_repeats_the_uninterrupted_run(results: list[dict], index: int) -> None:
    for rank, r in enumerate(results):
        got = r["resume"][index]
        assert got["resumed"] == got["straight"], f"rank {rank}"
        assert got["equal_weights"], f"rank {rank}: weights differ after resuming"
        assert got["steps"] == STEPS
        assert got["whole_matches_stage"], f"rank {rank}: consolidated weights differ from the stage's"
        assert got["continued_matches"], f"rank {rank}: weights differ after moving to another degree"
    ref = reference_train(
        RESUME_CASES[index].kind, steps=1, micro_batches=1, rows=ROWS, optimizer="SGD", lr=0.0, clip=0.0
    )
    assert results[0]["resume"][index]["whole_keys"] == sorted(ref.params)  # every parameter, once
    # the stages that continue at the other degree hold every parameter between them
    assert sorted({k for r in results for k in r["resume"][index]["continued_keys"]}) == sorted(ref.params)


def test_fp16_overflow_in_one_stage_skips_the_step_everywhere(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["overflow"] == {"skipped": 2, "unchanged": True, "scale_ratio": 0.5}, f"rank {rank}"


def test_stage_memory_follows_the_partition(results: list[dict]) -> None:
    """pp2 x dp2 MLP: each stage's parameters are its layers' (Linear(6,16) + Linear(16,16) | Linear(16,16)
    + Linear(16,4), fp32), the heavier stage within 10% of parameters / pp."""
    per_rank = [r["train"][0] for r in results]
    assert [r["own_param_bytes"] for r in per_rank] == [4 * 384, 4 * 384, 4 * 340, 4 * 340]
    assert max(r["own_param_bytes"] for r in per_rank) <= 1.1 * 4 * (384 + 340) / 2


def test_resume_at_another_pipeline_degree_is_refused(results: list[dict]) -> None:
    for stage, r in enumerate(results):
        assert f"has no checkpoint for stage {stage} of 4 (pipe_stage_{stage:02d}_of_04)" in r["other_degree"]
        assert "it holds ['pipe_stage_00_of_02', 'pipe_stage_01_of_02']" in r["other_degree"]


def test_interleaved_stage_memory_is_its_chunks_share(results: list[dict]) -> None:
    """pp2 (v=2) x dp2, depth-8 MLP cut into 4 parts by parameters: 384 | 544 | 544 | 340 parameters;
    rank r holds parts r and r + 2, so stage 0 holds 384 + 544 and stage 1 544 + 340 (fp32), both within
    10% of parameters / pp; and every rank's parameters are exactly its chunks' (nothing else built)."""
    per_rank = [r["train"][INTERLEAVED_PP2] for r in results]
    assert per_rank[0]["parts"] == [0, 5, 9, 13, 16]
    assert [r["virtual_stages"] for r in per_rank] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert [r["chunk_params"] for r in per_rank] == [[384, 544], [384, 544], [544, 340], [544, 340]]
    assert [r["own_param_bytes"] for r in per_rank] == [4 * 928, 4 * 928, 4 * 884, 4 * 884]
    assert max(r["own_param_bytes"] for r in per_rank) <= 1.1 * 4 * (928 + 884) / 2


def test_resume_with_other_chunks_is_refused(results: list[dict]) -> None:
    for stage, r in enumerate(results):
        stage //= 2  # pp2 x dp2
        error = r["other_chunks"]
        assert f"has no checkpoint for stage {stage} of 2 (pipe_stage_{stage:02d}_of_02)" in error
        assert "it holds ['pipe_stage_00_of_02_chunks_02', 'pipe_stage_01_of_02_chunks_02']" in error


def test_pipeline_by_tensor_parallel_with_chunks_is_the_same_model(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        got = r["three_d"]
        assert got[2] == pytest.approx(got[1], rel=1e-6), f"rank {rank}"
        assert got["norm2"] == pytest.approx(got["norm1"], rel=1e-5), f"rank {rank}"
        stage, model = divmod(rank, 2)  # pp2 x tp2 x dp1: the model axis is the fastest
        assert got["folder2"] == f"pipe_stage_{stage:02d}_of_02_chunks_02_tp_{model:02d}_of_02"
