"""scripts/bench/states_loss.py on the CPU (--tiny): the three settings start from the same weights and
batches, so from the same loss, and each JSON line says which 16-bit state keys the engine ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO


def test_states_loss_runs_three_settings_from_the_same_start() -> None:
    cmd = [sys.executable, "scripts/bench/states_loss.py", "--tiny", "--steps", "3"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [
        json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench": "states_loss"')
    ]
    rows = {r["setting"]: r for r in lines}
    assert list(rows) == ["start", "fp32_states", "bf16_states", "bf16_states_nosr", "summary"]
    settings = ("fp32_states", "bf16_states", "bf16_states_nosr")
    flags = {
        s: (rows[s]["bf16_masters"], rows[s]["bf16_states"], rows[s]["stochastic_rounding"]) for s in settings
    }
    assert flags["fp32_states"] == (False, False, False)
    assert flags["bf16_states"] == (True, True, True)
    assert flags["bf16_states_nosr"] == (True, True, False)
    firsts = {rows[s]["loss_first"] for s in settings}
    assert len(firsts) == 1, firsts  # the same initial weights and first batch
    for setting in settings:
        row = rows[setting]
        assert (row["zero_stage"], row["steps"], row["model"], row["optimizer"]) == (2, 3, "tiny", "AdamW")
        assert row["losses_every_25"] == {"0": row["loss_first"], "2": row["final_loss"]}
        assert row["last50_mean"] > 0 and row["provenance"]["command"]
    assert rows["fp32_states"]["rel_to_fp32_states"] == 0.0
    summary = rows["summary"]
    assert summary["baseline"] == "fp32_states" and summary["goal"] == 0.01
    assert summary["bf16_states_rel_to_fp32_states"] == rows["bf16_states"]["rel_to_fp32_states"]
    assert "fp32_states step 0: loss" in done.stderr  # the printed curve


def test_the_stdlib_corpus_is_python_source_in_path_order() -> None:
    """common.stdlib_corpus, shared by fp8.py and states_loss.py: exactly the bytes asked for, the same
    each time (the settings must see the same batches), and Python source."""
    from scripts.bench.common import stdlib_corpus

    corpus = stdlib_corpus(20_000)
    assert len(corpus) == 20_000 and corpus == stdlib_corpus(20_000)
    assert b"def " in corpus or b"import " in corpus
