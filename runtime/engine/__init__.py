"""The training engine and its parts (`runtime.engine.Engine`, DeepSpeed's `DeepSpeedEngine`).

- `engine`: `Engine`, which composes ZeRO, precision, offload and the parallel plan into forward,
  backward and step;
- `accessors`: DeepSpeed's read-only engine methods (a mixin), and `engine.compile()`;
- `inference`: what an engine built without an optimizer does (DeepSpeed's inference-only engines);
- `log`: the step log and the wall-clock timers;
- `memory`: `MemoryBreakdown`, the bytes of model state a rank holds.

The pipeline engine (`runtime.pipe.engine`) builds on `Engine` and keeps only its schedules.
"""

from runtime.engine.engine import Engine
from runtime.engine.memory import MemoryBreakdown

__all__ = ["Engine", "MemoryBreakdown"]
