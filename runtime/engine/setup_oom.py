"""Building the engine out of GPU memory, said with the configurations that would fit.

Building an engine moves the model to the device and makes its flat weights, gradient buffers and masters:
a model too large for the card fails there, in torch's words about one allocation deep inside the ZeRO
stage. `explained_setup_oom` (around the engine's construction in `runtime.initialize`) re-raises such an
error as a `DeviceMemoryError` (runtime/engine/oom.py: one line and the hint under dslaunch, exit code 2,
and still torch's `OutOfMemoryError`):

- the message: the stage and ranks, and the model states the estimator (runtime.estimator) puts on each
  GPU for this configuration, against the card's capacity;
- the hint: the changes of the config whose model states fit the card (with room left for activations,
  `ACTIVATION_SHARE`) and the host's available memory by the same estimate, cheapest first: 16-bit
  masters and moments, optimizer offload (with 16-bit state too), a higher stage over several ranks,
  parameter offload; each with its GPU and host bytes. Where none fits whole, the one that needs the
  least GPU, and that `"ratio": "auto"` splits the optimizer state between card and host (issue 32's
  25B on one H200 trains that way).

`describe_setup` is the pure part, from `SetupFacts`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.engine.oom import DeviceMemoryError
from runtime.estimator.model_states import Estimate, ModelSizes, estimate, model_sizes

if TYPE_CHECKING:
    from runtime.config import Config

__all__ = ["SetupFacts", "describe_setup", "explained_setup_oom"]

GIB = 1 << 30
ACTIVATION_SHARE = 0.15  # of the card, left to activations when a configuration is said to fit


@dataclass(frozen=True)
class SetupFacts:
    """The configuration being built, in the estimator's terms, and the card (None: not a CUDA device)."""

    sizes: ModelSizes
    world_size: int  # the data-parallel ranks ZeRO shards over
    stage: int
    offload_optimizer: bool
    offload_param: bool
    dtype: str  # "bf16", "fp16" or "fp32"
    master_dtype: str
    state_dtype: str
    optimizer: str  # the estimator's name (runtime.offload.auto_ratio.estimator_optimizer)
    capacity: int | None
    host: int | None = None  # host memory available to this node's ranks (None: not known)


def _estimate(facts: SetupFacts) -> Estimate:
    return estimate(
        facts.sizes,
        stage=facts.stage,
        num_gpus_per_node=facts.world_size,
        offload_optimizer=facts.offload_optimizer,
        offload_param=facts.offload_param,
        dtype=facts.dtype,
        optimizer=facts.optimizer,
        master_dtype=facts.master_dtype,
        state_dtype=facts.state_dtype,
    )


def _changes(facts: SetupFacts) -> list[tuple[str, SetupFacts]]:
    """The configurations to offer, cheapest change first, each with the words that ask for it."""
    out: list[tuple[str, SetupFacts]] = []
    stage = max(facts.stage, 1)
    at_stage = f"zero_optimization.stage {stage} with " if stage != facts.stage else ""
    sixteen = facts.dtype == "bf16" and facts.state_dtype != "bf16"
    states = "bf16.bf16_master_weights_and_grads and bf16.bf16_optimizer_states"
    offload = 'zero_optimization.offload_optimizer {"device": "cpu"}'
    if sixteen and not facts.offload_optimizer:
        out.append(
            (f"{at_stage}{states}", replace(facts, stage=stage, master_dtype="bf16", state_dtype="bf16"))
        )
    if not facts.offload_optimizer:
        out.append((f"{at_stage}{offload}", replace(facts, stage=stage, offload_optimizer=True)))
    if sixteen:
        both = replace(facts, stage=stage, offload_optimizer=True, master_dtype="bf16", state_dtype="bf16")
        out.append((f"{at_stage}{offload} and {states}", both))
    if facts.world_size > 1 and facts.stage < 3:
        out.append(("zero_optimization.stage 3", replace(facts, stage=3)))
    if not facts.offload_param:
        words = (
            f"zero_optimization.stage 3 with offload_param and {offload.removeprefix('zero_optimization.')}"
        )
        out.append((words, replace(facts, stage=3, offload_optimizer=True, offload_param=True)))
    return out


def describe_setup(facts: SetupFacts) -> tuple[str, str]:
    """(message, hint) for a configuration whose engine ran out of GPU memory while it was built."""
    need = _estimate(facts).per_gpu_bytes
    ranks = f"{facts.world_size} rank{'s' if facts.world_size > 1 else ''}"
    message = (
        f"CUDA out of memory while building the engine: ZeRO stage {facts.stage} on {ranks} keeps "
        f"{need / GIB:.2f} GiB of model states on each GPU by the estimate"
    )
    if facts.capacity is not None:
        message += f", on a card of {facts.capacity / GIB:.2f} GiB"
    room = None if facts.capacity is None else facts.capacity * (1 - ACTIVATION_SHARE)
    offers = []
    for words, changed in _changes(facts):
        try:
            states = _estimate(changed)
        except ValueError:  # a combination the estimator (and the engine) refuses
            continue
        offers.append((states.per_gpu_bytes, words, states))

    def fits(gpu: int, states: Estimate) -> bool:
        host_fits = facts.host is None or states.per_host_bytes <= facts.host
        return (room is None or gpu <= room) and host_fits

    said = [
        f"{words} ({gpu / GIB:.2f} GiB a GPU, {states.per_host_bytes / GIB:.2f} GiB of host)"
        for gpu, words, states in offers
        if fits(gpu, states)
    ]
    where = "the card" if facts.host is None else "the card and the host"
    if said and room is None:  # no card to compare with (a CPU device): what each would take
        hint = "by the estimate, cheapest change first: " + "; ".join(said)
    elif said:
        share = f"{ACTIVATION_SHARE:.0%}"
        hint = f"these fit {where} by the estimate ({share} of the card left for activations), cheapest "
        hint += "change first: " + "; ".join(said)
    elif offers:
        hint = _split_or_least(offers, room, facts.host, where)
    else:
        hint = ""
    return message, (hint + "; `ds_estimate` prints every configuration" if hint else hint)


def _split_or_least(
    offers: list[tuple[int, str, Estimate]], room: float | None, host: int | None, where: str
) -> str:
    """Where nothing fits whole: an offload whose card and host needs together fit both, which
    `"ratio": "auto"` splits between them (issue 32's 25B on one H200); else the least GPU need."""
    split = [offer for offer in offers if offer[2].offload_optimizer and not offer[2].offload_param]
    if split and room is not None and host is not None:
        gpu, words, states = min(split, key=lambda offer: offer[0] + offer[2].per_host_bytes)
        if gpu + states.per_host_bytes <= room + host:
            return (
                f'{words} with "ratio": "auto": offloaded whole it needs {gpu / GIB:.2f} GiB of GPU and '
                f"{states.per_host_bytes / GIB:.2f} GiB of host; the ratio splits the optimizer state "
                f"between the card ({room / GIB:.2f} GiB usable) and the host "
                f"({host / GIB:.2f} GiB available)"
            )
    gpu, words, states = min(offers, key=lambda offer: offer[0])
    return (
        f"nothing fits {where}: the least GPU is {words}, {gpu / GIB:.2f} GiB a GPU and "
        f"{states.per_host_bytes / GIB:.2f} GiB of host; more GPUs shard it"
    )


def _facts(model: nn.Module, config: Config, world_size: int, device: torch.device) -> SetupFacts:
    from runtime.memory import host_available_bytes
    from runtime.offload.auto_ratio import estimator_optimizer

    zero, bf16 = config.zero_optimization, config.bf16
    dtype = "bf16" if bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    capacity = None
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    return SetupFacts(
        sizes=model_sizes(model),
        world_size=world_size,
        stage=zero.stage,
        offload_optimizer=zero.offload_optimizer.device != "none",
        offload_param=zero.offload_param.enabled,
        dtype=dtype,
        master_dtype="bf16" if bf16.enabled and bf16.bf16_master_weights_and_grads else "fp32",
        state_dtype="bf16" if bf16.enabled and bf16.bf16_optimizer_states else "fp32",
        optimizer=estimator_optimizer(config.optimizer),
        capacity=capacity,
        host=host_available_bytes() if capacity is not None else None,
    )


@contextlib.contextmanager
def explained_setup_oom(
    model: nn.Module, config: Config, world_size: int, device: torch.device
) -> Iterator[None]:
    """Build an engine for `model` and `config`; out of GPU memory, a `DeviceMemoryError` says what fits."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        if isinstance(error, DeviceMemoryError):
            raise
        try:
            message, hint = describe_setup(_facts(model, config, world_size, device))
        except Exception:  # never hide torch's error behind ours
            raise error from None
        raise DeviceMemoryError(message, hint=hint) from error
