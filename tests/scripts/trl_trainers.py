"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer as their users write them, one after the other in one
process: a tiny GPT-2 built from a config, a word-level tokenizer made here (no download), tiny made-up
data sets, three steps each. With ``--deepspeed ds_config.json`` they run on `deepspeed` (dslaunch's
compat package); without it on plain PyTorch DDP over gloo. Rank 0 writes every step's logged loss (and
GRPO's reward) per trainer to ``--out`` as JSON.

    deepspeed --num_gpus 2 trl_trainers.py --deepspeed zero3.json --out z3.json

DPO gets an explicit reference model (TRL wraps it with `prepare_deepspeed`: an engine without an
optimizer, sharded at ZeRO-3); DPO with `precompute_ref_log_probs` has none: TRL wraps the policy itself in
such an engine for one reference pass over the data set, then the Trainer trains the same model. GRPO
samples its completions (temperature 1, seeded by the trainer) inside `unwrap_model_for_generation` (all
parameters gathered, hooks removed) and scores them with `reward_len`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from baseline_exit import leave_baseline  # tests/scripts, beside this file
from datasets import Dataset, load_from_disk
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback

WORDS = [
    "the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log",
    "good", "bad", "big", "small", "red", "blue", "is", "was", "and", "then",
]  # fmt: skip
SPECIAL = ["<pad>", "<eos>", "<unk>"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(SPECIAL) + len(WORDS), n_positions=48, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def sentence(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def engine_facts(trainer) -> dict:
    """What ran the model: the engine class and ZeRO stage (DeepSpeed's accessors), and for DPO's
    reference model whether it is an engine without an optimizer whose weights are sharded at rest."""
    wrapped = trainer.model_wrapped
    facts = {"engine": type(wrapped).__module__ + "." + type(wrapped).__name__}
    if hasattr(wrapped, "zero_optimization_stage"):
        facts["stage"] = wrapped.zero_optimization_stage()
    ref = getattr(trainer, "ref_model", None)
    if ref is not None and hasattr(ref, "optimizer"):
        facts["ref_optimizer"] = repr(ref.optimizer)
        # at rest only the small persistent parameters (stage3_param_persistence_threshold) are whole
        params = list(ref.module.parameters())
        released = sum(p.numel() for p in params if p.ds_status.name == "NOT_AVAILABLE")
        facts["ref_released_fraction"] = released / sum(p.numel() for p in params)
    precompute = getattr(trainer, "_precompute_engine", None)  # DPO's reference pass over the policy
    if precompute is not None:
        memory = precompute.memory_breakdown()
        facts["precompute_masters_grads"] = [memory.master_bytes, memory.grad_bytes]
    return facts


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.logs: dict[str, dict[str, float]] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            keep = {k: v for k, v in logs.items() if k in ("loss", "reward") or k.startswith("rewards/")}
            self.logs[str(state.global_step)] = keep


def common(args: argparse.Namespace, name: str) -> dict:
    return {
        "output_dir": f"{args.output_dir}/{name}",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "data_seed": 0,
        "deepspeed": args.deepspeed,
        "use_cpu": args.deepspeed is None,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": False,  # TRL's configs default to bf16; these CPU runs compare in fp32
    }


def run_sft(args: argparse.Namespace) -> dict:
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": [sentence(i, 10) for i in range(24)]})
    record = Record()
    config = SFTConfig(**common(args, "sft"), max_length=16)
    trainer = SFTTrainer(model=model(), args=config, train_dataset=data, processing_class=tokenizer(),
                         callbacks=[record])  # fmt: skip
    trainer.train()
    return {"logs": record.logs, **engine_facts(trainer)}


def run_dpo(args: argparse.Namespace, precompute: bool = False) -> dict:
    from trl import DPOConfig, DPOTrainer

    rows = range(24)
    data = Dataset.from_dict({
        "prompt": [sentence(i, 4) for i in rows],
        "chosen": [" " + sentence(i + 1, 3) + " good" for i in rows],
        "rejected": [" " + sentence(i + 2, 3) + " bad" for i in rows],
    })  # fmt: skip
    record = Record()
    name = "dpo_precompute" if precompute else "dpo"
    config = DPOConfig(**common(args, name), max_length=16, precompute_ref_log_probs=precompute)
    # precomputed: no reference model; TRL wraps the policy itself in an inference engine for the reference
    # pass over the data set, before the Trainer builds its training engine over the same model
    ref = None if precompute else model()
    if precompute:  # TRL caches the log-probs beside the data set's files, which all ranks must then share
        path = f"{args.output_dir}/dpo_data"
        if torch.distributed.get_rank() == 0:
            data.save_to_disk(path)
        torch.distributed.barrier()
        data = load_from_disk(path)
    trainer = DPOTrainer(model=model(), ref_model=ref, args=config, train_dataset=data,
                         processing_class=tokenizer(), callbacks=[record])  # fmt: skip
    trainer.train()
    return {"logs": record.logs, **engine_facts(trainer)}


def reward_len(completions: list[str], **kwargs) -> list[float]:
    """More words, and the word "good", score higher."""
    return [len(c.split()) / 8 + c.split().count("good") for c in completions]


def run_grpo(args: argparse.Namespace) -> dict:
    import trl.models.utils as trl_utils
    from trl import GRPOConfig, GRPOTrainer

    removals = []  # TRL's own remove_hooks, counted: generation went through ZeRO-3's gathered path
    original = trl_utils.remove_hooks
    trl_utils.remove_hooks = lambda model: (removals.append(1), original(model))[1]

    data = Dataset.from_dict({"prompt": [sentence(i, 4) for i in range(24)]})
    record = Record()
    config = GRPOConfig(**common(args, "grpo"), num_generations=2, max_completion_length=8, temperature=1.0)
    trainer = GRPOTrainer(model=model(), reward_funcs=reward_len, args=config, train_dataset=data,
                          processing_class=tokenizer(), callbacks=[record])  # fmt: skip
    trainer.train()
    return {"logs": record.logs, "hook_removals": len(removals), **engine_facts(trainer)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--output_dir", default="out")
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainers", default="sft,dpo,dpo_precompute,grpo")
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher's; the trainers read the env
    args = parser.parse_args()
    runs = {"sft": run_sft, "dpo": run_dpo, "grpo": run_grpo,
            "dpo_precompute": lambda a: run_dpo(a, precompute=True)}  # fmt: skip
    result = {name: runs[name](args) for name in args.trainers.split(",")}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    if "--deepspeed" not in sys.argv:
        leave_baseline()  # plain DDP: torch's own group, see baseline_exit
