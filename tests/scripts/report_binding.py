"""Writes this worker's CPU affinity, OMP_NUM_THREADS, and the DeepSpeed pid file of its launcher (if
any) to OUT_DIR/rank_<RANK>.json; prints a line for the per-rank log."""

import json
import os
import sys

import psutil

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank=")]  # the launcher adds it
out_dir = args[0]
launchers = [p.pid for p in psutil.Process().parents()]
pid_files = [pid for pid in launchers if os.path.exists(f"/tmp/{pid}.deepspeed")]
rank = os.environ["RANK"]
with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
    json.dump(
        {
            "cores": sorted(os.sched_getaffinity(0)),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "pid_file_of": pid_files,
            "argv": sys.argv[1:],
        },
        f,
    )
print(f"rank {rank} bound to {sorted(os.sched_getaffinity(0))}", flush=True)
