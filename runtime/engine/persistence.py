"""Saving and loading a training engine, as a mixin of `runtime.engine.Engine`.

Owns the engine's persistence API, DeepSpeed's names: `save_checkpoint` and `load_checkpoint` (the whole
training state, at any world size or ZeRO stage: runtime.checkpoint does the work), `full_state_dict` (the
module's state with fp32 master values), `save_16bit_model` (the working weights as one file), and where a
model-parallel rank keeps its part (`checkpoint_folder`). Each call first lets an update still in flight
(offload's delayed update) land, so what is written is the state after the last `engine.step()`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from runtime import checkpoint
from runtime.initialize_args import checkpoint_dir
from runtime.parallel.folders import part_root
from runtime.parallel.rng import RNGStatesTracker, get_cuda_rng_tracker

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

__all__ = ["EngineCheckpoints"]


class EngineCheckpoints:
    """The engine's save and load methods; mixed into `runtime.engine.Engine` (which provides the parts
    named below)."""

    config: Any
    comm: Any
    module: torch.nn.Module
    masters: Any  # runtime.offload.MasterPlacement
    groups: list[Any]  # runtime.zero.flat.FlatGroup
    parallel: Any  # runtime.parallel.plan.ParallelPlan
    tp_size: int
    mp_size: int
    _check_trains: Callable[[str], None]  # refuses an engine built without an optimizer
    excluding_frozen: Callable[[bool], contextlib.AbstractContextManager[None]]  # EngineAccessors'

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's state dict with fp32 master values for trained parameters. Every rank must call it
        (it all-gathers master shards); other ranks get {} when rank0_only."""
        from runtime.zero.gather import gather_master_params

        self._check_trains("full_state_dict")
        self.masters.flush()  # an update still in flight (offload's delayed update) lands first
        keep = not rank0_only or self.comm.rank == 0
        masters = gather_master_params(self.groups, self.comm, keep=keep)  # one group whole at a time
        if not keep:
            return {}
        by_param = {p: t for g in self.groups for p, t in zip(g.params, masters[g.index], strict=True)}
        out: dict[str, torch.Tensor] = {}
        names = dict(self.module.named_parameters(remove_duplicate=False))
        for key, value in self.module.state_dict(keep_vars=True).items():
            param = names.get(key)
            out[key] = by_param[param] if param in by_param else value.detach().clone()
        return out

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """The working-dtype weights as one state dict file, written by rank 0 (True there; every rank calls
        it). ZeRO-3 gathers unit by unit, only with stage3_gather_16bit_weights_on_model_save (or raises)."""
        from runtime.zero.gathered import save_16bit_state_dict

        allow = self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        return save_16bit_state_dict(self.module, os.path.join(save_dir, save_filename), allow_gather=allow)

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save the full training state under save_dir/<tag> (default "global_step<N>"), leaving frozen
        parameters out with exclude_frozen_parameters; every rank must call it. Returns the tag directory."""
        self._check_trains("save_checkpoint")
        self.masters.flush()
        save_dir = checkpoint_dir(save_dir, "save_dir")
        with self.excluding_frozen(exclude_frozen_parameters):  # model-parallel parts: see checkpoint.save
            return str(
                checkpoint.save_checkpoint(cast("Engine", self), save_dir, tag, client_state, save_latest)
            )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, dict[str, Any]]:
        """Resume from load_dir/<tag> (default: the tag `latest` names), at any world size or ZeRO stage;
        every rank must call it. Returns (tag directory, client_state)."""
        self._check_trains("load_checkpoint")
        self.masters.flush()
        return checkpoint.load_checkpoint(
            cast("Engine", self),
            self._checkpoint_root(checkpoint_dir(load_dir, "load_dir"), loading=True),
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    @property
    def rng_tracker(self) -> RNGStatesTracker:
        """The model-parallel random streams a checkpoint saves and restores with the generators."""
        return get_cuda_rng_tracker()

    def checkpoint_folder(self) -> tuple[str, str, str] | None:
        """Model-parallel engines: (this rank's sub-folder, the family's name prefix, what it holds in
        words). Ranks holding different shards at the same data rank (pipeline stages, tensor-parallel
        ranks) each keep their own ZeRO checkpoint there, since the checkpoint's files are named by data
        rank only. None: the checkpoint directory itself."""
        return self.parallel.checkpoint_folder(self.tp_size if self.tp_size > 1 else self.mp_size)

    def _checkpoint_root(self, root: str | os.PathLike, *, loading: bool = False) -> str:
        return part_root(root, self.checkpoint_folder(), loading=loading)
