"""Example models for training jobs, tests and benchmarks (not part of the runtime's engine)."""

from runtime.models.gpt import GPT, MODEL_SIZES, GPTConfig, GPTOutput

__all__ = ["GPT", "MODEL_SIZES", "GPTConfig", "GPTOutput"]
