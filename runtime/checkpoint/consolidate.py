"""One full state dict from a sharded checkpoint, for `model.load_state_dict`: the `ds_consolidate` command.

    ds_consolidate CHECKPOINT_DIR OUTPUT.safetensors [--tag TAG] [--dtype fp32|bf16|fp16] [--no_verify]

or in Python, with no process group::

    state_dict = get_fp32_state_dict_from_checkpoint("checkpoints")          # newest complete tag
    model.load_state_dict(state_dict)
    model.load_state_dict(load_state_dict_file("model.safetensors"))         # the command's output

It streams: the output header is planned from the manifest alone (names, shapes, dtypes), then each
tensor is assembled from the element ranges of the shard files that hold it (positioned reads, no
whole shard in memory), cast, written and dropped before the next one. Peak memory is about one tensor
plus the engine state file's small entries, whatever the model size. The output is a safetensors file
(written without the safetensors package), so any safetensors reader opens it too. Every file is
checked against the manifest's CRC-32 first unless --no_verify.

A folder written by DeepSpeed (ZeRO 1-3) is read too (`portable.DeepSpeedTag`: whole tensors, no
checksums to verify). The folder may be given in every form users pass (located.py): the save directory,
one tag's folder, or a pipeline checkpoint's root, whose stages' state dicts are merged (held whole, to
check that tied copies agree); a tensor-parallel root is refused with its degree.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoint.deepspeed_format import as_checkpoint_error
from runtime.checkpoint.load import open_checkpoint, read_engine_state, verify_files
from runtime.checkpoint.located import Located, locate
from runtime.checkpoint.manifest import (
    MASTER_KEY,
    CheckpointCorrupted,
    CheckpointError,
    CheckpointWriteError,
    Manifest,
    resolve_tag_dir,
)
from runtime.checkpoint.misplaced import misplaced_root
from runtime.checkpoint.portable import DeepSpeedTag, RecoveryError, is_deepspeed_tag
from runtime.checkpoint.reshard import Target, plan_copies, saved_shapes, source_index
from runtime.checkpoint.shards import ShardReader
from runtime.checkpoint.tensorfile import TensorFileError, TensorFileWriter, load_tensors

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ConsolidateResult:
    output: Path
    tag: str
    tensors: int
    bytes: int
    bytes_read: int  # from the shard files (the positioned reads), checksum pass excluded
    seconds: float


def _cast(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not value.is_floating_point() or value.dtype == dtype:
        return value
    return value.to(dtype)


def _entries(
    manifest: Manifest, extras: dict, dtype: torch.dtype | None
) -> list[tuple[str, torch.dtype, tuple]]:
    shapes = saved_shapes(manifest)
    master = getattr(torch, manifest.master_dtype)
    out = []
    for mk in manifest.module_keys:
        if mk.param is not None:
            out.append((mk.key, dtype or master, shapes[mk.param]))
            continue
        value = extras.get(mk.key)
        if not isinstance(value, torch.Tensor):
            continue  # non-tensor module state (get_extra_state) has no place in a tensor file
        out.append(
            (mk.key, dtype if dtype and value.is_floating_point() else value.dtype, tuple(value.shape))
        )
    return out


def iter_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    verify: bool = True,
    stats: dict | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) in the module's state-dict order, one tensor in memory at a time (a DeepSpeed folder
    or a pipeline root: read whole first)."""
    where = locate(checkpoint_dir, tag)
    if where.stages:
        for key, value in _merged_stages(where, verify=verify).items():
            yield key, _cast(value, dtype)
        return
    checkpoint_dir, tag = where.root, where.tag
    deepspeed = deepspeed_state_dict(checkpoint_dir, tag)
    if deepspeed is not None:
        for key, value in deepspeed.items():
            yield key, _cast(value, dtype)
        return
    tag_dir, manifest = open_checkpoint(checkpoint_dir, tag)
    if verify:
        verify_files(tag_dir, manifest)
    extras = read_engine_state(tag_dir)["module_extras"]
    index = source_index(manifest)
    shapes = saved_shapes(manifest)
    master = getattr(torch, manifest.master_dtype)
    reader = ShardReader(tag_dir)
    try:
        for mk in manifest.module_keys:
            if mk.param is None:
                if mk.key in extras:
                    yield mk.key, _cast(extras[mk.key], dtype)
                continue
            shape = shapes[mk.param]
            numel = 1
            for d in shape:
                numel *= d
            flat = torch.empty(numel, dtype=master)
            reader.fill(flat, plan_copies(index, [Target(mk.param, 0, 0, numel)]), MASTER_KEY)
            yield mk.key, _cast(flat.view(shape), dtype)
    finally:
        if stats is not None:
            stats["bytes_read"] = reader.bytes_read
        reader.close()


def deepspeed_state_dict(
    checkpoint_dir: str | os.PathLike[str], tag: str | None, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """The fp32 state dict when `checkpoint_dir`'s tag was written by DeepSpeed, else None (also for a
    pipeline root)."""
    where = locate(checkpoint_dir, tag)
    if where.stages:
        return None
    tag_dir = resolve_tag_dir(where.root, where.tag)
    if not is_deepspeed_tag(tag_dir):
        return None
    try:
        return DeepSpeedTag(tag_dir).fp32_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    except RecoveryError as error:
        raise as_checkpoint_error(error) from None


def get_fp32_state_dict_from_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The full model state dict (trained parameters as fp32 master weights, buffers as saved) of tag
    `tag`, or of the tag `latest` names. Needs no process group and reshards any saved world size.
    `checkpoint_dir` may also be one tag's folder, or a pipeline root (its stages merged)."""
    return dict(iter_state_dict(checkpoint_dir, tag, verify=verify))


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    tag: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
) -> ConsolidateResult:
    """Write the full state dict of a sharded checkpoint to one safetensors file, tensor by tensor."""
    start = time.perf_counter()
    output = Path(output)
    if output.is_dir():
        output = output / "model.safetensors"
    where = locate(checkpoint_dir, tag)
    if where.stages:  # the first stage's tag names the whole pipeline's
        first = resolve_tag_dir(where.stages[0], where.tag)
        return _write_whole(_merged_stages(where, verify=verify), output, first, dtype, start)
    checkpoint_dir, tag = where.root, where.tag
    deepspeed = deepspeed_state_dict(checkpoint_dir, tag)
    if deepspeed is not None:
        return _write_whole(deepspeed, output, resolve_tag_dir(checkpoint_dir, tag), dtype, start)
    tag_dir, manifest = open_checkpoint(checkpoint_dir, tag)
    extras = read_engine_state(tag_dir)["module_extras"]
    declared = _entries(manifest, extras, dtype)
    wanted = {name for name, _, _ in declared}
    metadata = {"format": "pt", "source": str(tag_dir), "tag": manifest.tag}
    stats: dict = {}
    with _writing(output), TensorFileWriter(output, declared, metadata) as writer:
        for key, tensor in iter_state_dict(
            checkpoint_dir, manifest.tag, dtype=dtype, verify=verify, stats=stats
        ):
            if key in wanted:
                writer.write(key, tensor.contiguous())
        record = writer.commit()
    return ConsolidateResult(
        output,
        manifest.tag,
        len(declared),
        record.size,
        stats.get("bytes_read", 0),
        time.perf_counter() - start,
    )


def _write_whole(
    state: dict[str, torch.Tensor], output: Path, tag_dir: Path, dtype: torch.dtype, start: float
) -> ConsolidateResult:
    tensors = {key: _cast(value, dtype).contiguous() for key, value in state.items()}
    declared = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
    metadata = {"format": "pt", "source": str(tag_dir), "tag": tag_dir.name}
    with _writing(output), TensorFileWriter(output, declared, metadata) as writer:
        for key, t in tensors.items():
            writer.write(key, t)
        record = writer.commit()
    read = sum(t.numel() * 4 for t in state.values())
    return ConsolidateResult(
        output, tag_dir.name, len(declared), record.size, read, time.perf_counter() - start
    )


def _merged_stages(where: Located, *, verify: bool) -> dict[str, torch.Tensor]:
    """A pipeline root's stages as one state dict (parameter names carry global layer indices, so they add
    up); a tied weight that several stages hold must agree."""
    merged: dict[str, torch.Tensor] = {}
    for stage in where.stages:
        for key, value in iter_state_dict(stage, where.tag, verify=verify):
            if key in merged and not torch.equal(merged[key], value):
                raise CheckpointCorrupted(
                    f"{where.root}: {key} differs between the pipeline stages holding it (a tied weight out "
                    "of step?)",
                    hint="save from one run: every stage's folder of the same step",
                )
            merged[key] = value
    return merged


@contextlib.contextmanager
def _writing(output: Path) -> Iterator[None]:
    """Create the output's folder; a write the filesystem refuses (read-only, full, a file in the way)
    becomes one line naming the output and the cause, not the errno of the writer's temporary file."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        yield
    except OSError as error:
        cause = error.strerror or type(error).__name__
        where = f" ({error.filename})" if error.filename and Path(error.filename) in output.parents else ""
        raise CheckpointWriteError(
            f"cannot write {output}: {cause}{where}",
            hint="give an output path in a folder you can write to, with free space",
        ) from None


def load_state_dict_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a `ds_consolidate` output (any safetensors file) into a state dict."""
    try:
        return load_tensors(path)
    except TensorFileError as error:
        raise CheckpointError(str(error)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds_consolidate",
        description="Turn a sharded dslaunch checkpoint into one state dict file (safetensors) for "
        "model.load_state_dict, streaming tensor by tensor.",
        epilog="Exit codes: 0 written, 1 the checkpoint cannot be read (missing, incomplete, corrupted), "
        "2 bad arguments. Load the output with runtime.checkpoint.load_state_dict_file(path) or "
        "safetensors.torch.load_file(path).",
    )
    parser.add_argument(
        "checkpoint_dir",
        help="the save_dir given to engine.save_checkpoint (or one tag's folder in it, or a pipeline's root)",
    )
    parser.add_argument(
        "output", help="output file, OUTPUT.safetensors (or a directory: OUTPUT/model.safetensors)"
    )
    parser.add_argument("-t", "--tag", help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default="fp32", help="dtype of floating-point tensors"
    )
    parser.add_argument("--no_verify", action="store_true", help="skip the CRC-32 check of the shard files")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    output = Path(args.output)
    if args.output.endswith(os.sep):
        output = output / "model.safetensors"
    if output.suffix != ".safetensors" and not output.is_dir():
        parser.error(f"OUTPUT {args.output!r} must end in .safetensors (or be a directory)")
    try:
        where = locate(args.checkpoint_dir, args.tag)  # a tag folder is read in place
        misplaced = misplaced_root(where.root, "ds_consolidate", tag=where.tag)  # one stage: name the root
        if misplaced is not None:
            raise misplaced
        result = consolidate_checkpoint(
            where.root, output, where.tag, dtype=_DTYPES[args.dtype], verify=not args.no_verify
        )
    except (CheckpointError, TensorFileError, OSError) as error:
        hint = getattr(error, "hint", "")
        print(f"ds_consolidate: error: {error}", file=sys.stderr, flush=True)
        if hint:
            print(f"ds_consolidate: hint: {hint}", file=sys.stderr, flush=True)
        return 1
    print(
        f"ds_consolidate: tag {result.tag}: {result.tensors} tensors, {result.bytes / 2**20:.1f} MiB "
        f"({args.dtype}) written to {result.output} in {result.seconds:.1f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
