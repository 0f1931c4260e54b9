"""Launcher test worker: joins a gloo group from the environment, all-reduces its rank, prints JSON."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
        "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
        "DSLAUNCH_ATTEMPT", "DSLAUNCH_JOB_ID", "NCCL_NVLS_ENABLE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
        "DSL_TEST_VAR"]  # fmt: skip
report = {"sum": t.item(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}
print("REPORT " + json.dumps(report), flush=True)
dist.destroy_process_group()
