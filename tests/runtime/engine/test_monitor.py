"""Monitors, the memory report and the progress bar, checked against what the engine really returned.

One 2-rank spawn trains a small GPT with fp16, gradient accumulation, wall_clock_breakdown and the CSV
monitor; rank 0 keeps every loss ``engine(...)`` returned and every lr / loss scale / grad norm the engine
reports, and the CSV files must hold exactly those values (one row per step, written by rank 0 only, the
last steps flushed by ``engine.destroy()``). The same spawn checks that an enabled monitor whose package
is missing stops initialize on *every* rank with an error naming the package (tensorboard and wandb are
not installed here; where tensorboard is, its event files are checked instead).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from runtime.memory import format_memory, memory_stats, see_memory_usage
from runtime.models import GPT, GPTConfig
from runtime.monitor import MonitorUnavailable, ProgressBar, format_duration
from tests.support.dist import run_distributed
from tests.support.logs import captured_log

GPT_CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, max_seq_len=16, dropout=0.0)
SEQ = 16
STEPS = 5
ACCUMULATION = 2
MICRO = 2
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
TIMERS = (
    "forward",
    "backward",
    "backward_inner",
    "backward_allreduce",
    "step",
    "optimizer_step",
    "write_back",
)


def _config(out: str, **extra: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUMULATION,
        "steps_per_print": 2,  # also the monitors' flush interval: step 5 is flushed by destroy()
        "wall_clock_breakdown": True,
        "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "run"},
        **extra,
    }


def _train(rank: int, world_size: int, out: str) -> dict:
    with captured_log("runtime") as records:
        torch.manual_seed(0)
        model = GPT(GPT_CONFIG)
        engine, _, _, _ = runtime.initialize(model=model, config=_config(out))
        gen = torch.Generator().manual_seed(rank)
        got: dict[str, list] = {"losses": [], "lr": [], "norm": [], "scale": [], "samples": []}
        for _ in range(STEPS):
            step_losses = []
            for _ in range(ACCUMULATION):
                idx = torch.randint(0, GPT_CONFIG.vocab_size, (MICRO, SEQ), generator=gen)
                _, loss = engine(idx, idx)
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.item())
            got["losses"].append(step_losses)
            got["lr"].append(engine.get_lr()[0])
            got["norm"].append(engine.get_global_grad_norm())
            got["scale"].append(engine.loss_scale)
            got["samples"].append(engine.global_samples)
        got["flops_per_sample"] = engine.monitor.flops_per_sample
        got["rows_before_destroy"] = _rows(Path(out) / "run" / "Train_Samples_train_loss.csv")
        engine.destroy()
    got["log"] = records

    # an enabled monitor without its package fails initialize on every rank, not only on the writer
    got["missing"] = {}
    for section, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if importlib.util.find_spec(package) is not None:
            continue
        extra = {
            section: {"enabled": True, "output_path": out} if section == "tensorboard" else {"enabled": True}
        }
        try:
            runtime.initialize(model=GPT(GPT_CONFIG), config=_config(out, **extra))
        except MonitorUnavailable as error:
            got["missing"][section] = str(error)
    if HAS_TENSORBOARD:
        tb = {"enabled": True, "output_path": out, "job_name": "tb"}
        # the CSV monitor off: its files belong to the run above (a row of this engine's broke them)
        config = _config(out, tensorboard=tb, csv_monitor={"enabled": False})
        engine, _, _, _ = runtime.initialize(model=GPT(GPT_CONFIG), config=config)
        idx = torch.randint(0, GPT_CONFIG.vocab_size, (MICRO, SEQ), generator=gen)
        for _ in range(ACCUMULATION):
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
        engine.destroy()
    return got


def _rows(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("monitor")
    return run_distributed(_train, 2, str(out), timeout=180), out / "run"


def _series(directory: Path, event: str) -> tuple[list[int], list[float]]:
    rows = _rows(directory / (event.replace("/", "_") + ".csv"))
    assert rows, f"no file for {event} in {directory}: {sorted(p.name for p in directory.iterdir())}"
    assert rows[0] == ["step", event.rsplit("/", 1)[-1]]
    return [int(r[0]) for r in rows[1:]], [float(r[1]) for r in rows[1:]]


def test_csv_values_are_the_values_the_engine_returned(world: tuple[list[dict], Path]) -> None:
    results, directory = world
    got = results[0]
    steps, losses = _series(directory, "Train/Samples/train_loss")
    assert steps == got["samples"] == [8 * (i + 1) for i in range(STEPS)]  # one row per step, rank 0 only
    for i, (value, micro) in enumerate(zip(losses, got["losses"], strict=True)):
        # rank 0's mean over the step's micro-steps, in fp32 as the engine computed it
        want = float(torch.tensor(micro, dtype=torch.float32).mean())
        assert value == pytest.approx(want, rel=1e-6), (i, value, micro)
    assert _series(directory, "Train/Samples/lr")[1] == got["lr"]
    assert _series(directory, "Train/Samples/grad_norm")[1] == got["norm"]
    assert _series(directory, "Train/Samples/loss_scale")[1] == got["scale"]
    # only steps up to the last flush were on disk before destroy(); destroy() wrote the rest
    assert len(got["rows_before_destroy"]) - 1 == 4


def test_throughput_timers_and_memory_events(world: tuple[list[dict], Path]) -> None:
    results, directory = world
    got = results[0]
    _, rates = _series(directory, "Train/Samples/samples_per_sec")
    _, tflops = _series(directory, "Train/Samples/tflops_per_gpu")
    assert all(r > 0 for r in rates)
    assert got["flops_per_sample"] == GPT_CONFIG.flops_per_token(SEQ) * SEQ  # from the model, per sample
    for rate, value in zip(rates, tflops, strict=True):
        assert value == pytest.approx(rate * got["flops_per_sample"] / 2 / 1e12, rel=1e-9)  # per GPU
    timings = {name: _series(directory, f"Train/Samples/elapsed_time_ms_{name}")[1] for name in TIMERS}
    for i in range(STEPS):
        assert all(timings[name][i] > 0 for name in TIMERS)
        assert timings["backward"][i] >= timings["backward_inner"][i]
        assert timings["step"][i] >= timings["optimizer_step"][i] + timings["write_back"][i]
    _, rss = _series(directory, "Train/Samples/host_rss_gib")
    assert all(0.05 < value < 64 for value in rss)


def test_periodic_log_has_the_memory_line(world: tuple[list[dict], Path]) -> None:
    results, _ = world
    lines = results[0]["log"]
    assert [line.split()[0] for line in lines] == ["step=2", "step=4"]
    for line in lines:
        assert "| memory host_rss=" in line and "tflops/gpu=" in line, line
    assert results[1]["log"] == []


def test_missing_monitor_package_is_a_clear_error_on_every_rank(world: tuple[list[dict], Path]) -> None:
    results, directory = world
    for rank, got in enumerate(results):
        for section, message in got["missing"].items():
            assert f"{section}.enabled is true" in message and f"pip install {section}" in message, (
                rank,
                message,
            )
    if not HAS_TENSORBOARD:
        assert set(results[0]["missing"]) >= {"tensorboard"}
    else:
        events = list((directory.parent / "tb").glob("events.out.tfevents.*"))
        assert events, "tensorboard wrote no event file"


def test_see_memory_usage(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="runtime"):
        assert see_memory_usage("quiet") is None
        stats = see_memory_usage("after init", force=True)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("after init | ")
    assert stats is not None and stats.host_rss > 10 * 2**20
    if not torch.cuda.is_available():
        assert stats.device is None and "allocated=" not in messages[0]
        assert format_memory(memory_stats("cpu")).startswith("host_rss=")


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_eta_plain_and_terminal() -> None:
    assert [format_duration(s) for s in (0, 75.4, 3725)] == ["0:00", "1:15", "1:02:05"]
    for tty in (False, True):
        clock, stream = _Clock(), _Stream(tty)
        bar = ProgressBar(10, stream=stream, clock=clock, min_interval=0.0)
        bar.update(1, "loss 5.0000")
        assert bar.eta() == "ETA ?"  # the first step includes warm-up: no rate yet
        for step in (2, 3, 4):
            clock.now += 2.0 if step > 2 else 9.0  # a slow step 2, then 2 s per step
            bar.update(step, "loss 4.0000")
        assert bar.rate() == pytest.approx(3 / 13)
        assert bar.eta() == f"ETA {format_duration(6 * 13 / 3)}"
        bar.write("step 4/10 | loss 4.0000")
        bar.close()
        text = stream.getvalue()
        if tty:
            assert "\r\033[K" in text and "step 4/10 [#########" in text and text.endswith("\n")
            assert "\nstep 4/10 | loss 4.0000\n" in text.replace("\r\033[K", "\n")
        else:
            assert text == "step 4/10 | loss 4.0000\n"  # plain log lines only, no bar
    quiet = _Stream(False)
    ProgressBar(3, stream=quiet, enabled=False).write("nothing")
    assert quiet.getvalue() == ""
