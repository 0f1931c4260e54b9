"""A PEFT LoRA fine-tune through the Hugging Face Trainer, as its users write it: a tiny GPT-2 built from a
config (the "pretrained" base: seed 0), LoRA on its attention projection, a few steps, the adapter saved
with ``trainer.save_model`` and loaded back onto a fresh base with ``PeftModel.from_pretrained``. With
``--deepspeed ds_config.json`` the Trainer runs on `deepspeed` (dslaunch's compat package); without it,
on plain DDP over gloo. Rank 0 writes the loss of every step, the saved adapter's tensor names and the
trained and the reloaded model's loss on the whole data set to ``--out``.

    deepspeed --num_gpus 2 peft_lora.py --deepspeed hf_zero3.json --output_dir out --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from baseline_exit import leave_baseline  # tests/scripts, beside this file
from hf_trainer import RecordLosses, Tokens, no_deepspeed_config  # tests/scripts, beside this file
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

CONFIG = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)


def base_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's; Trainer reads the env
    args = parser.parse_args()

    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        max_steps=5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
        deepspeed=args.deepspeed,
        use_cpu=args.deepspeed is None,  # plain DDP on a CPU-only host needs Accelerate's CPU mode
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    model = get_peft_model(base_model(), lora)
    recorder = RecordLosses()
    data = Tokens(20)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[recorder])
    trainer.train()
    final = f"{args.output_dir}/adapter"
    trainer.save_model(final)  # every rank: ZeRO-3 gathers the adapter's shards
    ids = data.rows
    trainer.model.eval()
    with torch.no_grad():  # every rank: under ZeRO-3 each module gathers its weights as it runs
        on = ids.to(trainer.args.device)
        trained_loss = trainer.model(input_ids=on, labels=on)
    if not trainer.is_world_process_zero():
        return
    saved = load_file(f"{final}/adapter_model.safetensors")
    with no_deepspeed_config():  # the user's later session: a fresh base, the adapter loaded onto it
        reloaded = PeftModel.from_pretrained(base_model(), final).eval()
    with torch.no_grad():
        loss = reloaded(input_ids=ids, labels=ids).loss.item()
    result = {
        "losses": {str(k): v for k, v in sorted(recorder.losses.items())},
        "adapter_tensors": sorted(saved),
        "adapter_abs_sum": sum(t.float().abs().sum().item() for t in saved.values()),
        "reloaded_loss": loss,
        "trained_loss": trained_loss.loss.item(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    if "--deepspeed" not in sys.argv:
        leave_baseline()  # plain DDP: torch's own group, see baseline_exit
