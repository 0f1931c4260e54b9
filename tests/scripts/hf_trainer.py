"""A Hugging Face Trainer job as its users write it: a tiny GPT-2 built from a config, a tiny made-up data
set, a few steps. With ``--deepspeed ds_config.json`` the Trainer runs on `deepspeed` (dslaunch's compat
package); without it, on plain PyTorch DDP over gloo. Rank 0 writes the logged loss of every step to
``--losses_out`` as JSON.

    deepspeed --num_gpus 2 hf_trainer.py --deepspeed ds_config.json --output_dir out --losses_out l.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from baseline_exit import leave_baseline  # tests/scripts, beside this file
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

SEQ = 16
VOCAB = 64


class Tokens(Dataset):
    """Fixed-length rows of a repeating token pattern with noise: learnable, made here, no download."""

    def __init__(self, rows: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        base = torch.arange(SEQ) % 7
        noise = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
        keep = torch.rand(rows, SEQ, generator=gen) < 0.7
        self.rows = torch.where(keep, base + torch.arange(rows)[:, None] % 5, noise)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class RecordLosses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--losses_out", required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--from_pretrained", action="store_true")
    parser.add_argument("--final_dir", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's; Trainer reads the env
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2)
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=3e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup",  # what the config's WarmupLR (linear) computes
        warmup_steps=3,
        max_steps=args.max_steps,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        seed=0,
        data_seed=0,
        deepspeed=args.deepspeed,
        # Plain DDP on a CPU-only machine needs Accelerate's CPU mode; DeepSpeed runs take their device
        # from the accelerator (DS_ACCELERATOR=cpu) and must not set it.
        use_cpu=args.deepspeed is None,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if args.from_pretrained:
        init_dir = os.path.join(args.output_dir, "init")
        with no_deepspeed_config():  # built whole, saved by rank 0: the checkpoint a user starts from
            GPT2LMHeadModel(config).save_pretrained(init_dir)
        torch.distributed.barrier()  # the TrainingArguments made the process group
        torch.manual_seed(0)
        model = GPT2LMHeadModel.from_pretrained(init_dir)  # under ZeRO-3: inside zero.Init
    else:
        model = GPT2LMHeadModel(config)
    recorder = RecordLosses()
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(64), callbacks=[recorder])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    result: dict = {"losses": {str(k): v for k, v in sorted(recorder.losses.items())}}
    if args.final_dir:
        trainer.save_model(args.final_dir)
        result.update(check_reload(trainer, args.final_dir))
    if trainer.is_world_process_zero():
        with open(args.losses_out, "w") as f:
            json.dump(result, f)


@contextlib.contextmanager
def no_deepspeed_config():
    """Build without zero.Init: Transformers consults the live DeepSpeed config (a weak reference)."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def check_reload(trainer: Trainer, final_dir: str) -> dict:
    """The engine's whole weights (every rank takes part) against what from_pretrained loads back."""
    engine = trainer.model_wrapped
    if hasattr(engine, "_zero3_consolidated_16bit_state_dict"):
        trained = engine._zero3_consolidated_16bit_state_dict()
    else:
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if not trainer.is_world_process_zero():
        return {}
    with no_deepspeed_config():
        reloaded = GPT2LMHeadModel.from_pretrained(final_dir).state_dict()
    diffs = {k: (reloaded[k].float() - v.float()).abs().max().item() for k, v in trained.items()}
    return {"reload_max_diff": max(diffs.values()), "reload_tensors": len(diffs)}


if __name__ == "__main__":
    main()
    if "--deepspeed" not in sys.argv:
        leave_baseline()  # plain DDP: torch's own group, see baseline_exit
