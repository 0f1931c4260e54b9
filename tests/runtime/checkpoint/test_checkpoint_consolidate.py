"""Consolidation: a sharded checkpoint becomes one state dict that a plain model loads, streamed.

- A GPT with tied embedding/head weights, a buffer and a frozen layer is trained on 3 ranks and saved.
  ZeRO-2, fp32: `get_fp32_state_dict_from_checkpoint` (no process group) returns the engine's own fp32
  state dict bitwise, the plain model loads it strictly and computes the engine's loss. ZeRO-3 (a gather
  unit per block), bf16: the same fp32 state dict, and `ds_consolidate --dtype bf16` writes a safetensors
  file whose weights equal the bf16 working weights.
- Memory: consolidating a 3-rank checkpoint of a 6M-parameter model in a fresh process raises its peak
  RSS by less than 2x the largest shard file (a naive consolidation holds every shard plus the output,
  4x here); the reader reads exactly the fp32 master bytes, none of the optimizer state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime.checkpoint import CheckpointCorrupted, get_fp32_state_dict_from_checkpoint, load_state_dict_file
from runtime.checkpoint.consolidate import main as consolidate_main
from runtime.checkpoint.manifest import shard_file_name
from runtime.models import GPT, GPTConfig
from tests.support.dist import run_distributed
from tests.support.paths import REPO

ROOT = REPO
VOCAB, SEQ = 64, 16


class GPTWithExtras(nn.Module):
    """GPT (tied head) plus a buffer and a frozen layer: the non-parameter parts of a state dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB, max_seq_len=SEQ))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.gpt(idx, targets).loss


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train_and_save(rank: int, world: int, save_dir: str, dtype: str, stage: int) -> dict:
    import runtime

    config = {
        "train_batch_size": 6,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    if stage == 3:  # a gather unit per block, embedding and head: parameters sharded unit by unit
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = runtime.initialize(model=GPTWithExtras(), config=config)
    if stage == 3:
        assert type(engine.zero).__name__ == "ParamShardedStage" and len(engine.groups) > 2
    per = 6 // world
    for step in range(3):
        x, y = _batch(step, 6)
        engine.backward(engine(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        engine.step()
    engine.save_checkpoint(save_dir)
    state = engine.full_state_dict(rank0_only=False)
    with torch.no_grad():
        loss = float(engine(*_batch(99, 4)))
    with runtime.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        working = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"state": state, "loss": loss, "working": working}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("consolidate")
    out = {}
    stages = {"fp32": 2, "bf16": 3}
    for dtype, stage in stages.items():
        out[dtype] = (root / dtype, run_distributed(_train_and_save, 3, str(root / dtype), dtype, stage)[0])
    return out


def test_fp32_state_dict_loads_into_the_plain_model_and_gives_the_engine_loss(checkpoints: dict) -> None:
    save_dir, engine = checkpoints["fp32"]
    state = get_fp32_state_dict_from_checkpoint(save_dir)
    assert list(state) == list(engine["state"])  # every key, in state-dict order, tied head included
    for key, tensor in engine["state"].items():
        assert torch.equal(state[key], tensor), key
    assert state["seen"].item() == 3.0  # the buffer as saved
    model = GPTWithExtras()
    model.load_state_dict(state)  # strict
    assert model.gpt.lm_head.weight is model.gpt.tok_emb.weight
    with torch.no_grad():
        assert float(model(*_batch(99, 4))) == pytest.approx(engine["loss"], rel=1e-6, abs=1e-7)


def test_ds_consolidate_writes_bf16_weights_equal_to_the_working_weights(
    checkpoints: dict, tmp_path: Path
) -> None:
    save_dir, engine = checkpoints["bf16"]  # saved by ZeRO-3: parameters sharded unit by unit
    output = tmp_path / "out" / "model.safetensors"
    assert consolidate_main([str(save_dir), str(output), "--dtype", "bf16"]) == 0
    state = load_state_dict_file(output)
    fp32 = get_fp32_state_dict_from_checkpoint(save_dir)
    for key, tensor in engine["state"].items():
        assert torch.equal(fp32[key], tensor), key
    for name, working in engine["working"].items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], working), name  # working weights are the rounded fp32 masters
    model = GPTWithExtras().to(torch.bfloat16)
    model.load_state_dict(state)


def test_consolidation_errors_are_one_line_with_an_exit_code(
    checkpoints: dict, tmp_path: Path, capsys
) -> None:
    save_dir, _ = checkpoints["fp32"]
    assert consolidate_main([str(tmp_path / "absent"), str(tmp_path / "o.safetensors")]) == 1
    assert "checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        consolidate_main([str(save_dir), str(tmp_path / "out.pt")])
    assert exit_info.value.code == 2
    assert "must end in .safetensors" in capsys.readouterr().err
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(save_dir), str(broken)], check=True)
    shard = broken / "global_step3" / shard_file_name(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert consolidate_main([str(broken), str(tmp_path / "o.safetensors")]) == 1
    err = capsys.readouterr().err
    # One error line naming the file, one hint line saying what to do: no traceback.
    error, hint = err.splitlines()
    assert error.startswith("ds_consolidate: error: ") and f"{shard}: checksum mismatch" in error
    assert hint.startswith("ds_consolidate: hint: ") and "load an earlier tag" in hint
    with pytest.raises(CheckpointCorrupted, match=str(shard)):
        get_fp32_state_dict_from_checkpoint(broken)


# ------------------------------------------------------------------------------------------------ memory


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(768, 768) for _ in range(10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _save_wide(rank: int, world: int, save_dir: str) -> int:
    import runtime

    config = {
        "train_batch_size": 3,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = runtime.initialize(model=WideMLP(), config=config)
    engine.backward(engine(torch.randn(1, 768)))
    engine.step()
    engine.save_checkpoint(save_dir)
    engine.destroy()
    return sum(p.numel() for p in engine.module.parameters())


# Peak RSS of the consolidation alone: the kernel's high-water mark (VmHWM) is reset right before it
# (Linux: "5" into /proc/self/clear_refs), so import-time peaks do not count.
_MEASURE = """
import json, sys
import torch
from runtime.checkpoint.consolidate import consolidate_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
result = consolidate_checkpoint(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "peak": status("VmHWM"), "bytes_read": result.bytes_read,
                  "written": result.bytes}))
"""


def test_consolidation_peak_memory_stays_under_twice_the_largest_shard(tmp_path: Path) -> None:
    numel = run_distributed(_save_wide, 3, str(tmp_path / "ckpt"))[0]
    shards = [tmp_path / "ckpt" / "global_step1" / shard_file_name(r) for r in range(3)]
    largest = max(s.stat().st_size for s in shards)
    output = tmp_path / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt"), str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    grown = m["peak"] - m["before"]
    print(
        f"consolidate: {numel / 1e6:.1f}M params, largest shard {largest / 2**20:.1f} MiB, output "
        f"{m['written'] / 2**20:.1f} MiB, peak RSS growth {grown / 2**20:.1f} MiB"
    )
    assert m["bytes_read"] == numel * 4  # exactly the fp32 masters, not the optimizer state
    assert m["written"] > numel * 4
    assert grown < 2 * largest, (grown, largest)
    state = load_state_dict_file(output)
    model = WideMLP()
    model.load_state_dict(state)
