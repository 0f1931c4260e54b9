"""Where train_gpt.py's model and data come from: the built-in GPT at a named size, a Hugging Face GPT-2
from the hub, a local folder (checked before loading, with offline mode named) or a config alone
(train_gpt_parallel.py), the pipeline form of our GPT, and the tokenizer and token blocks it trains on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.data import TokenBlockDataset, Tokenizer, load_tokenizer
from runtime.errors import UserError
from runtime.models import GPT, GPTConfig, GPTOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when imported
from train_gpt_parallel import gpt_pipeline, hf_gpt2_from_config

__all__ = ["UsageError", "build_model", "build_tokenizer_and_data", "check_model_source"]


class UsageError(UserError):
    """Bad arguments or inputs: reported as one line and exit code 2, never as a traceback."""


# What from_pretrained needs in a local folder (GPT-2 family: its tokenizer is byte-level BPE).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def check_model_source(name: str, *, with_tokenizer: bool) -> None:
    """Refuse a --model_name_or_path that cannot load, saying what is missing, before transformers tries.

    A local folder must hold config.json and weights (and a tokenizer when --tokenizer is not given); a
    name that is no local folder must come from the hub, which HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE turn
    off."""
    path = Path(name).expanduser()
    if path.is_dir():
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not any((path / f).is_file() for f in WEIGHT_FILES):
            missing.append("weights (model.safetensors or pytorch_model.bin)")
        has_tokenizer = (path / "tokenizer.json").is_file() or all(
            (path / f).is_file() for f in ("vocab.json", "merges.txt")
        )
        if with_tokenizer and not has_tokenizer:
            missing.append("a tokenizer (tokenizer.json, or vocab.json and merges.txt)")
        if missing:
            raise UsageError(
                f"--model_name_or_path {name}: the folder lacks {', '.join(missing)}",
                hint="save a model there with model.save_pretrained(DIR) (and its tokenizer with "
                "tokenizer.save_pretrained(DIR), or pass --tokenizer)",
            )
        return
    if path.exists():
        raise UsageError(f"--model_name_or_path {name}: a file, not a model folder or a hub name")
    offline = [v for v in OFFLINE_VARIABLES if os.environ.get(v, "").strip() not in ("", "0")]
    if offline:
        raise UsageError(
            f"--model_name_or_path {name!r} is not a local folder, and hub access is off "
            f"({', '.join(f'{v}={os.environ[v]}' for v in offline)})",
            hint="download the model where the hub is reachable (model.save_pretrained(DIR)) and pass DIR, "
            f"or unset {' and '.join(offline)}",
        )


def from_hub_or_folder(flag: str, what: str, name: str, load: Any) -> Any:
    """`load(name)`, with transformers' OSError (missing files, no network) said in one line."""
    try:
        return load(name)
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = "a local folder" if Path(name).expanduser().is_dir() else "not a local folder, and the hub"
        raise UsageError(
            f"{flag} {name!r}: cannot load its {what}: {where} did not provide it ({first})",
            hint="pass a folder written by save_pretrained, or a hub name with the hub reachable",
        ) from None


def build_tokenizer_and_data(args: argparse.Namespace) -> tuple[Tokenizer, TokenBlockDataset]:
    flag, name = (
        ("--tokenizer", args.tokenizer)
        if args.tokenizer
        else ("--model_name_or_path", args.model_name_or_path)
    )
    tokenizer = from_hub_or_folder(flag, "tokenizer", name, load_tokenizer) if name else load_tokenizer(None)
    if args.dataset_name:
        dataset = TokenBlockDataset.from_hf_dataset(
            args.dataset_name, args.dataset_config_name, args.seq_len, tokenizer
        )
    else:
        dataset = TokenBlockDataset.from_text_file(args.train_file, args.seq_len, tokenizer)
    return tokenizer, dataset


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM behind our model's interface: ``forward(idx, targets) -> GPTOutput``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        logits = self.model(input_ids=idx).logits
        if targets is None:
            return GPTOutput(logits, None)
        # Targets are already shifted by the dataset, so the HF model's own (shifting) loss is not used.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return GPTOutput(logits, loss)


def build_model(args: argparse.Namespace, vocab_size: int) -> nn.Module:
    if args.config_name or args.model_type:
        model = hf_gpt2_from_config(args.config_name, args.model_type, args.config_overrides)
        if vocab_size > model.config.vocab_size:
            raise UsageError(
                f"the tokenizer has {vocab_size} tokens but the config only {model.config.vocab_size}"
            )
        return HFCausalLM(model)
    if args.model_name_or_path:
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise UsageError(
                f"--model_name_or_path {args.model_name_or_path!r} needs the 'transformers' package, which "
                "is not installed; install it or drop the flag to train the built-in GPT"
            ) from None
        model = from_hub_or_folder(
            "--model_name_or_path", "model", args.model_name_or_path, GPT2LMHeadModel.from_pretrained
        )
        if vocab_size > model.config.vocab_size:
            raise UsageError(
                f"the tokenizer has {vocab_size} tokens but {args.model_name_or_path} only "
                f"{model.config.vocab_size}; use the model's own tokenizer"
            )
        return HFCausalLM(model)
    overrides: dict[str, Any] = {"dropout": args.dropout}
    for name in ("n_layer", "n_head", "n_embd"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    # A byte vocabulary (256) is used as is; larger ones are padded to a multiple of 64 for fast matmuls.
    overrides["vocab_size"] = vocab_size if vocab_size <= 256 else 64 * math.ceil(vocab_size / 64)
    try:
        base = GPTConfig.named(args.model_size)
        overrides["max_seq_len"] = max(base.max_seq_len, args.seq_len)
        config = GPTConfig.named(args.model_size, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.pipeline_parallel > 1:
        return gpt_pipeline(config, args.pipeline_parallel, args.seed)
    return GPT(config)
