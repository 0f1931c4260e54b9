"""Moving bytes between the training device and host memory for the offloaded step.

- `spans.py`: pure index math: which slices of a master shard land, update and go back together.
- `copies.py`: device<->host copies on their own CUDA streams, ordered by tickets (events).
- `landing.py`: `GradLanding`, the host buffers gradients land in and the copy of each span.
- `targets.py`: where the updated weights go on the device, per ZeRO stage, and how they are published.

The pinned-memory allocator these buffers come from is `runtime.host_memory` (a leaf module, since ZeRO
stage 3's parameter offload allocates from it too).
"""
