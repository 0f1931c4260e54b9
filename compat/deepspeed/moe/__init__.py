"""``deepspeed.moe``: Mixture-of-Experts. dslaunch has no MoE layers; ``moe.utils``' optimizer helper
works for dense models (there is nothing to split), the layer classes raise when built."""

from deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
