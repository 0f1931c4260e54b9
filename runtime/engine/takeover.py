"""What an engine does once another engine took its model over (runtime.zero.takeover): its stage refuses
its backward and step from then on, so what only those read is freed here.
"""

from __future__ import annotations

from typing import Any

from runtime.offload.placement import DeviceMasters


def release_training_state(engine: Any) -> None:
    """Free what only the backward and step of `engine`, whose model another engine took over, would read:
    its optimizer's state, the masters it steps and the offload's host buffers (a placement that holds
    nothing replaces its own). TRL wraps a policy in one engine and the Trainer builds another over it:
    two copies of the optimizer state would not fit where one barely does. Its forward still runs; a
    checkpoint of it is refused (`Engine._check_trains`)."""
    engine.masters.close()
    engine.masters = DeviceMasters([], engine.zero)  # flush, close and the byte counts: nothing
    if engine.optimizer is None:
        return
    engine.optimizer.state.clear()
    weights = {id(p) for p in engine.module.parameters()}
    for group in engine.optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in weights:  # the masters (never a weight the new engine holds now)
                param.data = param.data.new_empty(0)
