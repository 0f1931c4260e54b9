"""Launcher test worker: joins a gloo group through runtime.init_distributed, gathers one object and exits
at once, holding the GIL from then on: the exit races gloo's worker thread for the collective's tensors."""

import sys

import torch.distributed as dist

from runtime.distributed import init_distributed

init_distributed()
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"rank": dist.get_rank()})
assert out == [{"rank": r} for r in range(dist.get_world_size())], out
sys.setswitchinterval(100)  # no switch to another thread before the interpreter shuts down
