"""``deepspeed.runtime.fp16.onebit.lamb``: 1-bit LAMB (raises when built)."""

from runtime.deepspeed_api.unsupported import unsupported_class

OnebitLamb = unsupported_class(
    "OnebitLamb",
    "1-bit LAMB (compressed-communication optimizer)",
    "use Adam/AdamW (the config's optimizer section)",
)

__all__ = ["OnebitLamb"]
