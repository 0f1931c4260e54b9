#!/usr/bin/env bash
# The next GPU session's queue (scripts/bench/README.md, "The queue"), one device command per call:
#   bash scripts/bench/queue.sh N        (N = 1, 2, 3 or 4; each stays under the 600 s a command may run)
# run from the repository root on the device machine, with $OUT set (the device tool sets it) and
# .devrun/commit holding the commit under test. Results land in $OUT; copy them to scripts/bench/results/
# under <yyyymmdd>_<card>_<what>.jsonl and cite them in BENCHMARKS.md with the command below.
set -o pipefail
export PYTHONPATH=$PWD:$PWD/compat PYTHONUNBUFFERED=1
export DSLAUNCH_BENCH_COMMIT=$(cat .devrun/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null)
: "${OUT:?set OUT to the folder the results go to}"
long() {  # long SECONDS ARGS...: long_context.py under a wall-clock limit, its JSON lines cut short
    local limit=$1; shift
    timeout "$limit" python3 scripts/bench/long_context.py "$@" 2>&1 | grep '^{' | cut -c1-1500
}
lean8b=(--model 8b --gpu_gib 72 --no_offload --bf16_master_weights --bf16_optimizer_states --lean_norms)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:?which call: 1-4}" in
1)  # the gpu tests of what changed since the last device run, beside the 1B lean-norm walk (the norm's
    # forward is tiled since 342,016 trained under the 32 GiB cap; the walk now tries --max itself)
    # (the fused step's CUDA case: it now takes the moments made at setup)
    (timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/sequence/test_lean_norm.py \
        tests/runtime/engine/test_cpu_checkpointing.py tests/runtime/engine/test_setup_oom.py \
        tests/runtime/engine/test_oom.py tests/runtime/precision/test_fused_master.py \
        > "$OUT/gpu-tests.log" 2>&1; echo "rc=$?" >> "$OUT/gpu-tests.log") &
    long 560 --model 1b --gpu_gib 32 --lean_norms --start 376832 --growth 1.12 --max 471040 \
        --resolution 0.08 --steps 1 --timeout 260 --out "$OUT/long-1b-lean.jsonl"
    wait; tail -3 "$OUT/gpu-tests.log" ;;
2)  # the 8B with 16-bit state on the GPU: which phase peaks at 81,920 (bf16 masters make their moments at
    # setup now, so one step is the steady one), then the next length up
    long 280 "${lean8b[@]}" --start 81920 --max 81920 --steps 1 --memory_trace --timeout 270 \
        --out "$OUT/long-8b-lean-bf16-trace.jsonl"
    python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/long-8b-lean-bf16-trace.jsonl"):
    trace = json.loads(line).get("memory_trace")
    if trace:
        print("during", trace["peak_during"][:4])
        for row in trace["by_site"][:14]:
            print("  ", row)
PY
    long $((585 - SECONDS)) "${lean8b[@]}" --start 98304 --max 98304 --steps 2 --timeout 280 \
        --out "$OUT/long-8b-lean-bf16.jsonl" ;;
3)  # the same setting walked up from there (each length builds the 8B: about 2.5 minutes a try)
    long 575 "${lean8b[@]}" --start 114688 --growth 1.2 --max 163840 --resolution 0.1 --steps 2 \
        --timeout 280 --out "$OUT/long-8b-lean-bf16-up.jsonl" ;;
4)  # issue 32: ZeRO-3 offload_param at micro-batch 8 at its largest size, the link measured beside it
    timeout 580 python3 scripts/bench/offload.py --gpt 7168:56:28 --configs pcie,ours-z3-param --stage 3 \
        --offload_param --bf16_states --ratio auto --activation_checkpointing --micro_batch 8 \
        --accumulation 8 --warmup 1 --steps 2 --timeout 540 --out "$OUT/z3-param-micro8.jsonl" 2>&1 | tail -30 ;;
*)  echo "no call $1: 1-4" >&2; exit 2 ;;
esac
echo "call $1 ended at ${SECONDS}s"
