#!/usr/bin/env bash
# The demo: dslaunch starts a real 2-process data-parallel training job with ZeRO stage 2.
#
# Each worker is a separate Python process running scripts/train_gpt.py; they find each other through
# the environment dslaunch sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and train a tiny GPT
# (0.86M parameters) on the text in scripts/data/corpus.txt, each on its half of every batch, with the
# optimizer state and gradients sharded between them. On a machine without GPUs the two workers are CPU
# processes talking over gloo (well under a minute on 2 cores); with GPUs each worker takes one (bf16).
#
# Usage: bash scripts/demo.sh [extra train_gpt.py arguments, e.g. --steps 200]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""  # an explicit (empty) argument: do not hand it our "$@"

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -gt 0 ]; then
    workers=$(( gpus < 2 ? gpus : 2 ))
    config=scripts/configs/bf16.json
    where="$workers GPU worker(s), bf16, ZeRO-2"
else
    workers=2
    config=scripts/configs/zero2.json
    where="2 CPU worker processes (gloo), fp32, ZeRO-2"
fi
# A free port, so the demo never collides with another job on the default 29500: the launcher's own
# choice, below the kernel's ephemeral range where no outgoing connection can take it before the bind.
port=$("$PYTHON" -c "from launcher.machine import find_free_port; print(find_free_port())")

echo "demo: training a tiny GPT on scripts/data/corpus.txt with $where"
echo "demo: dslaunch --num_gpus $workers scripts/train_gpt.py --deepspeed_config $config --model_size tiny"
log=$(mktemp "${TMPDIR:-/tmp}/dslaunch-demo.XXXXXX")
trap 'rm -f "$log"' EXIT
start=$(date +%s)
set +e
dslaunch --num_gpus "$workers" --master_port "$port" scripts/train_gpt.py \
    --deepspeed_config "$config" --model_size tiny --seq_len 128 --steps 60 --log_interval 10 "$@" \
    2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
elapsed=$(( $(date +%s) - start ))
if [ "$status" -ne 0 ]; then
    echo "demo: FAILED: dslaunch exited with $status after ${elapsed}s (see the output above)" >&2
    exit "$status"
fi

losses=$(sed -n 's/.*| loss \([0-9.]*\) |.*/\1/p' "$log")
first=$(echo "$losses" | head -n 1)
last=$(echo "$losses" | tail -n 1)
echo
if [ "$workers" -gt 1 ]; then
    echo "demo: done in ${elapsed}s. $workers processes trained one model together (ZeRO-2: each kept 1/$workers of"
    echo "demo: the optimizer state and gradients); the loss, averaged over all, went from $first to $last"
else
    echo "demo: done in ${elapsed}s. One process trained the model (ZeRO-2 shards nothing with one rank);"
    echo "demo: the loss went from $first to $last"
fi
echo "demo: (a uniform guess over 256 byte values scores 5.55). Run the tests: bash scripts/test.sh"
