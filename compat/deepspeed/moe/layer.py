"""``deepspeed.moe.layer``: not available (building ``MoE`` raises)."""

from runtime.deepspeed_api.unsupported import unsupported_class

MoE = unsupported_class(
    "MoE",
    "Mixture-of-Experts layers (deepspeed.moe.layer.MoE)",
    "train a dense model (a feed-forward block per layer)",
)

__all__ = ["MoE"]
