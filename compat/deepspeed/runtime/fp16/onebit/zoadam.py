"""``deepspeed.runtime.fp16.onebit.zoadam``: 0/1 Adam (raises when built)."""

from runtime.deepspeed_api.unsupported import unsupported_class

ZeroOneAdam = unsupported_class(
    "ZeroOneAdam",
    "0/1 Adam (compressed-communication optimizer)",
    "use Adam/AdamW (the config's optimizer section)",
)

__all__ = ["ZeroOneAdam"]
