"""Activation checkpointing: same losses and gradients as without it (dropout on), far less kept for backward.

Memory is measured, not assumed: a saved-tensor hook around the forward counts the bytes autograd keeps for
backward (distinct storages, parameters excluded: they exist anyway). For a stack of L transformer blocks
the checkpointed run must keep exactly L block inputs, and the plain run L times what one block keeps, so
the ratio is the per-block factor measured on one block. Options that move the kept inputs
(partition_activations over a model-parallel group, contiguous slots, profile) are checked for equal
gradients and for where the bytes ended up; cpu_checkpointing's device saving needs a GPU (test skipped
without one). The engine runs are parity tests at world size 2 for ZeRO stages 0, 1 and 2.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from torch import nn

import runtime
from runtime import activation_checkpointing
from runtime.config import ConfigError
from runtime.models import GPT, GPTConfig
from runtime.models.gpt import Block
from tests.support.dist import run_distributed
from tests.support.paths import REPO

BLOCK_CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=64, vocab_size=64, max_seq_len=32, dropout=0.1)
BATCH, SEQ = 4, 32


@pytest.fixture(autouse=True)
def fresh_settings() -> Any:
    """Checkpointing options are process-wide: every test starts and ends with the defaults. One intra-op
    thread: these models are tiny, and on a busy 2-core box a second thread only waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    activation_checkpointing.configure()
    activation_checkpointing.take_profile()
    yield
    activation_checkpointing.configure()
    torch.set_num_threads(threads)


def make_stack(layers: int = BLOCK_CONFIG.n_layer) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(BLOCK_CONFIG) for _ in range(layers))


class SavedBytes:
    """Counts the bytes autograd saves for backward while active (each storage once, no parameters)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run_stack(
    blocks: nn.ModuleList, use_checkpoint: bool, seed: int = 7
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """(output, gradients of input and parameters, bytes kept for backward) of one forward/backward."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, BLOCK_CONFIG.n_embd, generator=gen, requires_grad=True)
    params = list(blocks.parameters())
    counter = SavedBytes(params)
    torch.manual_seed(seed)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):  # the blocks only
        h = x
        for block in blocks:
            h = activation_checkpointing.checkpoint(block, h) if use_checkpoint else block(h)
    out = h.detach().clone()
    h.pow(2).mean().backward()
    grads = [x.grad] + [p.grad.clone() for p in params]
    blocks.zero_grad(set_to_none=True)
    return out, grads, counter.total


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"gradient {i} differs: max abs diff {float((x - y).abs().max()):.3e}"


def test_same_gradients_with_dropout_and_saved_bytes_drop_by_the_block_factor() -> None:
    blocks = make_stack()
    plain_out, plain_grads, plain_bytes = run_stack(blocks, use_checkpoint=False)
    ckpt_out, ckpt_grads, ckpt_bytes = run_stack(blocks, use_checkpoint=True)
    # dropout really draws masks (the run differs from another seed), and checkpointing replays them
    other_out, _, _ = run_stack(blocks, use_checkpoint=False, seed=8)
    assert not torch.equal(plain_out, other_out)
    assert torch.equal(plain_out, ckpt_out)
    assert_same(plain_grads, ckpt_grads)

    layers = BLOCK_CONFIG.n_layer
    input_bytes = BATCH * SEQ * BLOCK_CONFIG.n_embd * 4
    _, _, one_block = run_stack(make_stack(1), use_checkpoint=False)
    # the plain stack keeps what one block keeps, L times; the checkpointed one each block's input only
    assert plain_bytes == layers * one_block
    assert ckpt_bytes == layers * input_bytes
    factor = one_block / input_bytes
    assert factor > 10, f"a block keeps only {factor:.1f}x its input?"
    assert plain_bytes / ckpt_bytes == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {"checkpoint_in_cpu": True},
        {"contiguous_checkpointing": True, "num_checkpoints": BLOCK_CONFIG.n_layer},
        {"synchronize": True, "profile": True},
    ],
    ids=["cpu_checkpointing", "contiguous", "synchronize+profile"],
)
def test_options_keep_gradients_exact(options: dict[str, Any]) -> None:
    blocks = make_stack()
    plain_out, plain_grads, _ = run_stack(blocks, use_checkpoint=False)
    activation_checkpointing.configure(**options)
    for _ in range(2):  # the second pass reuses contiguous slots freed by the first backward
        out, grads, _ = run_stack(blocks, use_checkpoint=True)
        assert torch.equal(out, plain_out)
        assert_same(plain_grads, grads)
    stats = activation_checkpointing.take_profile()
    if options.get("profile"):
        assert stats.forward_calls == 2 * BLOCK_CONFIG.n_layer
        assert stats.recompute_calls == 2 * BLOCK_CONFIG.n_layer  # each block recomputed once per backward
        assert stats.forward_seconds > 0 and stats.recompute_seconds > 0
    else:
        assert stats.forward_calls == stats.recompute_calls == 0


def test_contiguous_slots_hold_the_inputs_and_are_freed_by_backward() -> None:
    layers = BLOCK_CONFIG.n_layer
    activation_checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=layers)
    blocks = make_stack()
    x = torch.randn(BATCH, SEQ, BLOCK_CONFIG.n_embd, requires_grad=True)
    h = x
    for block in blocks:
        h = activation_checkpointing.checkpoint(block, h)
    arena = activation_checkpointing._state.arena
    assert len(arena._pools) == 1, list(arena._pools)  # one (numel, dtype, device) of inputs
    ((buffer, free),) = arena._pools.values()
    assert buffer.shape == (layers, x.numel()) and free == []  # one buffer, every slot in use
    assert activation_checkpointing.take_profile().device_bytes_kept == layers * x.numel() * 4
    h.sum().backward()
    assert sorted(free) == list(range(layers))  # backward released every slot

    # one more checkpointed call than slots, before any backward: a clear error naming the setting
    activation_checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=layers - 1)
    h = x
    with pytest.raises(RuntimeError, match=r"number_checkpoints=5 .* alive at once"):
        for block in blocks:
            h = activation_checkpointing.checkpoint(block, h)


def test_configure_reads_the_config_and_explicit_arguments_win() -> None:
    section = {"cpu_checkpointing": True, "number_checkpoints": 4, "profile": True}
    chosen = activation_checkpointing.configure(
        deepspeed_config={"activation_checkpointing": section}, profile=False
    )
    assert activation_checkpointing.is_configured()
    assert chosen.cpu_checkpointing and chosen.number_checkpoints == 4 and not chosen.profile
    assert activation_checkpointing.settings() == chosen
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpoint.*did you mean"):
        activation_checkpointing.configure(
            deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}}
        )
    with pytest.raises(ConfigError, match="contiguous_memory_optimization: needs number_checkpoints"):
        activation_checkpointing.configure(contiguous_checkpointing=True)
    with pytest.raises(TypeError, match="no get_model_parallel_group"):
        activation_checkpointing.configure(object(), partition_activations=True)
    activation_checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=2)
    activation_checkpointing.reset()  # DeepSpeed's reset: new buffers, same configuration
    assert activation_checkpointing.settings().contiguous_memory_optimization


def test_flag_from_add_config_arguments() -> None:
    parser = runtime.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed_activation_checkpointing"]).deepspeed_activation_checkpointing
    assert not parser.parse_args([]).deepspeed_activation_checkpointing


@pytest.mark.gpu  # cpu_checkpointing saves device memory: CUDA only
def test_cpu_checkpointing_moves_inputs_off_the_gpu() -> None:
    blocks = make_stack().cuda()
    x = torch.randn(BATCH, SEQ, BLOCK_CONFIG.n_embd, device="cuda", requires_grad=True)

    def kept_on_device(cpu: bool) -> int:
        activation_checkpointing.configure(checkpoint_in_cpu=cpu)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for block in blocks:
            h = activation_checkpointing.checkpoint(block, h)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
        h.sum().backward()
        return kept

    on_device, on_host = kept_on_device(False), kept_on_device(True)
    inputs = (BLOCK_CONFIG.n_layer - 1) * x.numel() * 4  # the last output is alive in both runs
    assert on_device - on_host >= inputs * 0.99, (on_device, on_host)


# -------------------------------------------------------------------------------- distributed


class _WorldMPU:
    """A model-parallel unit whose model-parallel group is the whole (2-rank) world."""

    def get_model_parallel_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def _partitioned(rank: int, world_size: int) -> dict:
    blocks = make_stack()
    plain_out, plain_grads, _ = run_stack(blocks, use_checkpoint=False)
    activation_checkpointing.configure(_WorldMPU(), partition_activations=True)
    out, grads, _ = run_stack(blocks, use_checkpoint=True)
    kept = activation_checkpointing.take_profile().device_bytes_kept
    pairs = zip(grads, plain_grads, strict=True)
    same = torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in pairs)
    # pure data parallelism (an MP group of one rank): partitioning is a no-op, nothing is copied
    activation_checkpointing.configure(None, partition_activations=True)
    run_stack(blocks, use_checkpoint=True)
    return {"same": same, "kept": kept, "dp_kept": activation_checkpointing.take_profile().device_bytes_kept}


def test_partition_activations_splits_inputs_over_the_model_parallel_group(world2: list[dict]) -> None:
    results = [report["partition"] for report in world2]
    inputs = BLOCK_CONFIG.n_layer * BATCH * SEQ * BLOCK_CONFIG.n_embd * 4
    for rank, got in enumerate(results):
        assert got["same"], f"rank {rank}: gradients differ with partitioned inputs"
        assert got["kept"] == inputs // 2, (rank, got["kept"], inputs)
        assert got["dp_kept"] == 0


GPT_CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, max_seq_len=16, dropout=0.1)


def _engine_run(stage: int, use_checkpoint: bool, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    if use_checkpoint:
        model.checkpoint_fn = activation_checkpointing.checkpoint
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 0,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "activation_checkpointing": {"number_checkpoints": GPT_CONFIG.n_layer, "profile": True},
    }
    engine, _, _, _ = runtime.initialize(model=model, config=config)
    torch.manual_seed(100 + rank)  # dropout differs per rank, the same in both runs
    gen = torch.Generator().manual_seed(rank)
    losses, norms = [], []
    for _ in range(3):
        for _ in range(2):
            idx = torch.randint(0, GPT_CONFIG.vocab_size, (2, 16), generator=gen).to(engine.device)
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "master": engine.full_state_dict(rank0_only=False)}
    out["recomputed"] = activation_checkpointing.take_profile().recompute_calls
    engine.destroy()
    return out


def _world(rank: int, world_size: int) -> dict:
    # runtime.initialize applies the config's section when configure() was not called before
    report: dict[str, Any] = {"fresh": activation_checkpointing.is_configured()}
    for stage in (0, 1, 2, 3):
        try:
            plain = _engine_run(stage, False, rank)
        except NotImplementedError:
            report[stage] = None  # stage 3 before the engine has it
            continue
        ckpt = _engine_run(stage, True, rank)
        report[stage] = {
            "losses": plain["losses"] == ckpt["losses"],
            "norms": plain["norms"] == ckpt["norms"],
            "weights": all(torch.equal(plain["master"][k], v) for k, v in ckpt["master"].items()),
            "recomputed": ckpt["recomputed"],
        }
    report["settings"] = activation_checkpointing.settings()
    report["partition"] = _partitioned(rank, world_size)
    return report


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    """One 2-rank spawn for the engine parity runs and the partitioning checks."""
    return run_distributed(_world, 2, timeout=180)


def test_engine_losses_and_gradients_equal_with_checkpointing_stages_0_to_3(world2: list[dict]) -> None:
    for rank, report in enumerate(world2):
        assert report["fresh"] is False
        assert report["settings"].number_checkpoints == GPT_CONFIG.n_layer and report["settings"].profile
        for stage in (0, 1, 2, 3):
            got = report[stage]
            if got is None and stage == 3:
                continue  # ZeRO-3 not in the engine yet
            assert got["losses"] and got["norms"] and got["weights"], f"rank {rank} stage {stage}: {got}"
            # 3 blocks x 6 micro-steps were recomputed in backward
            assert got["recomputed"] == GPT_CONFIG.n_layer * 6, (rank, stage, got)


def test_train_gpt_flag_checkpoints_every_block_with_the_same_losses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user-facing switch: --deepspeed_activation_checkpointing gives the plain run's losses (dropout
    on); the log lines carry an ETA and, off a terminal, no progress-bar control characters. The script's
    main() runs in this process (a one-process world) to save two interpreter starts."""
    import importlib.util
    import re

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # the script leaves threads alone
    path = REPO / "scripts" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", path)
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)  # type: ignore[union-attr]
    argv = ["--steps", "3", "--log_interval", "1", "--seq_len", "64", "--dropout", "0.1", "--n_layer", "2"]
    runs = {}
    for flag in ([], ["--deepspeed_activation_checkpointing"]):
        capsys.readouterr()
        assert train_gpt.main(argv + flag) == 0
        runs[bool(flag)] = capsys.readouterr().out
    assert "activation checkpointing: each of the 2 blocks" in runs[True]
    assert "activation checkpointing" not in runs[False]
    pattern = r"^step \d/3 \| loss ([0-9.]+) .*\| (?:ETA \S+|done)$"
    losses = {k: re.findall(pattern, v, re.M) for k, v in runs.items()}
    assert len(losses[True]) == 3 and losses[True] == losses[False], runs
    assert "\r" not in runs[True] and "\033[" not in runs[True]


def test_empty_inputs_take_no_contiguous_slot() -> None:
    # an empty tensor among what a checkpointed call keeps (torch 2.11 on the GPU machine kept one) holds
    # nothing: it must not use up, or overflow, the slots that number_checkpoints sizes for the inputs
    activation_checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=1)
    weight = torch.randn(4, 4, requires_grad=True)

    def block(h: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return h @ weight + first.sum() + second.sum()

    x = torch.randn(3, 4, requires_grad=True)
    out = activation_checkpointing.checkpoint(block, x, torch.zeros(0), torch.zeros(0))
    assert list(activation_checkpointing._state.arena._pools) == [(12, torch.float32, torch.device("cpu"))]
    out.sum().backward()
    assert torch.allclose(x.grad, weight.detach().sum(1).expand(3, 4))


def test_the_old_module_name_is_the_same_module() -> None:
    # runtime.checkpointing (README's and DeepSpeed users' path) is the renamed module itself, not a copy
    import runtime.checkpointing
    from runtime import checkpointing

    assert checkpointing is runtime.checkpointing is activation_checkpointing
    chosen = checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=3)
    assert activation_checkpointing.is_configured() and activation_checkpointing.settings() == chosen
    activation_checkpointing.configure()
    assert not checkpointing.settings().contiguous_memory_optimization
