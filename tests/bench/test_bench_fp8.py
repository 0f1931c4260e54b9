"""The fp8 benchmark (scripts/bench/fp8.py) on the CPU: its --tiny loss mode trains bf16 and each fp8
setting (here one naming its recipe) from the same initial weights on the same corpus batches, one JSON row
each, and ends with every fp8 setting's loss against bf16's. Device: CPU (torchao's float8 casts, eager
backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytest.importorskip("torchao.float8")


def test_tiny_loss_rows_name_their_recipe_and_compare_to_bf16() -> None:
    script = str(REPO / "scripts" / "bench" / "fp8.py")
    command = [sys.executable, script, "--tiny", "--loss_steps", "4", "--lr_warmup", "1",
               "--settings", "bf16,fp8@rowwise_with_gw_hp"]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"')]
    assert [(r["setting"], r["recipe"]) for r in rows] == [
        ("bf16", None),
        ("fp8@rowwise_with_gw_hp", "rowwise_with_gw_hp"),
    ]
    bf16 = rows[0]["last50_mean"]
    for row in rows:
        assert row["loss_steps"] == 4 and row["wall_s"] > 0
        assert abs(row["last50_mean"] - bf16) < 0.05 * bf16, row  # the same weights and batches, 4 steps
    # the closing line: each fp8 setting's loss over bf16's
    assert "fp8@rowwise_with_gw_hp loss / bf16's over seeds 0:" in done.stderr


def test_a_setting_with_an_unknown_recipe_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts.bench import fp8

    with pytest.raises(SystemExit) as exit_info:  # argparse's error: before anything is built
        fp8.main(["--tiny", "--settings", "bf16,fp8@blockwise"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "got bf16,fp8@blockwise" in err and "rowwise_with_gw_hp" in err
