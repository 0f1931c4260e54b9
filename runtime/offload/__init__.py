"""CPU offload: where the optimizer's master weights and state live, and moving data to and from there.

- `placement.py`: the `MasterPlacement` the engine composes (`DeviceMasters`, or `HostMasters` for
  `offload_optimizer: {device: cpu}`), and `build_master_placement`.
- `host_masters.py`: optimizer offload: masters and state in host memory, the step on the CPU (chunked
  copy-back) or on the GPU (`device_step.py`).
- `partial.py`, `ratio.py`: `offload_optimizer.ratio` below 1: whole groups on the host (`HostMasters`)
  and on the device, one norm for both (`PartialMasters`); which parameters go where (pure).
- `split_update.py`: each span's head for the GPU, its tail for the CPU, and the tickets of both.
- `host_step.py`: the CPU's update of landed spans (one-pass Adam, or any optimizer's generic path).
- `device_step.py`: the Adam step on the GPU over state streamed from host memory.
- `settings.py`: `OffloadSettings`, the `offload_optimizer` section (and its benchmark overrides).
- `update_site.py`: where the step runs, and the CPU's share of it (`update`, `host_share`).
- `landing.py`: gradients landing on the host bucket by bucket (during backward with one rank).
- `streamed.py`: the streamed step (the update runs while backward does, when nothing waits on the norm).
- `delayed.py`, `worker.py`: the opt-in delayed parameter update and its thread.
- `host_adam.py`: the one-pass Adam/AdamW step on landed gradients (runtime.ops.adam_step underneath).
- `copies.py`: device<->host copies on their own CUDA streams (plain copies on CPU-only machines).
- `host_memory.py`: host buffers, pinned where a copy engine touches them.
- `spans.py`: pure index math (which shard slices land, step and go back together).
"""

from runtime.offload.placement import (
    DeviceMasters,
    GradMath,
    MasterPlacement,
    attach_master_grads,
    build_master_placement,
    enable_delayed_update,
)

__all__ = [
    "DeviceMasters",
    "GradMath",
    "MasterPlacement",
    "attach_master_grads",
    "build_master_placement",
    "enable_delayed_update",
]
