"""Named random streams for model parallelism (Megatron's RNG-states tracker, DeepSpeed's
``deepspeed.checkpointing.get_cuda_rng_tracker``).

Why two streams: in a tensor-parallel layer some activations are split over the model-parallel ranks
(each rank holds other features) and some are replicated (every rank holds the same tensor). Dropout on a
split activation must draw *different* masks on each model rank, or the features of one rank would be
dropped in lockstep with another's; dropout on a replicated activation must draw the *same* mask on every
model rank, or the copies would drift apart. So the default generator is seeded alike on the model ranks,
and a second, named stream ("model-parallel-rng") is seeded per model rank; a model runs its split
dropouts inside ``get_cuda_rng_tracker().fork()``. Across data-parallel ranks the user decides: the same
seed everywhere, or a seed that includes the data rank.

The tracker keeps each named stream as a saved generator state. ``fork(name)`` swaps that state into the
default generator for the duration of the block and keeps the advanced state when it ends, so the stream
continues where it left off next time while the default stream is untouched. The generator is the one
this process trains with: the current CUDA device's under CUDA, the CPU default generator otherwise
(``DS_ACCELERATOR=cpu`` tests run the same code). Activation checkpointing replays the streams' states on
recomputation (runtime.activation_checkpointing), so recomputed dropout draws the forward's masks.

`set_random_seed` seeds Python's, numpy's and torch's generators at once (DeepSpeed's
``deepspeed.runtime.utils.set_random_seed``; `PipelineModule(seed_layers=True)` seeds each layer with it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from runtime.distributed import accelerator
from runtime.errors import UserError
from runtime.parallel.mpu import tensor_parallel_rank


class RngTrackerError(UserError, ValueError):
    """A random stream used wrongly by the model's code (a seed or name twice, an unseeded stream)."""

    hint = (
        "give each stream its own name and seed; model_parallel_cuda_manual_seed(seed) seeds the usual ones"
    )


class UnseededStreamError(RngTrackerError, RuntimeError):
    """fork() of a stream nobody seeded (a RuntimeError too, as before)."""


MODEL_PARALLEL_RNG = "model-parallel-rng"
# The model stream's seed is seed + offset + model rank (the offset is Megatron's: checkpoints and seeds
# carried over from Megatron or DeepSpeed runs then draw the same masks here)
MODEL_PARALLEL_SEED_OFFSET = 2718

__all__ = [
    "MODEL_PARALLEL_RNG",
    "MODEL_PARALLEL_SEED_OFFSET",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
    "set_random_seed",
]


def default_generator() -> torch.Generator:
    """The generator that dropout and friends draw from in this process: the current CUDA device's when
    training on CUDA, else the CPU one."""
    if accelerator() == "cuda":
        torch.cuda.init()  # default_generators is filled on CUDA's (lazy) initialisation
        return torch.cuda.default_generators[torch.cuda.current_device()]
    return torch.default_generator


class RNGStatesTracker:
    """Named random streams, each a saved state of the default generator."""

    def __init__(self) -> None:
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        """Forget every stream and the seeds they used."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams' states by name: a new dict (a state tensor is replaced when its stream advances,
        never changed in place, so the returned states stay as they are now)."""
        return dict(self._states)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the streams by `states` (from `get_states`, or a checkpoint); the seeds are kept."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Start a stream `name` at `seed`. A seed or name already in use is an error: two streams with
        one seed would draw the same numbers, which is what separate streams are there to prevent."""
        if seed in self._seeds:
            raise RngTrackerError(
                f"RNG tracker: seed {seed} already starts another stream; give {name!r} its own"
            )
        if name in self._states:
            raise RngTrackerError(f"RNG tracker: a stream named {name!r} exists already (reset() forgets it)")
        generator = default_generator()
        outside = generator.get_state()
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        generator.set_state(outside)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the default stream resumes unchanged after it."""
        if name not in self._states:
            raise UnseededStreamError(
                f"RNG tracker: no stream named {name!r}; seed it first with "
                "model_parallel_cuda_manual_seed(seed) (or get_cuda_rng_tracker().add(name, seed))"
            )
        generator = default_generator()
        outside = generator.get_state()
        generator.set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = generator.get_state()
            generator.set_state(outside)


# DeepSpeed's and Megatron's name (it tracks the CPU generator too, when the process trains on the CPU)
CudaRNGStatesTracker = RNGStatesTracker

_TRACKER = RNGStatesTracker()
_default_mpu: Any = None  # set_default_mpu's; None: no model parallelism


def set_default_mpu(mpu: Any) -> None:
    """The model-parallel unit `model_parallel_cuda_manual_seed` uses when called without one.
    ``runtime.activation_checkpointing`` sets it (``configure(mpu_)``, or the engine's mpu), so this
    module does not need to import checkpointing back."""
    global _default_mpu
    _default_mpu = mpu


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, like the default generator it swaps states into)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, mpu: Any = None) -> None:
    """Seed the default stream with `seed` and the model-parallel stream with
    ``seed + 2718 + model-parallel rank``: dropout outside ``fork()`` agrees across the model-parallel
    ranks, inside it differs. Forgets every other stream of the tracker.

    The model-parallel rank comes from `mpu`, else from the mpu given to
    ``runtime.activation_checkpointing.configure(mpu_)`` (`set_default_mpu`), else it is 0 (no model
    parallelism).
    Data-parallel ranks draw alike when they pass the same seed; pass a seed that includes the data rank
    for different masks.
    """
    if mpu is None:
        mpu = _default_mpu
    model_rank = tensor_parallel_rank(mpu) if mpu is not None else 0
    _TRACKER.reset()
    default_generator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + model_rank)


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator and torch's (every device's) with `seed`.

    DeepSpeed's `deepspeed.runtime.utils.set_random_seed`: numpy takes the seed modulo 2**32 and torch
    modulo 2**63 (what each accepts), so any Python int works."""
    import random

    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional for the runtime; nothing of ours draws from it
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
