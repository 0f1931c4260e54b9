"""A PyTorch Lightning job as its users write it, with Lightning's ``DeepSpeedStrategy`` or its DDP strategy.

    python lightning_fit.py --strategy z3 --epochs 2 --out run.json [--save DIR] [--resume CKPT]

Lightning starts the second process itself (its subprocess launcher re-runs this script). The model has a
frozen input layer (requires_grad False), as a fine-tune has. ``--save DIR`` keeps a checkpoint at the end
of every epoch (Lightning's ModelCheckpoint, which calls ``trainer.save_checkpoint``); ``--resume CKPT`` goes
on from one (``trainer.fit(..., ckpt_path=CKPT)``; with ``--load_full_weights`` CKPT is one file, a
DDP run's, loaded into ZeRO-3 through Lightning's ``GatheredParameters(..., modifier_rank=0)``). Rank 0
writes the loss of every step (averaged over the ranks) and the trainer's step count to ``--out``.

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA before DeepSpeed is reached; on a CPU host the
test runs it through ``CPUDeepSpeedStrategy``, which lifts only those device checks (the code path after
them is Lightning's, unchanged), over gloo.
"""

from __future__ import annotations

import argparse
import json

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DeepSpeedStrategy
from pytorch_lightning.strategies.ddp import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, BATCH = 20, 2  # 5 steps an epoch at 2 ranks


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        super(DeepSpeedStrategy, self).setup_environment()  # all but the CUDA check

    def setup_distributed(self) -> None:  # all but the check of CUDA device indices (CPU devices have none)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()


class Regression(pl.LightningModule):
    def __init__(self, configure_model: bool = False) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.built = False
        if not configure_model:
            self.configure_model()

    def configure_model(self) -> None:
        # Lightning's way for big models: built here, under ZeRO-3 inside deepspeed.zero.Init (sharded
        # as each layer is made), then converted by the precision plugin (module.to(dtype=...)).
        if self.built:
            return
        self.built = True
        torch.manual_seed(0)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.frozen(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.l1_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.01)


def data() -> DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=gen)
    y = x[:, :1] * 2.0 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES, 1, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "z2", "z3"], required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--exclude_frozen", action="store_true", help="save without the frozen parameters")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument(
        "--load_full_weights", action="store_true", help="--resume names one file (a DDP run's checkpoint)"
    )
    parser.add_argument("--configure_model", action="store_true", help="build the layers in configure_model")
    parser.add_argument(
        "--evaluate", action="store_true", help="validate, test, predict (--epochs 0: from --resume)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.strategy == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = CPUDeepSpeedStrategy(
            stage=int(args.strategy[1]),
            process_group_backend="gloo",
            exclude_frozen_parameters=args.exclude_frozen,
            load_full_weights=args.load_full_weights,
        )
    callbacks = [ModelCheckpoint(dirpath=args.save, save_top_k=-1, every_n_epochs=1)] if args.save else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        enable_checkpointing=bool(args.save),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = Regression(configure_model=args.configure_model)
    # Saved without its frozen parameters, a checkpoint loads only non-strictly (DeepSpeed's rule).
    model.strict_loading = not args.exclude_frozen
    result = {}
    if args.epochs:
        trainer.fit(model, data(), ckpt_path=args.resume)
    if args.evaluate:
        # Lightning builds an engine without an optimizer for these (model_parameters=[]); with --epochs 0
        # it loads the weights from --resume without optimizer states
        ckpt = None if args.epochs else args.resume
        result["val"] = trainer.validate(model, data(), ckpt_path=ckpt, verbose=False)[0]["val_loss"]
        result["test"] = trainer.test(model, data(), ckpt_path=ckpt, verbose=False)[0]["test_loss"]
        predicted = trainer.predict(model, data(), ckpt_path=ckpt)
        result["predict"] = torch.cat(predicted).flatten().tolist()  # this rank's samples
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"losses": model.losses, "global_step": trainer.global_step, **result}, f)
    if args.strategy == "ddp":
        # imported here: the tests load this file as a module (its Regression), without tests/scripts on
        # the path
        from baseline_exit import leave_baseline  # tests/scripts, beside this file

        leave_baseline()  # torch's own group, see baseline_exit


if __name__ == "__main__":
    main()
