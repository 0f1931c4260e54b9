"""Where the offloaded host step runs: on the calling thread, or on a second thread with an OpenMP pool of
its own.

Times our host Adam step (runtime.offload.step.host_adam.HostAdam, bf16 gradient in, bf16 weights out, in the
engine's 8M-element chunks) on --params parameters, first on the calling thread (the baseline: its
OpenMP pool is the process's only one), then on a fresh second thread, whose pool comes on top of the
caller's. The gap is why the streamed step (runtime/offload/step/streamed.py) runs autograd on a helper
thread and the update on the caller, and why the delayed update's worker (runtime/offload/step/worker.py)
shrinks the caller's team first; the last rows measure that shrinking.

    python scripts/bench/host_threads.py                       # 400M parameters, all cores
    python scripts/bench/host_threads.py --params 20e6         # a quick check on a small machine

Output: one JSON line per placement, {"bench": "host_threads", ...} with the best of --reps steps and
the ratio to the caller-thread baseline of the same run, stamped with the commit, date, machine and
command (common.py); --out appends them to a file too (a bare --out:
results/<yyyymmdd>_<hw>_host-threads.jsonl).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from runtime.config.offload import TRANSFER_CHUNK_ELEMS
from runtime.offload.io.spans import plan_chunks
from runtime.offload.step.host_adam import HostAdam
from runtime.ops.adam import CPUAdam
from scripts.bench.common import add_out_argument, emit, out_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=400e6)
    parser.add_argument("--reps", type=int, default=3)
    add_out_argument(parser, "host-threads")
    args = parser.parse_args(argv)
    args.out = out_file(args.out, "host-threads")
    n = int(args.params)
    cores = torch.get_num_threads()
    fewer, rest = max(1, cores - 1), max(1, cores - 2)  # the second thread's teams below
    master = torch.nn.Parameter(torch.empty(n).normal_(0, 0.02))
    host = HostAdam(CPUAdam([master], lr=1e-4, weight_decay=0.01), [master])
    landing = torch.empty(n, dtype=torch.bfloat16).normal_(0, 1e-3)
    chunks = plan_chunks(n, TRANSFER_CHUNK_ELEMS)

    def one_step() -> float:
        host.begin_step()
        start = time.perf_counter()
        for offset, numel in chunks:
            grad = landing.narrow(0, offset, numel)
            host.update(0, offset, grad, grad, None)  # bf16 weights over the consumed gradient, as the engine
        return time.perf_counter() - start

    def timed(threads: int) -> float:
        torch.set_num_threads(threads)
        one_step()  # the pool's threads start here
        return min(one_step() for _ in range(args.reps))

    def on_second_thread(threads: int) -> float:
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(timed, threads).result()

    rows: list[tuple[str, int, float]] = [("caller", cores, timed(cores))]
    rows.append(("caller", fewer, timed(fewer)))
    torch.set_num_threads(cores)
    rows.append(("second_thread", cores, on_second_thread(cores)))
    rows.append(("second_thread", fewer, on_second_thread(fewer)))
    # the delayed update's remedy: a 2-thread region on the caller releases the rest of its pool
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)
    rows.append(("second_thread_after_caller_shrank_to_2", rest, on_second_thread(rest)))
    rows.append(("caller", rest, timed(rest)))
    torch.set_num_threads(cores)
    base = rows[0][2]
    for placement, threads, seconds in rows:
        record = {
            "bench": "host_threads",
            "params": n,
            "placement": placement,
            "threads": threads,
            "step_s": round(seconds, 4),
            "vs_caller_all_cores": round(seconds / base, 3),
        }
        emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
