"""A Hugging Face Trainer job with Ulysses sequence parallelism, as Accelerate's users start it:

    accelerate launch --config_file sp.yaml hf_trainer_sp.py --out run.json

The YAML says DeepSpeed (its ZeRO stage) and the parallelism (``parallelism_config_sp_size``,
``parallelism_config_dp_shard_size``); Accelerate hands both to the workers in its environment variables,
and the Trainer's Accelerator builds ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` from them.
The script itself is a plain Trainer job: a tiny Llama built from a config, made-up token rows whose first
tokens are a prompt (labels -100), 8 steps. Nothing in it knows about sequence parallelism.

Rank 0 writes the logged loss and gradient norm of every step, and every rank's served shards (its
``input_ids`` and ``shift_labels`` per step, gathered to rank 0) so the test can train one process on the
same whole sequences.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ, PROMPT, ROWS, STEPS = 96, 32, 10, 64, 8


def build_model() -> LlamaForCausalLM:
    """The same weights in every process (the test's reference builds it too)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Rows(Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(VOCAB, (ROWS, SEQ), generator=gen)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[:PROMPT] = -100  # at sp 4 the first shard of every row counts no token
        return {"input_ids": self.ids[i], "labels": labels}


class Logged(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append({"loss": logs["loss"], "grad_norm": logs["grad_norm"]})


class RecordingTrainer(Trainer):
    """Keeps what each step was served (the test's record, not part of the job)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.served: list[dict[str, list]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.served.append({k: inputs[k].tolist() for k in ("input_ids", "shift_labels")})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    training = TrainingArguments(
        output_dir="out",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=STEPS,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = build_model()
    logged = Logged()
    trainer = RecordingTrainer(model=model, args=training, train_dataset=Rows(), callbacks=[logged])
    trainer.train()
    pc = trainer.accelerator.parallelism_config
    served: list = [None] * dist.get_world_size()
    dist.all_gather_object(served, trainer.served)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "sp": pc.sp_size if pc else 1,
                    "world": dist.get_world_size(),
                    "engine": type(trainer.model_wrapped).__module__,
                    "logs": logged.logs,
                    "served": served,
                },
                f,
            )


if __name__ == "__main__":
    main()
