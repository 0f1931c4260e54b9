"""Launch latency: dslaunch against torchrun, on this machine, in the same run.

For N workers (default 2, 4, 8) and each launcher, several repetitions, interleaved: the clock starts
just before the launcher process is created; each worker's first action writes ``time.time()`` to a
file. Measured per run:

* ``first_line_s``: until the last of the N workers ran its first line (all workers are running);
* ``exit_s``: until the launcher exited after the workers returned (start + teardown).

The default worker imports nothing heavy, so this measures launcher overhead; ``--variant torch`` makes
the worker ``import torch`` first (what a real job pays). Workers run on CPUs (``CUDA_VISIBLE_DEVICES``
is emptied), so the numbers do not depend on the GPU count.

Output: JSON lines on stdout (stamped with the commit, date, machine and command: common.py; ``--out``
appends them to a file too), one per run, then one summary per N with medians and
``ratio = dslaunch / torchrun`` (below 1: dslaunch is faster).

    python scripts/bench/launch.py --reps 7 --sizes 2,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from scripts.bench.common import add_out_argument, emit, free_port, out_file  # noqa: E402

WORKER = """\
import os, time
{imports}t = time.time()
with open(os.path.join(os.environ["BENCH_DIR"], os.environ["RANK"]), "w") as f:
    f.write(repr(t))
"""


def _command(launcher: str, n: int, script: str) -> list[str]:
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            script,
        ]
    return [
        sys.executable,
        "-m",
        "launcher.cli",
        "--num_gpus",
        str(n),
        "--master_port",
        str(free_port()),
        script,
    ]


def measure(launcher: str, n: int, script: str, work: Path) -> dict:
    for f in work.iterdir():
        f.unlink()
    env = {**os.environ, "BENCH_DIR": str(work), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = _command(launcher, n, script)
    start = time.time()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    exit_s = time.time() - start
    stamps = [float(f.read_text()) for f in work.iterdir()]
    if result.returncode != 0 or len(stamps) != n:
        raise RuntimeError(f"{launcher} n={n} failed (rc {result.returncode}): {result.stderr[-2000:]}")
    return {
        "bench": "launch",
        "launcher": launcher,
        "n": n,
        "first_line_s": max(stamps) - start,
        "exit_s": exit_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="2,4,8", help="worker counts, comma separated")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per launcher and size")
    parser.add_argument("--variant", choices=["bare", "torch"], default="bare")
    add_out_argument(parser, "launch-local")
    args = parser.parse_args()
    args.out = out_file(args.out, "launch-local")
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER.format(imports="import torch\n" if args.variant == "torch" else ""))
        work = Path(tmp) / "stamps"
        work.mkdir()
        # one warm-up run each, so that both read their modules from the page cache
        for launcher in ("torchrun", "dslaunch"):
            measure(launcher, sizes[0], str(script), work)
        runs: list[dict] = []
        for n in sizes:
            for rep in range(args.reps):
                order = ("dslaunch", "torchrun") if rep % 2 == 0 else ("torchrun", "dslaunch")
                for launcher in order:
                    run = {**measure(launcher, n, str(script), work), "rep": rep, "variant": args.variant}
                    runs.append(run)
                    emit(run, args.out)
        for n in sizes:
            med = {
                (launcher, key): statistics.median(
                    r[key] for r in runs if r["n"] == n and r["launcher"] == launcher
                )
                for launcher in ("dslaunch", "torchrun")
                for key in ("first_line_s", "exit_s")
            }
            summary = {
                "bench": "launch",
                "summary": True,
                "variant": args.variant,
                "n": n,
                "reps": args.reps,
                "dslaunch_first_line_s": round(med["dslaunch", "first_line_s"], 4),
                "torchrun_first_line_s": round(med["torchrun", "first_line_s"], 4),
                "ratio_first_line": round(
                    med["dslaunch", "first_line_s"] / med["torchrun", "first_line_s"], 3
                ),
                "dslaunch_exit_s": round(med["dslaunch", "exit_s"], 4),
                "torchrun_exit_s": round(med["torchrun", "exit_s"], 4),
                "ratio_exit": round(med["dslaunch", "exit_s"] / med["torchrun", "exit_s"], 3),
            }
            emit(summary, args.out)


if __name__ == "__main__":
    main()
