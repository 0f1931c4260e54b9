"""Who updates a span of the offloaded step, and on which thread.

- `host_step.py`: the CPU's update of spans whose gradients landed on the host (one-pass Adam, or any
  optimizer's generic path), each chunk's copy back overlapping the next chunk's update.
- `device_step.py`: the GPU's Adam update over state streamed from host memory through staging slots.
- `split_update.py`: each span's head for the GPU, its tail for the CPU, and the tickets of both.
- `host_adam.py`: the one-pass Adam/AdamW kernel driver on landed gradients.
- `streamed.py`: the update running span by span while backward still runs.
- `delayed.py`, `worker.py`: the opt-in delayed parameter update and its thread.

Nothing here decides where a span is updated (runtime/offload/plan.py does) or moves gradients to the
host (runtime/offload/io/).
"""
