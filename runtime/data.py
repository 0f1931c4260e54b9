"""Token datasets for the example jobs: a local text file cut into fixed-length blocks, or random tokens.

This module owns turning text into ``(input, target)`` pairs of token ids; sampling and sharding across
ranks belong to the data loader that ``runtime.initialize`` builds. Everything here is deterministic: the
same file, tokenizer and ``seq_len`` give the same blocks in the same order, and the synthetic dataset
draws each sample from its own seeded generator, so every rank and every run sees the same data.

Tokenizers: ``ByteTokenizer`` (UTF-8 bytes, vocabulary 256) needs nothing to download and is the default.
With ``transformers`` installed, ``load_tokenizer(name_or_path)`` wraps a Hugging Face tokenizer instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

import torch
from torch.utils.data import Dataset

from runtime.errors import UserError

# The corpus shipped with the repository; scripts/train_gpt.py trains on it by default.
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "scripts" / "data" / "corpus.txt"


class DataError(UserError, ValueError):
    """A dataset could not be built; the message names the file or dataset and what is wrong."""

    hint = "fix the data argument the message names (a path, a dataset name, --seq_len)"


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless on any text, no files needed."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer behind the ``Tokenizer`` protocol (long texts allowed, no special tokens)."""

    def __init__(self, name_or_path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise DataError(
                f"tokenizer {name_or_path!r} needs the 'transformers' package, which is not installed; "
                "install it or leave the tokenizer unset to use the built-in byte-level tokenizer"
            ) from exc
        self.name = name_or_path
        self._tok = AutoTokenizer.from_pretrained(name_or_path)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        # verbose=False: a corpus is longer than the model's context by design; we cut it into blocks.
        return self._tok.encode(text, add_special_tokens=False, verbose=False)

    def decode(self, ids: Sequence[int]) -> str:
        # one flat list of ids decodes to one string (a list of lists would give a list of them)
        return cast(str, self._tok.decode(list(ids)))


def load_tokenizer(name_or_path: str | None) -> Tokenizer:
    """The byte-level tokenizer for ``None``, else a Hugging Face tokenizer by name or local path."""
    return ByteTokenizer() if not name_or_path else HFTokenizer(name_or_path)


class TokenBlockDataset(Dataset):
    """Consecutive, non-overlapping blocks of a token stream.

    Item ``i`` is ``(tokens[i*T : (i+1)*T], tokens[i*T+1 : (i+1)*T+1])`` with ``T = seq_len``: the target is
    the input shifted by one token. The tail that does not fill a whole block is dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, *, source: str = "token stream") -> None:
        if seq_len <= 0:
            raise DataError(f"seq_len must be positive, got {seq_len}")
        if tokens.dim() != 1:
            raise DataError(f"{source}: expected a 1-D token tensor, got shape {tuple(tokens.shape)}")
        if tokens.numel() < seq_len + 1:
            raise DataError(
                f"{source}: {tokens.numel()} tokens is too short for one block of seq_len {seq_len} "
                f"(needs at least {seq_len + 1}); use a longer text or a smaller seq_len"
            )
        # int32 keeps a large corpus at 4 bytes a token; items are widened to int64 for nn.Embedding.
        self.tokens = tokens.to(torch.int32)
        self.seq_len = seq_len
        self.source = source

    @classmethod
    def from_text(
        cls, text: str, seq_len: int, tokenizer: Tokenizer | None = None, *, source: str = "text"
    ) -> TokenBlockDataset:
        tokenizer = tokenizer or ByteTokenizer()
        return cls(torch.tensor(tokenizer.encode(text), dtype=torch.int32), seq_len, source=source)

    @classmethod
    def from_text_file(
        cls, path: str | os.PathLike[str], seq_len: int, tokenizer: Tokenizer | None = None
    ) -> TokenBlockDataset:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"training text file not found: {path}") from None
        except IsADirectoryError:
            raise DataError(f"training text file is a directory: {path}") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        return cls.from_text(text, seq_len, tokenizer, source=str(path))

    @classmethod
    def from_hf_dataset(
        cls,
        name: str,
        config_name: str | None,
        seq_len: int,
        tokenizer: Tokenizer,
        *,
        split: str = "train",
        text_column: str = "text",
    ) -> TokenBlockDataset:
        """Tokenize a Hugging Face dataset's text column, documents joined by newlines."""
        try:
            import datasets
        except ImportError as exc:
            raise DataError(
                f"--dataset_name {name!r} needs the 'datasets' package, which is not installed; "
                "install it, or train on a local file with --train_file"
            ) from exc
        data = datasets.load_dataset(name, config_name, split=split)
        if text_column not in data.column_names:
            raise DataError(
                f"dataset {name!r} split {split!r} has no column {text_column!r} "
                f"(columns: {', '.join(data.column_names)})"
            )
        text = "\n".join(row for row in data[text_column] if row)
        return cls.from_text(text, seq_len, tokenizer, source=f"dataset {name}/{config_name or ''}:{split}")

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} out of range for {len(self)} blocks")
        start = (index % len(self)) * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class SyntheticTokenDataset(Dataset):
    """Uniformly random token ids, for benchmarks where the data must cost nothing.

    Sample ``i`` comes from a generator seeded with ``seed + i``, so it is the same on every rank and run
    regardless of the order in which samples are read.
    """

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, *, seed: int = 0) -> None:
        if vocab_size <= 0 or seq_len <= 0 or num_samples <= 0:
            raise DataError(
                f"vocab_size, seq_len and num_samples must be positive, got {vocab_size}, {seq_len}, "
                f"{num_samples}"
            )
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_samples = num_samples
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        gen = torch.Generator().manual_seed(self.seed + index)
        chunk = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=gen)
        return chunk[:-1], chunk[1:]
