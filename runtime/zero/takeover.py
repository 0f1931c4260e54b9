"""Two engines over one model: what the engine that was taken over says when it is used again.

TRL's DPO with precomputed reference log-probs wraps the policy in an engine, then the Trainer builds a
second engine over the same model; the second one takes the model over (runtime.zero.build_zero_stage:
weights gathered from the first one's stage-3 units, its module and gradient hooks removed, its stale
copies freed), so it trains exactly as if built on a fresh model. The first engine's forward still runs
the model as the new engine holds it; a backward or step of it would update weights the model no longer
reads, so it raises `ModelTakenOver`, naming both engines' stages; what only those read, its optimizer
state and masters, is freed then (runtime/engine/takeover.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import UserError


class ModelTakenOver(UserError, RuntimeError):
    """A backward or step of an engine whose model another engine, built later, took over."""


@dataclass(frozen=True)
class TakeOver:
    """Who took a model over from whom: the ZeRO stages of the old and the new engine."""

    old_stage: int
    new_stage: int

    def error(self, what: str) -> ModelTakenOver:
        return ModelTakenOver(
            f"{what} of a ZeRO-{self.old_stage} engine whose model a ZeRO-{self.new_stage} engine built "
            "later over the same model took over (its gradient hooks and weight copies are gone)",
            hint="build one engine per model; keep using the newest engine (its forward, backward and step)",
        )
