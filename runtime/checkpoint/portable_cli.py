"""The zero_to_fp32 command: DeepSpeed's argument forms, the output files it names, exit codes.

Part of the standalone zero_to_fp32.py (recovery_script), so stdlib and torch only besides portable.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

# recovery-script: begin imports
from runtime.checkpoint.portable import _ST_DTYPES, RecoveryError, get_fp32_state_dict

# recovery-script: end imports

# -- output, in DeepSpeed's forms --------------------------------------------------------------------------
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]  # fmt: skip
    return int(float(m.group(1)) * scale)


def _write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file without the safetensors package (tied tensors are written as copies)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)

    def write(f: IO[bytes]) -> None:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for blob in blobs:
            f.write(blob)

    _write_atomically(path, write)


def _save_one(tensors: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    if safe:
        save_safetensors(tensors, path)
    else:
        _write_atomically(path, lambda f: torch.save(tensors, f))


def write_state_dict(
    state: dict[str, torch.Tensor], output: str | os.PathLike[str], *, safe_serialization: bool = False,
    max_shard_size: str | int | None = "5GB",
) -> list[Path]:  # fmt: skip
    """Write `state` as DeepSpeed's zero_to_fp32 does; returns the files written."""
    out = Path(output)
    if out.suffix in _FILE_SUFFIXES and not out.is_dir():  # the older form: one output file
        out.parent.mkdir(parents=True, exist_ok=True)
        _save_one({k: v.contiguous() for k, v in state.items()}, out, out.suffix == ".safetensors")
        return [out]
    out.mkdir(parents=True, exist_ok=True)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        if limit and shards[-1] and used + size > limit:
            shards.append({})
            used = 0
        shards[-1][name] = t.contiguous()
        used += size
    if len(shards) == 1:
        _save_one(shards[0], out / weights, safe_serialization)
        return [out / weights]
    stem, ext = weights.rsplit(".", 1)
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = out / f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        _save_one(shard, path, safe_serialization)
        files.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    index_path = out / f"{weights}.index.json"
    _write_atomically(index_path, lambda f: f.write((json.dumps(index, indent=2) + "\n").encode()))
    return [*files, index_path]


def parser(prog: str = "zero_to_fp32.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write the fp32 weights of a ZeRO checkpoint (dslaunch's or DeepSpeed's) as a state dict "
        "for model.load_state_dict. Needs only torch.",
        epilog="Exit codes: 0 written, 1 the checkpoint cannot be read or the output cannot be written, "
        "2 bad arguments.",
    )
    p.add_argument("checkpoint_dir", help="the folder that holds 'latest' (or a tag folder)")
    p.add_argument("output_dir", help="output folder (created when missing), or one file: pytorch_model.bin, "
                   "*.pt, *.pth, *.safetensors")  # fmt: skip
    p.add_argument(
        "--max_shard_size", default="5GB", help="largest output file before splitting (default 5GB)"
    )
    p.add_argument(
        "--safe_serialization", action="store_true", help="write model.safetensors, not pytorch_model.bin"
    )
    p.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    p.add_argument(
        "--exclude_frozen_parameters",
        action="store_true",
        help="leave frozen parameters out (DeepSpeed's checkpoints mark them; ours keep them with buffers)",
    )
    p.add_argument("-d", "--debug", action="store_true", help="print a line per tensor")
    return p


def main(argv: list[str] | None = None, prog: str = "zero_to_fp32.py", reader: Any = None) -> int:
    """The command; `reader(checkpoint_dir, tag, exclude_frozen_parameters)` defaults to this file's."""
    args = parser(prog).parse_args(argv)
    try:
        size = parse_size(args.max_shard_size)
    except ValueError as error:
        parser(prog).error(f"--max_shard_size: {error}")
    try:
        read = reader or (lambda d, t, x: get_fp32_state_dict(d, t, exclude_frozen_parameters=x))
        state = read(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
        if args.debug:
            for name, t in state.items():
                print(f"{name}: {tuple(t.shape)} {t.dtype}", flush=True)
        files = write_state_dict(
            state, args.output_dir, safe_serialization=args.safe_serialization, max_shard_size=size
        )
    except (RecoveryError, OSError, RuntimeError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        return 1
    numel = sum(t.numel() for t in state.values())
    where = files[0] if len(files) == 1 else f"{len(files) - 1} shards in {files[0].parent}"
    print(f"{prog}: {len(state)} tensors, {numel} elements written to {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
