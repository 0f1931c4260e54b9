"""The example job end to end: data pipeline, train_gpt.py, the dslaunch demo, the throughput bench."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime
from runtime.data import (
    DEFAULT_CORPUS,
    ByteTokenizer,
    DataError,
    SyntheticTokenDataset,
    TokenBlockDataset,
    load_tokenizer,
)
from tests.support.dist import free_port
from tests.support.paths import REPO

ROOT = REPO
TRAIN = ROOT / "scripts" / "train_gpt.py"
BENCH = ROOT / "scripts" / "bench" / "train_throughput.py"
ZERO2 = ROOT / "scripts" / "configs" / "zero2.json"

needs_engine = pytest.mark.skipif(
    not (hasattr(runtime, "initialize") and hasattr(runtime, "add_config_arguments")),
    reason="needs the engine (runtime.initialize, runtime.add_config_arguments)",
)
needs_launcher = pytest.mark.skipif(
    shutil.which("dslaunch", path=str(Path(sys.executable).parent)) is None
    or importlib.util.find_spec("launcher.cli") is None
    or not ZERO2.exists(),
    reason="needs the launcher (launcher.cli / dslaunch) and scripts/configs/zero2.json",
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _logged_losses(output: str) -> list[float]:
    return [float(m) for m in re.findall(r"step \d+/\d+ \| loss ([0-9.]+)", output)]


# ---------------------------------------------------------------------------------------------- data


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "Plain ASCII, accents: é à ü, and a snowman ☃."
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and max(ids) < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_blocks_are_shifted_pairs_covering_the_stream_in_order() -> None:
    ds = TokenBlockDataset(torch.arange(23), seq_len=5)
    assert len(ds) == 4  # (23 - 1) // 5; the tail that cannot fill a block is dropped
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == (5,)
        assert torch.equal(x, torch.arange(5 * i, 5 * i + 5))
        assert torch.equal(y, x + 1)
    assert torch.equal(ds[-1][0], ds[3][0])
    with pytest.raises(IndexError):
        ds[4]


def test_text_file_dataset_is_deterministic(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    a = TokenBlockDataset.from_text_file(path, seq_len=16)
    b = TokenBlockDataset.from_text_file(path, seq_len=16)
    assert len(a) == (len(path.read_bytes()) - 1) // 16
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(len(a)))
    assert ByteTokenizer().decode(a[0][0].tolist()) == "the quick brown "


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p, r"training text file not found: .*missing\.txt"),
        (lambda p: (p.mkdir(), p)[1], r"training text file is a directory"),
        (lambda p: (p.write_bytes(b"ok \xff\xfe bad"), p)[1], r"not UTF-8 text \(byte 3"),
        (lambda p: (p.write_text("short"), p)[1], r"5 tokens is too short for one block of seq_len 16"),
    ],
)
def test_bad_text_file_gives_a_clear_error(tmp_path: Path, setup, message: str) -> None:
    path = setup(tmp_path / "missing.txt")
    with pytest.raises(DataError, match=message):
        TokenBlockDataset.from_text_file(path, seq_len=16)


def test_shipped_corpus_is_small_real_text() -> None:
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    assert 20_000 < len(text.encode()) < 300_000
    ds = TokenBlockDataset.from_text_file(DEFAULT_CORPUS, seq_len=128)
    assert len(ds) > 200  # enough distinct blocks for 2 ranks x 8 sequences x many steps
    # Prose, not noise: mostly letters and spaces, few distinct bytes.
    assert len(set(text)) < 100
    assert sum(c.isalpha() or c == " " for c in text) / len(text) > 0.9


def test_synthetic_dataset_is_seeded_per_sample() -> None:
    ds = SyntheticTokenDataset(vocab_size=50, seq_len=8, num_samples=10, seed=3)
    x, y = ds[7]
    assert x.shape == y.shape == (8,)
    assert int(x.max()) < 50 and int(x.min()) >= 0
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(ds[7][0], SyntheticTokenDataset(50, 8, 10, seed=3)[7][0])
    assert not torch.equal(ds[7][0], ds[6][0])
    assert not torch.equal(ds[7][0], SyntheticTokenDataset(50, 8, 10, seed=4)[7][0])


def test_named_tokenizer_without_transformers_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: its import fails
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(DataError, match="needs the 'transformers' package"):
        load_tokenizer("gpt2")


def test_hf_dataset_without_datasets_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: its import fails
    with pytest.raises(DataError, match=r"--dataset_name 'wikitext' needs the 'datasets' package"):
        TokenBlockDataset.from_hf_dataset("wikitext", "wikitext-2-raw-v1", 128, ByteTokenizer())


# ------------------------------------------------------------------------------------- train_gpt.py


@needs_engine
def test_single_process_training_lowers_the_loss() -> None:
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "40", "--log_interval", "10", "--seq_len", "64"],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _logged_losses(proc.stdout)
    assert len(losses) == 5, proc.stdout  # steps 1, 10, 20, 30, 40
    assert losses[-1] < losses[0] - 1.0, losses
    assert re.search(r"train_gpt: done, 40 steps .* loss [0-9.]+ -> [0-9.]+", proc.stdout)


@needs_engine
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--train_file", "/nonexistent/corpus.txt"],
            "training text file not found: /nonexistent/corpus.txt",
        ),
        (["--model_size", "huge"], "unknown model size 'huge'"),
        (["--n_head", "5"], r"n_embd \(128\) must be divisible by n_head \(5\)"),
        (["--model_name_or_path", "gpt2"], "needs the 'transformers' package"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    env = _env()
    if "gpt2" in args:  # as if transformers were not installed: a package of that name that fails to import
        (tmp_path / "transformers").mkdir()
        (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('not installed')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


@needs_engine
@pytest.mark.parametrize("case", ["config-only folder", "offline hub name"])
def test_a_model_that_cannot_load_is_one_line_saying_what_is_missing(tmp_path: Path, case: str) -> None:
    env = _env()
    if case == "config-only folder":
        folder = tmp_path / "gpt2-config-only"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "gpt2"}')
        name = str(folder)
        message = (
            f"--model_name_or_path {folder}: the folder lacks weights (model.safetensors or "
            "pytorch_model.bin), a tokenizer (tokenizer.json, or vocab.json and merges.txt)"
        )
    else:
        env.update(HF_HUB_OFFLINE="1")
        name = "no-such-org/gpt2-tiny"
        message = (
            f"--model_name_or_path {name!r} is not a local folder, and hub access is off (HF_HUB_OFFLINE=1)"
        )
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "1", "--model_name_or_path", name],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"error: {message}", proc.stderr
    assert len(lines) == 2 and lines[1].startswith("hint: "), proc.stderr
    assert "Traceback" not in proc.stderr and "OSError" not in proc.stderr


@needs_engine
def test_the_logged_loss_is_the_engines_loss_for_the_same_step(tmp_path: Path) -> None:
    """One loss per step: train_gpt's line and the engine's own report give the same number (before, the
    script printed its running mean since the last line next to the engine's loss of that step)."""
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "steps_per_print": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
            }
        )
    )
    args = ["--deepspeed_config", str(config), "--steps", "8", "--log_interval", "4", "--seq_len", "32"]
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *args, "--n_layer", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours = {int(s): float(v) for s, v in re.findall(r"step (\d+)/8 \| loss ([0-9.]+)", proc.stdout)}
    engine = {int(s): float(v) for s, v in re.findall(r"step=(\d+) loss=([0-9.]+)", proc.stdout)}
    assert sorted(engine) == [4, 8] and sorted(ours) == [1, 4, 8], proc.stdout
    for step in (4, 8):
        assert ours[step] == pytest.approx(engine[step], abs=1e-4), proc.stdout


@needs_engine
@needs_launcher
def test_dslaunch_two_cpu_workers_train_with_zero2() -> None:
    """The demo's command: 2 gloo workers under dslaunch, ZeRO-2, the loss falls and both ranks finish."""
    dslaunch = shutil.which("dslaunch", path=str(Path(sys.executable).parent))
    proc = subprocess.run(
        [
            dslaunch,
            "--num_gpus",
            "2",
            "--master_port",  # never the default 29500: another job on this machine may hold it
            str(free_port()),
            str(TRAIN),
            "--deepspeed_config",
            str(ZERO2),
            "--model_size",
            "tiny",
            "--steps",
            "40",
            "--log_interval",
            "10",
            "--seq_len",
            "64",
            "--lr",
            "3e-3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert re.search(r"2 rank\(s\)", output), output
    losses = _logged_losses(output)
    assert len(losses) == 5, output
    assert losses[-1] < losses[0] - 1.0, losses


# ----------------------------------------------------------------------------------------- benchmark


def test_throughput_bench_reports_every_configuration_and_isolates_failures(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    stages = "0,7" if hasattr(runtime, "initialize") else "0"  # 7 is not a ZeRO stage: must fail alone
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--models",
            "tiny",
            "--seq_len",
            "32",
            "--micro_batch",
            "2",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--peers",
            "torch,ours,fsdp2",
            "--stages",
            stages,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        cwd=ROOT,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["event"] == "start"
    by_config = {r["config"]: r for r in records[1:]}
    assert list(by_config) == ["torch", *(f"ours-zero{s}" for s in stages.split(",")), "fsdp2"]
    torch_run, fsdp2 = by_config["torch"], by_config["fsdp2"]
    for run in (torch_run, fsdp2):
        assert run["tokens_per_s"] > 0 and run["tokens_per_step"] == 64
        assert run["tflops"] == pytest.approx(
            torch_run["params"] * 6 * 64 / run["step_s_median"] / 1e12, rel=0.1
        )
    assert torch_run["ratio_to_torch"] == 1.0
    assert fsdp2["ratio_to_torch"] == pytest.approx(
        fsdp2["tokens_per_s"] / torch_run["tokens_per_s"], rel=1e-3
    )
    # Same model, same batch, same first step: every peer starts from the same loss.
    assert fsdp2["loss_first"] == pytest.approx(torch_run["loss_first"], abs=0.02)
    if "ours-zero7" in by_config:
        assert "error" in by_config["ours-zero7"] and by_config["ours-zero7"]["ratio_to_torch"] is None
        assert by_config["ours-zero0"]["loss_first"] == pytest.approx(torch_run["loss_first"], abs=0.05)
        assert proc.returncode == 1
    else:
        assert "runtime.initialize does not exist" in by_config["ours-zero0"]["error"]
    assert "tokens/s" in proc.stderr  # the closing table


def test_throughput_bench_plan_puts_the_baseline_first_and_deepspeed_last() -> None:
    spec = importlib.util.spec_from_file_location("train_throughput", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the file executes
    spec.loader.exec_module(bench)
    runs = bench.plan_runs(["medium", "xl"], ["deepspeed", "ours", "torch", "fsdp2"], [0, 2], [3])
    assert [(r.model, r.label) for r in runs] == [
        ("medium", "torch"),
        ("medium", "ours-zero0"),
        ("medium", "ours-zero2"),
        ("medium", "fsdp2"),
        ("xl", "torch"),
        ("xl", "ours-zero0"),
        ("xl", "ours-zero2"),
        ("xl", "fsdp2"),
        ("medium", "deepspeed-zero3"),
        ("xl", "deepspeed-zero3"),
    ]
