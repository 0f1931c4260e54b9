"""Model parallelism for train_gpt.py: a Hugging Face GPT-2 built from a config alone, the built-in GPT as
pipeline layers, and the data each data-parallel replica reads.

- `--config_name DIR_OR_JSON` / `--model_type gpt2` (+ `--config_overrides "n_embd=64,n_layer=2"`): a
  GPT2LMHeadModel with random weights, like Hugging Face's run_clm.py, so nothing is downloaded.
- `--pipeline_parallel N`: our GPT as a `runtime.pipe.PipelineModule` (token embedding and output head
  tied across the first and last stages, one layer per block), trained by `engine.train_batch`.
- `--tensor_parallel N`: the config's `"tensor_parallel": {"autotp_size": N}`. AutoTP shards GPT-2's
  Conv1D projections (c_attn, c_fc colwise; c_proj rowwise), so it needs the Hugging Face GPT-2; the
  built-in GPT's projections have other names and are refused rather than silently left whole.

Pipeline and tensor-parallel engines take no `training_data`: every rank of one data-parallel replica
must read the same batches, so the sampler here is over the grid's data axis, not over all ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from runtime.errors import UserError
from runtime.models.gpt import Block, GPTConfig
from runtime.pipe import LayerSpec, PipelineModule, TiedLayerSpec

STD = 0.02  # GPT-2's initial weight scale, as runtime.models.GPT uses


class ParallelUsageError(UserError):
    """A bad --config_name / --pipeline_parallel / --tensor_parallel: one line and exit code 2."""


# ------------------------------------------------------------------------------ Hugging Face from config


def _parse_overrides(text: str) -> dict[str, Any]:
    """`"n_embd=64,n_layer=2"` -> {"n_embd": 64, "n_layer": 2} (values read as JSON where they parse)."""
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ParallelUsageError(f"--config_overrides: {item!r} is not KEY=VALUE")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()
    return overrides


def config_json_path(name: str) -> Path:
    """The config.json that --config_name names (a folder holding one, or the file), or a one-line error
    saying what is missing."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ParallelUsageError(
                f"--config_name {name}: the folder lacks config.json",
                hint="write one with config.save_pretrained(DIR), or pass --model_type gpt2",
            )
        return path / "config.json"
    if path.is_file():
        return path
    raise ParallelUsageError(
        f"--config_name {name}: no such folder or file",
        hint="pass a folder holding config.json (config.save_pretrained(DIR)) or the config.json itself",
    )


def hf_gpt2_from_config(config_name: str | None, model_type: str | None, overrides: str | None) -> nn.Module:
    """A GPT2LMHeadModel with random weights from --config_name or --model_type (+ --config_overrides)."""
    if config_name is not None:
        json_path = config_json_path(config_name)  # before the import: the message holds without it
    if model_type is not None and model_type != "gpt2":
        raise ParallelUsageError(f"--model_type {model_type!r}: only gpt2 is supported")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ParallelUsageError(
            "--config_name / --model_type need the 'transformers' package, which is not installed; install "
            "it or drop the flag to train the built-in GPT"
        ) from None
    if config_name is not None:
        try:
            config = GPT2Config.from_json_file(str(json_path))
        except (OSError, ValueError) as error:
            raise ParallelUsageError(
                f"--config_name {config_name}: {json_path} is not a GPT-2 config ({error})"
            ) from None
    else:
        config = GPT2Config()
    for key, value in _parse_overrides(overrides or "").items():
        if not hasattr(config, key):
            raise ParallelUsageError(f"--config_overrides: GPT-2's config has no key {key!r}")
        setattr(config, key, value)
    return GPT2LMHeadModel(config)


# -------------------------------------------------------------------------------- GPT as pipeline layers


class TokenEmbedding(nn.Embedding):
    """The token embedding, also the output head's weight (tied across the first and last stages)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=STD)


class AddPositions(nn.Module):
    """Learned position embeddings added to the token embeddings."""

    def __init__(self, max_seq_len: int, n_embd: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_seq_len, n_embd) * STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


def _head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss as the built-in GPT's: mean cross-entropy over every token, in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def gpt_pipeline(config: GPTConfig, num_stages: int, seed: int) -> PipelineModule:
    """Our GPT as a PipelineModule of 4 + n_layer layers; each stage builds only its own."""
    if num_stages > config.n_layer + 4:
        raise ParallelUsageError(
            f"--pipeline_parallel {num_stages}: more stages than the model's {config.n_layer + 4} layers "
            f"({config.n_layer} blocks + embedding, positions, final norm, head)"
        )
    layers: list[Any] = [
        TiedLayerSpec("embed", TokenEmbedding, config.vocab_size, config.n_embd),
        LayerSpec(AddPositions, config.max_seq_len, config.n_embd),
        *(LayerSpec(Block, config) for _ in range(config.n_layer)),
        LayerSpec(nn.LayerNorm, config.n_embd),
        TiedLayerSpec("embed", TokenEmbedding, config.vocab_size, config.n_embd, forward_fn=_head),
    ]
    return PipelineModule(layers, num_stages=num_stages, loss_fn=token_loss, seed_layers=True, base_seed=seed)


def check_degrees(world: int, pipeline: int, tensor: int) -> None:
    """Degrees that do not tile the ranks: one line, before any model is built."""
    for flag, degree in (("--pipeline_parallel", pipeline), ("--tensor_parallel", tensor)):
        if degree < 1:
            raise ParallelUsageError(f"{flag} must be at least 1, got {degree}")
    if world % (pipeline * tensor):
        asked = " x ".join(
            f"{flag} {degree}"
            for flag, degree in (("--pipeline_parallel", pipeline), ("--tensor_parallel", tensor))
            if degree > 1
        )
        product = f" = {pipeline * tensor}" if pipeline > 1 and tensor > 1 else ""
        raise ParallelUsageError(
            f"{asked}{product} does not divide the {world} rank(s): every data-parallel replica needs "
            f"{pipeline * tensor} ranks"
        )


def wants_hf_model(args: Any) -> bool:
    return bool(args.model_name_or_path or args.config_name or args.model_type)


def check_parallel_args(args: Any, world: int) -> None:
    """Refuse what cannot work, in one line, before any model is built."""
    check_degrees(world, args.pipeline_parallel, args.tensor_parallel)
    if args.pipeline_parallel > 1 and wants_hf_model(args):
        raise ParallelUsageError(
            "--pipeline_parallel trains the built-in GPT; drop --model_name_or_path / --config_name / "
            "--model_type"
        )
    if args.pipeline_parallel > 1 and args.tensor_parallel > 1:
        raise ParallelUsageError("--pipeline_parallel with --tensor_parallel: not in train_gpt.py yet")
    if args.tensor_parallel > 1 and not wants_hf_model(args):
        raise ParallelUsageError(
            f"--tensor_parallel {args.tensor_parallel} shards a Hugging Face GPT-2's projections (AutoTP), "
            "not the built-in GPT's; add --model_type gpt2 or --config_name"
        )


def check_tensor_parallel_fits(model: nn.Module, degree: int) -> None:
    """A degree that does not divide the heads or the width: one line naming the numbers, before AutoTP
    would fail inside the engine."""
    config = getattr(model, "config", None)
    if degree == 1 or config is None:
        return
    for name in ("n_head", "n_embd", "n_inner"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value % degree:
            raise ParallelUsageError(
                f"--tensor_parallel {degree} does not divide the model's {name} = {value}: each rank takes "
                f"1/{degree} of the heads and of the projections' width"
            )


def model_parallel_config(config: str | dict[str, Any], args: Any) -> dict[str, Any]:
    """The config for --pipeline_parallel / --tensor_parallel: "tensor_parallel": {"autotp_size": N} (the
    flag wins over the file), and for a pipeline at least one micro-batch per stage (accumulation steps;
    the built-in default config gets exactly that many, a user's config too few is refused)."""
    if not isinstance(config, dict):
        from runtime.config import read_config_file

        config = read_config_file(config)
    config = dict(config)
    if args.tensor_parallel > 1:
        section = dict(config.get("tensor_parallel") or {})
        section.pop("tp_size", None)
        section["autotp_size"] = args.tensor_parallel
        config["tensor_parallel"] = section
    stages = args.pipeline_parallel
    if stages > 1:
        if getattr(args, "deepspeed_config", None) is None:
            config["gradient_accumulation_steps"] = stages
        elif int(config.get("gradient_accumulation_steps", 1)) < stages:
            raise ParallelUsageError(
                f"--pipeline_parallel {stages} needs gradient_accumulation_steps (micro-batches per step) of "
                f"at least {stages}, the config has {config.get('gradient_accumulation_steps', 1)}"
            )
    return config


def has_checkpoint(save_dir: Path) -> bool:
    """A checkpoint to resume from: a data- or tensor-parallel one, or a pipeline's per-stage folders
    (pipe_stage_SS_of_NN; the engine refuses a resume at another pipeline degree, saying which)."""
    from runtime.checkpoint import read_latest

    # a pipeline's stages and a tensor-parallel run's model ranks each keep their own checkpoint folder
    if not save_dir.is_dir():
        return False
    stages = sorted([*save_dir.glob("pipe_stage_*"), *save_dir.glob("tp_rank_*")])
    return any(read_latest(folder) is not None for folder in [save_dir, *stages])


def replica_loader(dataset: Dataset, micro_batch: int, grid: Any) -> DataLoader:
    """Micro-batches for this rank's data-parallel replica, the same on every pipeline stage and
    tensor-parallel rank of it: runtime.build_dataloader's sampler (so a replica reads what a rank of a
    data-parallel run would, and its position is checkpointed), over the grid's data axis."""
    from runtime.checkpoint.data_position import ResumableDataLoader, ResumableSampler

    sampler = ResumableSampler(
        dataset, num_replicas=grid.get_data_parallel_world_size(), rank=grid.get_data_parallel_rank()
    )
    return ResumableDataLoader(dataset, batch_size=micro_batch, sampler=sampler)
