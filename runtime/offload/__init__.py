"""CPU offload: where the optimizer's master weights and state live, as plan, then execute.

The front door. `build_master_placement` is the only place that builds a placement, and this module the
only one that names `HostMasters`; engines import only from here: `with_auto_ratio` (the config with
`"ratio": "auto"` resolved, before the ZeRO stage is built), the factory and the `MasterPlacement`
protocol. The step's gradient arithmetic that every placement takes (`GradMath`) is
runtime/precision/grad_math.py's. For `offload_optimizer: {device: cpu}` it runs, once per engine:

    settings = config's OffloadSettings                    # runtime/config/offload.py: read once
    facts    = read_facts(...)                             # machine.py: this rank and its machine
    plan     = agree(plan_offload(settings, facts), ...)   # plan.py (pure), then the ranks' vote
    HostMasters(..., plan=plan, settings=settings)         # host_masters.py: executes the plan

With `offload_optimizer.ratio` below 1 the ZeRO stage has already split its groups between the host and
the device (its `offload_split`, runtime/zero/offload_split.py); the same steps build a `HostMasters`
over the host's groups, and `PartialMasters` (partial.py) adds the device's groups and one norm for both.

Parts, and which way imports point (each only to parts listed after it, and to runtime.zero, which
never imports back; tests/runtime/offload/test_imports.py checks it):

- `__init__.py` (this): the factory and `enable_delayed_update`.
- `auto_ratio.py`: `"ratio": "auto"` chosen from the model's sizes and the machine's memory, and the fit
  check of a set ratio (`with_auto_ratio`, exported here).
- `partial.py`: `PartialMasters`, a ratio below 1: the host's groups through `HostMasters`, the device's
  updated in place, one gradient norm for both.
- `host_masters.py`: `HostMasters`, the offloaded step's wiring and order.
- `step/`: who updates a span (the CPU, the GPU over streamed state, or both; streamed during backward;
  delayed on a worker thread).
- `machine.py`: the facts the plan is made from, and the agreement across ranks.
- `plan.py`: pure decisions (what lands, where Adam runs, the CPU's share, streaming, spans).
- `io/`: moving bytes: spans, copies, gradient landing, the working-weight targets and their publishing.
- `placement.py`: the `MasterPlacement` protocol, `DeviceMasters`, `attach_master_grads`.

The settings are the config's (`runtime.config.OffloadSettings`, runtime/config/offload.py): the typed
`offload_optimizer` section with the benchmark overrides applied where the config was read, so nothing
here reads the environment.

Glossary:

- *span*: this rank's piece of one ZeRO bucket; the unit that lands on the host, updates and goes back.
- *chunk*: a slice of a span, the unit of one copy or one kernel call (copy of chunk i overlaps chunk i+1).
- *landing*: gradients arriving in host buffers, span by span (in fp32 or their own dtype).
- *head / tail*: with the device step sharing work, the part of a span the GPU updates / the CPU updates.
- *ticket*: the CUDA event after a queued copy or kernel (None on a CPU-only machine: it already ran).
- *publish*: make a span's updated weights visible to the model (all-gather its bucket, or re-gather a
  stage-3 unit).
- *streamed step*: the update running span by span while backward still produces gradients.
- *delayed update* (DPU): step k's host update runs during step k+1's forward and backward.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from runtime.comm import Comm
from runtime.config import Config
from runtime.config.offload import OffloadSettings
from runtime.offload.auto_ratio import with_auto_ratio
from runtime.offload.host_masters import HostMasters
from runtime.offload.io.targets import working_target
from runtime.offload.machine import agree, read_facts
from runtime.offload.partial import PartialMasters, host_view, log_split
from runtime.offload.placement import DeviceMasters, MasterPlacement, attach_master_grads
from runtime.offload.plan import plan_offload
from runtime.zero import StageGroups, ZeroStage
from runtime.zero.flat import FlatGroup

__all__ = [
    "DeviceMasters",
    "MasterPlacement",
    "attach_master_grads",
    "build_master_placement",
    "enable_delayed_update",
    "with_auto_ratio",
]

_log = logging.getLogger("runtime.offload")


def build_master_placement(
    config: Config,
    groups: Sequence[FlatGroup],
    zero: ZeroStage,
    comm: Comm,
    device: torch.device,
    *,
    registration: dict[nn.Parameter, int],
    trains: bool = True,
) -> MasterPlacement:
    """The placement `config.zero_optimization.offload_optimizer` asks for. Call it after the ZeRO stage
    is built and before the optimizer is (offload moves the master shards the optimizer will hold).
    `trains=False` (an engine without an optimizer, whose masters are its working weights): nothing to
    move, whatever the section says (TRL copies the trainer's into its reference model's config).

    One branch per placement: every master on the device, every master on the host, or (a ratio below 1,
    `zero.offload_split`) the host's groups on the host and the rest on the device."""
    offload: OffloadSettings = config.zero_optimization.offload_optimizer
    if offload.device == "none" or not trains:
        return DeviceMasters(groups, zero)
    split = zero.offload_split
    if split is None:  # the ratio is 1: everything goes to the host
        return _host_masters(offload, groups, zero, comm, device, registration=registration)
    log_split(split, groups, comm)
    if not split.host:  # ratio 0 (or too small for one parameter): nothing to offload
        return DeviceMasters(groups, zero)
    if not split.device:  # the host took every group
        return _host_masters(offload, groups, zero, comm, device, registration=registration)
    view = host_view(zero, split)
    host = _host_masters(offload, view.groups, view, comm, device, registration=registration)
    return PartialMasters(groups, zero, device, split=split, host=host)


def _host_masters(
    offload: OffloadSettings,
    groups: Sequence[FlatGroup],
    zero: StageGroups,
    comm: Comm,
    device: torch.device,
    *,
    registration: dict[nn.Parameter, int],
) -> HostMasters:
    """Every master shard and its optimizer state in host memory: settings, facts, plan, agreement, run."""
    settings = offload  # benchmark overrides already applied where the config was read
    if comm.rank == 0:
        for note in settings.overrides:
            _log.warning("offload: %s", note)
    target = working_target(zero, comm)
    facts = read_facts(groups, zero, comm, device, registration=registration, target=target)
    plan = agree(plan_offload(settings, facts), facts.grad_dtype, comm, device)
    if comm.rank == 0:
        for warning in plan.warnings:
            _log.warning(warning)
    return HostMasters(groups, zero, comm, device, plan=plan, settings=settings, target=target)


def enable_delayed_update(engine: Any, *, after_steps: int = 40) -> None:
    """Turn on the delayed parameter update of optimizer offload for `engine` (ZeRO-Offload's DPU).

    After `after_steps` ordinary steps (ZeRO-Offload used about 40, so the fast-changing first steps are
    exact), each step starts its host update in the background and the next step installs it: every
    gradient is then computed on weights one update older than without DPU. A step then costs about
    max(device forward + backward, host update) instead of their sum. Needs
    `offload_optimizer: {device: cpu}` and an Adam/AdamW optimizer, over fp32 masters or bf16 ones
    (`bf16.bf16_master_weights_and_grads`, whose own step then runs on the worker); others keep stepping
    in place, and the first step says so.
    Checkpoints and `engine.full_state_dict()` flush the update in flight first.
    """
    placement = getattr(engine, "masters", None)
    delay = getattr(placement, "delay_updates", None)
    if delay is None:
        raise ValueError(
            "the delayed parameter update needs optimizer offload: set "
            'zero_optimization.offload_optimizer = {"device": "cpu"} in the config'
        )
    delay(after_steps)
