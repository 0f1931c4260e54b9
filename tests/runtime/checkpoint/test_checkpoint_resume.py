"""Save, kill the process group, resume: the run continues exactly as if it had never stopped.

Phase A (one spawn per world size 1, 2, 3) runs every case twice: 6 steps straight, and 3 steps then
save_checkpoint. Phase B (a fresh spawn per world size, so a new process group and new processes) loads
each checkpoint, trains 3 more steps and compares with the straight run:

- same world size and stage: losses, fp32 master weights, working weights, loss scale, skipped steps, lr
  and the data loader's next batches are bitwise equal (fp32, bf16 and fp16 alike: the same operations
  run in the same order);
- another world size and/or stage (a world-2 checkpoint at 1 and 3 ranks, a stage-2 checkpoint under
  stages 1 and 0, ...): losses and weights match the straight run at the loading configuration within
  fp32 tolerance (16-bit runs: the tolerance of the ZeRO parity tests), and the data loader resumes at
  the same global sample.

Optimizer offload (masters and Adam state in host memory, the CPU step) is saved and resumed the same
way, and a checkpoint moves between offloaded and on-device runs. With ZeRO stage 3 present (parameters
sharded per gather unit: a flat group and an optimizer param group per unit and user param group, 7 here
where stages 0-2 have 2) its cases join the grid, and checkpoints move between stage 3 and stages 0-2:
optimizer hyperparameters and the LR schedule's per-group lists are matched by user param group.

Every case uses AdamW over two param groups (different weight decay), gradient clipping, a warmup/decay
LR schedule, and a data loader owned by the engine; fp16 cases start with a loss scale that overflows, so
skipped steps and the scaler's hysteresis state cross the checkpoint; bf16 cases accumulate 2 micro-steps.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed
from tests.support.models import loss_fn, make_model, param_groups, rank_batch

ROWS = 12  # global rows per micro-step
STEPS = 6
SPLIT = 3
WORLDS = (1, 2, 3)


class IndexDataset(torch.utils.data.Dataset):
    """Sample i is the tensor [i]: the loader's batches say exactly which samples it served."""

    def __len__(self) -> int:
        return 120

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@dataclass(frozen=True)
class Case:
    world: int
    stage: int
    dtype: str
    optimizer: str = "AdamW"
    offload: bool = False  # zero_optimization.offload_optimizer: masters and state in host memory
    device_step: bool = False  # offload_optimizer.update "device": the state streams through the "device"

    @property
    def accumulation(self) -> int:
        return 2 if self.dtype == "bf16" else 1

    @property
    def name(self) -> str:
        offload = "-offload" if self.offload else ""
        return f"w{self.world}-s{self.stage}-{self.dtype}-{self.optimizer}{offload}" + (
            "-device-step" if self.device_step else ""
        )

    def config(self) -> dict:
        cfg: dict = {
            "train_batch_size": ROWS * self.accumulation,
            "gradient_accumulation_steps": self.accumulation,
            "steps_per_print": 0,
            "gradient_clipping": 0.5,
            "optimizer": {"type": self.optimizer, "params": {"lr": 3e-3}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": STEPS + 2, "warmup_num_steps": 2, "warmup_type": "linear"},
            },
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": 700},
        }
        if self.offload:
            update = "device" if self.device_step else "host"
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "update": update}
        if self.stage == 3:  # a gather unit per linear layer: 7 flat groups where stages 0-2 have 2
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 100
        if self.optimizer == "SGD":
            cfg["optimizer"]["params"].update(lr=0.05, momentum=0.9)
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.dtype == "fp16":
            # 2**17 overflows now and then: steps are skipped before and after the save, the scale moves
            cfg["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 17, "hysteresis": 1}
            cfg["fp16"]["loss_scale_window"] = 2
        return cfg


SAVED = [Case(w, s, d) for w in WORLDS for s in (0, 1, 2) for d in ("fp32", "bf16", "fp16")]
SAVED += [Case(2, 1, "fp32", "SGD"), Case(3, 2, "fp32", "SGD")]  # momentum_buffer instead of Adam's moments
SAVED += [
    Case(1, 1, "fp32", offload=True),
    Case(2, 2, "bf16", offload=True),
    Case(3, 2, "fp16", offload=True),
    Case(1, 1, "bf16", offload=True, device_step=True),
    Case(2, 2, "fp32", offload=True, device_step=True),
]
# (saved case, loading case): another world size, another stage, or both
CROSS = [
    (Case(2, 2, "fp32"), Case(1, 2, "fp32")),
    (Case(2, 2, "fp32"), Case(3, 2, "fp32")),
    (Case(2, 2, "fp32"), Case(2, 1, "fp32")),
    (Case(2, 2, "fp32"), Case(2, 0, "fp32")),
    (Case(2, 2, "fp32"), Case(3, 0, "fp32")),
    (Case(2, 0, "fp32"), Case(3, 1, "fp32")),
    (Case(2, 1, "fp32", "SGD"), Case(3, 2, "fp32", "SGD")),
    (Case(3, 2, "fp32"), Case(2, 1, "fp32")),
    (Case(2, 1, "bf16"), Case(1, 0, "bf16")),
    (Case(2, 2, "bf16"), Case(3, 1, "bf16")),
    (Case(2, 2, "fp16"), Case(3, 2, "fp16")),
    (Case(2, 0, "fp16"), Case(1, 1, "fp16")),
    # optimizer offload on one side only: the host-side state is the same checkpoint
    (Case(2, 2, "bf16", offload=True), Case(3, 1, "bf16")),
    (Case(2, 2, "fp32"), Case(1, 1, "fp32", offload=True)),
    (Case(2, 2, "fp16"), Case(3, 2, "fp16", offload=True)),
    # the state streamed through the device on one side: the same host state, the same checkpoint
    (Case(2, 2, "fp32", offload=True, device_step=True), Case(1, 1, "fp32", offload=True)),
    (Case(1, 1, "fp32", offload=True), Case(2, 2, "fp32", offload=True, device_step=True)),
]
# stage 3: parameters sharded per gather unit, another grouping, the same checkpoint
SAVED += [Case(w, 3, d) for w in WORLDS for d in ("fp32", "bf16", "fp16")]
SAVED += [Case(2, 3, "bf16", offload=True)]
CROSS += [
    (Case(2, 2, "fp32"), Case(3, 3, "fp32")),
    (Case(3, 3, "fp32"), Case(2, 1, "fp32")),
    (Case(2, 3, "fp32"), Case(1, 0, "fp32")),
    (Case(2, 3, "bf16"), Case(3, 2, "bf16")),
    (Case(2, 3, "fp16"), Case(3, 3, "fp16")),
    (Case(2, 3, "bf16", offload=True), Case(3, 3, "bf16")),
]


def _build(case: Case):
    import runtime

    model = make_model(0)
    engine, _, loader, _ = runtime.initialize(
        model=model, model_parameters=param_groups(model), config=case.config(), training_data=IndexDataset()
    )
    loader.sampler.set_epoch(1)
    assert (type(engine.masters).__name__ == "HostMasters") == case.offload  # really offloaded, or not
    assert getattr(engine.masters, "update_on_device", False) == case.device_step
    if case.stage == 3 and case.world > 1:  # parameters really sharded, 7 flat groups and optimizer groups
        assert type(engine.zero).__name__ == "ParamShardedStage" and len(engine.optimizer.param_groups) == 7
    return engine, loader


def _steps(engine, rank: int, world: int, count: int) -> list[float]:
    """`count` optimizer steps on the global batches of steps global_steps, global_steps + 1, ..."""
    losses = []
    for _ in range(count):
        step = engine.global_steps
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = rank_batch(step, micro, ROWS, rank, world)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
    for loss in losses:  # one by one: a ring all-reduce sums each chunk of a vector in a different order
        dist.all_reduce(loss)
    return [float(loss) / world for loss in losses]


def _working(engine) -> dict:
    """The model's working weights (gathered first where ZeRO-3 shards them)."""
    params = list(engine.module.parameters())
    if engine.zero_stage == 3:
        from runtime.zero import GatheredParameters

        with GatheredParameters(params):
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _snapshot(engine, losses: list[float], batches: list[list[int]]) -> dict:
    return {
        "losses": losses,
        "master": engine.full_state_dict(rank0_only=False),
        "working": _working(engine),
        "skipped": engine.skipped_steps,
        "scale": engine.loss_scale,
        "lr": engine.get_lr(),
        "steps": engine.global_steps,
        "batches": batches,
    }


def _scramble_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draws() -> list[float]:
    """One number from each RNG a training script may use (Python, NumPy, torch)."""
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def _next_batches(iterator, count: int) -> list[list[int]]:
    return [next(iterator).reshape(-1).tolist() for _ in range(count)]


def _phase_save(rank: int, world: int, root: str, cases: list[Case]) -> dict:
    out = {}
    for case in cases:
        engine, loader = _build(case)
        batches = iter(loader)
        losses = _steps(engine, rank, world, STEPS)
        after_split = losses[SPLIT * case.accumulation :]
        straight = _snapshot(engine, after_split, _next_batches(batches, STEPS)[SPLIT:])
        engine.destroy()

        engine, loader = _build(case)
        batches = iter(loader)
        _next_batches(batches, SPLIT)
        losses = _steps(engine, rank, world, SPLIT)
        _scramble_rng(1000 * rank + len(out))  # a state that only a restore brings back
        engine.save_checkpoint(f"{root}/{case.name}", client_state={"case": case.name, "losses": losses})
        straight["rng_draws"] = _draws()  # per rank, what the RNGs give right after the save
        out[case.name] = {"straight": straight, "skipped": engine.skipped_steps}
        engine.destroy()
    return out


def _phase_load(rank: int, world: int, root: str, jobs: list[tuple[Case, Case, dict, dict]]) -> dict:
    """jobs: (saved case, loading case, straight run of the loading case, straight run of the saved case).
    Returns the problems found per job."""
    report = {}
    for saved, loading, straight, other in jobs:
        engine, loader = _build(loading)
        path, client = engine.load_checkpoint(f"{root}/{saved.name}")
        draws = _draws()  # before anything else uses the RNGs (a DataLoader iterator draws a seed)
        problems = []
        if saved.world == loading.world and draws != other["rng_draws"]:
            problems.append(f"RNG draws after the load {draws}, after the save {other['rng_draws']}")
        if not path.endswith(f"{saved.name}/global_step{SPLIT}"):
            problems.append(f"loaded {path}")
        if client.get("case") != saved.name:
            problems.append(f"client_state {client}")
        if engine.global_steps != SPLIT:
            problems.append(f"global_steps {engine.global_steps} after load")
        batches = _next_batches(iter(loader), STEPS - SPLIT)
        losses = _steps(engine, rank, world, STEPS - SPLIT)
        got = _snapshot(engine, losses, batches)
        engine.destroy()
        same = (saved.world, saved.stage) == (loading.world, loading.stage)
        problems += _compare(got, straight, other, exact=same, fp32=loading.dtype == "fp32")
        report[f"{saved.name} -> {loading.name}"] = problems
    return report


def _compare(got: dict, want: dict, other: dict, *, exact: bool, fp32: bool) -> list[str]:
    """`want`: the straight run at the loading configuration; `other`: the straight run at the saving one
    (for 16-bit runs their distance is the rounding noise that changing world size or stage brings)."""
    problems = []
    if got["batches"] != want["batches"]:
        problems.append(f"data loader served {got['batches']}, straight run {want['batches']}")
    for key in ("steps", "skipped", "scale", "lr"):
        if got[key] != want[key] and (exact or key in ("steps", "skipped", "scale")):
            problems.append(f"{key} {got[key]} vs straight {want[key]}")
    if exact:
        if got["losses"] != want["losses"]:
            problems.append(f"losses {got['losses']} vs straight {want['losses']}")
        for kind in ("master", "working"):
            for name, tensor in want[kind].items():
                if not torch.equal(got[kind][name], tensor):
                    diff = float((got[kind][name].float() - tensor.float()).abs().max())
                    problems.append(f"{kind} {name} differs (max abs {diff:.3e})")
        return problems
    tol = 1e-5 if fp32 else 2e-2
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        if abs(a - b) > tol * abs(b):
            problems.append(f"loss[{i}] {a:.7f} vs straight {b:.7f}")
    for name, tensor in want["master"].items():
        have = got["master"][name]
        if fp32:
            if not torch.allclose(have, tensor, rtol=1e-5, atol=1e-6):
                problems.append(f"master {name}: max abs diff {float((have - tensor).abs().max()):.3e}")
            continue
        noise = float((other["master"][name] - tensor).norm())
        error = float((have - tensor).norm())
        if error > 2 * noise + 1e-6 * float(tensor.norm()):
            problems.append(f"master {name}: off by {error:.3e}, but stage/world noise is only {noise:.3e}")
    return problems


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Phase A at every world size: straight runs and checkpoints of every case."""
    root = tmp_path_factory.mktemp("ckpt")
    results: dict = {}
    for world in WORLDS:
        cases = [c for c in SAVED if c.world == world]
        per_rank = run_distributed(_phase_save, world, str(root), cases, timeout=240)
        for name in per_rank[0]:
            results[name] = {
                "straight": [r[name]["straight"] for r in per_rank],
                "skipped_at_save": per_rank[0][name]["skipped"],
            }
    return root, results


def _jobs(results: dict, world: int) -> list[tuple[Case, Case, list[dict], dict]]:
    pairs = [(c, c) for c in SAVED if c.world == world] + [(s, ld) for s, ld in CROSS if ld.world == world]
    return [(s, ld, results[ld.name]["straight"], results[s.name]["straight"]) for s, ld in pairs]


def _phase_load_per_rank(rank: int, world: int, root: str, packed: bytes) -> dict:
    # each rank compares against the straight run's values of its own rank (batches are per rank)
    jobs = pickle.loads(packed)
    return _phase_load(
        rank,
        world,
        root,
        [(s, ld, want[rank], other[min(rank, len(other) - 1)]) for s, ld, want, other in jobs],
    )


@pytest.mark.parametrize("world", WORLDS)
def test_resume_continues_exactly(saved: tuple[Path, dict], world: int) -> None:
    root, results = saved
    jobs = _jobs(results, world)
    # plain pickle: the expected tensors travel by value, not as shared-memory file descriptors
    reports = run_distributed(_phase_load_per_rank, world, str(root), pickle.dumps(jobs), timeout=240)
    failures = {
        f"rank {rank}: {job}": problems
        for rank, report in enumerate(reports)
        for job, problems in report.items()
        if problems
    }
    assert len(reports[0]) == len(jobs)
    assert not failures, "\n".join(f"{job}: {problems}" for job, problems in failures.items())


def test_fp16_cases_skip_steps_across_the_checkpoint(saved: tuple[Path, dict]) -> None:
    """The fp16 cases exercise the scaler: steps were skipped before the save and again after it."""
    _, results = saved
    for case in (c for c in SAVED if c.dtype == "fp16"):
        before = results[case.name]["skipped_at_save"]
        total = results[case.name]["straight"][0]["skipped"]
        assert 0 < before < total, (case.name, before, total)
