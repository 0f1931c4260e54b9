"""``deepspeed.runtime.fp16.onebit.adam``: 1-bit Adam (raises when built)."""

from runtime.deepspeed_api.unsupported import unsupported_class

OnebitAdam = unsupported_class(
    "OnebitAdam",
    "1-bit Adam (compressed-communication optimizer)",
    "use Adam/AdamW (the config's optimizer section)",
)

__all__ = ["OnebitAdam"]
