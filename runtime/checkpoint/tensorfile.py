"""Tensor files in the safetensors layout, written and read without the safetensors package.

Layout (the public safetensors format, so the files open with any safetensors reader too): an 8-byte
little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the raw little-endian bytes
of every tensor back to back in header order.

Why this format for shards: there is no pickle in it, so reading a checkpoint cannot run code; every
tensor's bytes sit at an offset known from the header, so a rank reads exactly the element ranges it
needs with positioned reads (resharding, consolidation) and memory stays at what it asked for; and the
writer streams: declare the tensors, then write them one by one (or chunk by chunk) from wherever they
live, with no copy of the whole file in memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.checkpoint.durable import DurableFile, FileRecord
from runtime.errors import UserError

_DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):  # fmt: skip
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_MAX_HEADER = 256 << 20
_WRITE_CHUNK = 64 << 20  # bytes per device-to-host copy when writing from an accelerator


class TensorFileError(UserError, ValueError):
    """A tensor file is missing, truncated or malformed; the message names the file."""

    hint = (
        "the file was damaged or replaced after it was written: load an earlier checkpoint tag, or save again"
    )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: name, dtype, shape, and (once planned) where its bytes are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0  # byte offset inside the data section
    end: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TensorFileError(f"dtype {dtype} cannot be stored in a safetensors file") from None


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorSpec]]:
    """The encoded header (length prefix included) and the byte range of each tensor, in the given order."""
    specs: list[TensorSpec] = []
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in tensors:
        if name in entries or name == "__metadata__":
            raise TensorFileError(f"tensor name {name!r} appears twice")
        spec = TensorSpec(name, dtype, tuple(int(d) for d in shape))
        size = spec.numel * _element_size(dtype)
        spec = TensorSpec(spec.name, dtype, spec.shape, offset, offset + size)
        entries[name] = {
            "dtype": dtype_code(dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        specs.append(spec)
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, specs


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


class TensorFileWriter:
    """Writes a safetensors file durably: declare every tensor up front, then `write` them in order.

    A tensor may arrive in several consecutive pieces (`write` appends), so a shard can be written
    straight from its views without assembling it first.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        header, self.specs = plan_header(tensors, metadata)
        self._out = DurableFile(path)
        self._out.write(header)
        self._index = 0
        self._written = 0  # bytes of the current tensor so far

    def write(self, name: str, data: torch.Tensor) -> None:
        """Append `data` (any device, the declared dtype) to tensor `name`, which must be the current one."""
        spec = self._current(name)
        if data.dtype != spec.dtype:
            raise TensorFileError(f"tensor {name!r} was declared {spec.dtype}, got {data.dtype}")
        size = data.numel() * data.element_size()
        if self._written + size > spec.end - spec.begin:
            raise TensorFileError(f"tensor {name!r}: more data than its declared shape {list(spec.shape)}")
        flat = data.detach().reshape(-1)
        if flat.device.type == "cpu":
            self._out.write(tensor_bytes(flat.contiguous()))
        else:
            step = max(1, _WRITE_CHUNK // max(1, flat.element_size()))
            for start in range(0, flat.numel(), step):
                self._out.write(tensor_bytes(flat[start : start + step].to("cpu")))
        self._written += size
        if self._written == spec.end - spec.begin:
            self._index += 1
            self._written = 0

    def _current(self, name: str) -> TensorSpec:
        if self._index >= len(self.specs):
            raise TensorFileError(f"tensor {name!r} was not declared (all declared tensors are written)")
        spec = self.specs[self._index]
        if spec.name != name:
            raise TensorFileError(
                f"tensors must be written in declared order: expected {spec.name!r}, got {name!r}"
            )
        return spec

    def commit(self) -> FileRecord:
        """Check every declared byte was written, then make the file durable under its name."""
        while self._index < len(self.specs) and self.specs[self._index].end == self.specs[self._index].begin:
            self._index += 1  # empty tensors need no write
        if self._index != len(self.specs):
            missing = self.specs[self._index]
            self._out.abort()
            raise TensorFileError(f"tensor {missing.name!r} was declared but not (fully) written")
        return self._out.commit()

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, kind: object, error: object, tb: object) -> None:
        if kind is not None:
            self.abort()


class TensorFileReader:
    """Positioned reads of whole tensors or element ranges from a safetensors file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise TensorFileError(f"{self.path}: file not found") from None
        try:
            self.specs, self.metadata, self._data_start = self._read_header()
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self.bytes_read = 0

    def _read_header(self) -> tuple[dict[str, TensorSpec], dict[str, str], int]:
        size = os.fstat(self._fd).st_size
        prefix = os.pread(self._fd, 8, 0)
        if len(prefix) < 8:
            raise TensorFileError(f"{self.path}: truncated ({size} bytes; not even a header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_MAX_HEADER, size - 8):
            raise TensorFileError(
                f"{self.path}: corrupt or truncated header (length field {length}, file {size} bytes)"
            )
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise TensorFileError(f"{self.path}: corrupt header ({error})") from None
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path}: corrupt header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        specs: dict[str, TensorSpec] = {}
        data_size = size - 8 - length
        end_of_data = 0
        for name, entry in header.items():
            try:
                dtype = _CODE_DTYPES[entry["dtype"]]
                begin, end = (int(x) for x in entry["data_offsets"])
                spec = TensorSpec(name, dtype, tuple(int(d) for d in entry["shape"]), begin, end)
            except (KeyError, TypeError, ValueError):
                raise TensorFileError(f"{self.path}: corrupt header entry for {name!r}: {entry!r}") from None
            if end - begin != spec.numel * _element_size(dtype) or begin < 0:
                raise TensorFileError(f"{self.path}: tensor {name!r} has inconsistent offsets {begin}..{end}")
            specs[name] = spec
            end_of_data = max(end_of_data, end)
        if end_of_data != data_size:
            raise TensorFileError(
                f"{self.path}: truncated or padded: the header describes {end_of_data} data bytes, the file "
                f"holds {data_size}"
            )
        return specs, dict(metadata), 8 + length

    def spec(self, name: str) -> TensorSpec:
        try:
            return self.specs[name]
        except KeyError:
            raise TensorFileError(f"{self.path}: no tensor named {name!r}") from None

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill the contiguous CPU tensor `out` with elements [start, start + out.numel()) of tensor `name`
        (flattened); `out` must have the stored dtype."""
        spec = self.spec(name)
        if out.dtype != spec.dtype:
            raise TensorFileError(f"{self.path}: {name!r} is {spec.dtype}, cannot read into {out.dtype}")
        if start < 0 or start + out.numel() > spec.numel:
            raise TensorFileError(
                f"{self.path}: elements [{start}, {start + out.numel()}) are outside {name!r} ({spec.numel})"
            )
        view = tensor_bytes(out)
        offset = self._data_start + spec.begin + start * out.element_size()
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise TensorFileError(f"{self.path}: truncated while reading {name!r}")
            done += n
        self.bytes_read += done
        return out

    def read(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of tensor `name` as a new 1-D CPU tensor (numel None: all)."""
        spec = self.spec(name)
        count = spec.numel - start if numel is None else numel
        return self.read_into(name, torch.empty(count, dtype=spec.dtype), start)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, shaped."""
        spec = self.spec(name)
        return self.read(name).view(spec.shape)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)


def save_tensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> FileRecord:
    """Write a dict of tensors (in dict order) as one durable safetensors file."""
    declared = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with TensorFileWriter(path, declared, metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        return writer.commit()


def load_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, in file order (e.g. a `ds_consolidate` output)."""
    with TensorFileReader(path) as reader:
        order = sorted(reader.specs.values(), key=lambda s: s.begin)
        return {spec.name: reader.tensor(spec.name) for spec in order}
