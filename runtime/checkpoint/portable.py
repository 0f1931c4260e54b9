"""Recover one fp32 state dict from a checkpoint folder with nothing but torch: dslaunch's sharded format
and DeepSpeed's ZeRO 1/2/3 format. This file is also the `zero_to_fp32.py` copied into every folder we save
(runtime.checkpoint.recovery_script), so it imports only the standard library and torch, never dslaunch.

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB]
                           [-t TAG] [--exclude_frozen_parameters] [-d]
    python zero_to_fp32.py CHECKPOINT_DIR pytorch_model.bin          # one output file (older form)

OUTPUT_DIR (created when missing) gets `pytorch_model.bin` or, with --safe_serialization,
`model.safetensors`, split into numbered shards plus an index JSON above --max_shard_size, as DeepSpeed
names them. An OUTPUT ending in .bin/.pt/.pth/.safetensors is one file. Exit codes: 0 written, 1 the
checkpoint cannot be read or the output cannot be written (one line on stderr says which file and why),
2 bad arguments.

DeepSpeed's layout, as read here: the tag folder holds `mp_rank_00_model_states.pt` (stages 1/2) or
`zero_pp_rank_R_mp_rank_00_model_states.pt` (stage 3) with `param_shapes` (per optimizer param group,
names and shapes in flat order), and one `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per rank with
the fp32 master partition and the Adam moments. Stages 1/2 cut each group's flat buffer (padded at its end)
into equal contiguous partitions; stage 3 cuts every parameter separately into ceil(numel / world) pieces.
The pickles name DeepSpeed classes (loss scaler, stage enum); `load_pickle` turns them into inert
placeholders, so reading needs no DeepSpeed and runs no code from the file.
"""

from __future__ import annotations

import json
import os
import pickle
import types
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar

import torch

# recovery-script: begin imports (the standalone script holds these modules one after another)
from runtime.checkpoint.deepspeed_layout import (
    FlatParam,
    numel_of,
    param_pieces,
    partitioned_layout,
    per_param_layout,
)
from runtime.checkpoint.portable_folders import (
    _DS_MODEL3,
    _DS_OPTIM,
    MANIFEST,
    RecoveryError,
    is_deepspeed_tag,
    model_parallel_root,
    pipeline_stages,
    resolve_tag,
)

# recovery-script: end imports


# -- pickles that name DeepSpeed classes ------------------------------------------------------------------
class Opaque:
    """Stands in for an object of a class this process does not have (DeepSpeed's loss scaler, its
    stage enum): the constructor arguments and state are kept as data, nothing of the class runs."""

    qualname = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _allowed() -> dict[str, Any]:
    try:  # the globals torch.load(weights_only=True) accepts: tensors, storages, dtypes, containers
        from torch._weights_only_unpickler import _get_allowed_globals

        return dict(_get_allowed_globals())
    except ImportError:  # a torch without that private helper: the same kinds of names, listed here
        import builtins

        allowed: dict[str, Any] = {"collections.OrderedDict": OrderedDict, "torch.Size": torch.Size}
        allowed.update({"torch.device": torch.device, "torch.Tensor": torch.Tensor})
        allowed["torch.nn.parameter.Parameter"] = torch.nn.Parameter
        allowed["torch._tensor._rebuild_from_type_v2"] = getattr(torch._tensor, "_rebuild_from_type_v2", None)
        for name in ("_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"):
            allowed[f"torch._utils.{name}"] = getattr(torch._utils, name, None)
        for name in ("set", "frozenset", "slice", "bytearray", "complex"):
            allowed[f"builtins.{name}"] = getattr(builtins, name)
        dtypes = {f"torch.{n}": v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
        return {**dtypes, **{k: v for k, v in allowed.items() if v is not None}}


class _Unpickler(pickle.Unpickler):
    allowed: ClassVar[dict[str, Any]] = {}

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in self.allowed:
            return self.allowed[key]
        return type(name, (Opaque,), {"qualname": key})


_safe_pickle = types.ModuleType("safe_pickle")
_safe_pickle.Unpickler = _Unpickler  # type: ignore[attr-defined]
_safe_pickle.load = pickle.load  # type: ignore[attr-defined]


def load_pickle(path: Path) -> Any:
    """torch.load a checkpoint file; only tensors and plain data are built, other classes become `Opaque`."""
    if not _Unpickler.allowed:
        _Unpickler.allowed = _allowed()
    if not path.is_file():
        raise RecoveryError(f"{path}: missing", "corrupted")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_safe_pickle, mmap=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecoveryError(f"{path}: cannot be read ({first}); the file is truncated or damaged") from None


# -- DeepSpeed files ---------------------------------------------------------------------------------------
COMPILED_PREFIX = "_orig_mod."  # the attribute of torch.compile's wrapper that holds the model


def without_compile_prefix(states: dict[str, Any], *, force: bool = False) -> dict[str, Any]:
    """DeepSpeed's model states with `_orig_mod.` taken off every name, where every parameter name starts
    with it (or `force`: a later rank's file of such a run). DeepSpeed names the weights through its
    module, so a model it was given `torch.compile`d is saved as `_orig_mod.<name>`: no uncompiled model
    has those names, and no engine here shows them (runtime.compile.unwrap_compiled)."""
    shapes = states.get("param_shapes") or []
    names = [name for group in shapes for name in group]
    if not force and not (names and all(name.startswith(COMPILED_PREFIX) for name in names)):
        return states

    def strip(name: Any) -> Any:
        return name.removeprefix(COMPILED_PREFIX) if isinstance(name, str) else name

    out = dict(states)
    out["param_shapes"] = [OrderedDict((strip(k), v) for k, v in group.items()) for group in shapes]
    for key in ("module", "frozen_param_shapes", "frozen_param_fragments", "shared_params"):
        if isinstance(out.get(key), dict):
            out[key] = OrderedDict((strip(k), strip(v)) for k, v in out[key].items())
    if out.get("buffer_names"):
        out["buffer_names"] = [strip(name) for name in out["buffer_names"]]
    return out


class DeepSpeedTag:
    """One tag folder written by DeepSpeed, opened lazily (files are memory-mapped). A run whose model
    DeepSpeed was given `torch.compile`d is read under the model's own names (`without_compile_prefix`)."""

    def __init__(self, tag_dir: Path) -> None:
        self.tag_dir = tag_dir
        names = sorted(p.name for p in tag_dir.iterdir()) if tag_dir.is_dir() else []
        optim = {int(m.group(1)): n for n in names if (m := _DS_OPTIM.match(n))}
        self.stage3 = any(_DS_MODEL3.match(n) for n in names)
        model = "zero_pp_rank_0_mp_rank_00_model_states.pt" if self.stage3 else "mp_rank_00_model_states.pt"
        states = load_pickle(tag_dir / model)
        if not isinstance(states, dict) or "param_shapes" not in states:
            raise RecoveryError(f"{tag_dir / model}: not a DeepSpeed model state file (no param_shapes)")
        self.model_states = without_compile_prefix(states)
        self.compiled = self.model_states is not states
        self.world = int(self.model_states.get("dp_world_size") or len(optim) or 1)
        config = self.model_states.get("ds_config") or {}
        stage = (config.get("zero_optimization") or {}).get("stage", 0) if isinstance(config, dict) else 0
        if not optim and not stage:
            raise RecoveryError(
                f"{tag_dir} has no *zero_pp_rank_*_optim_states.pt files: a DeepSpeed checkpoint without "
                "ZeRO (stage 0) keeps its optimizer in the model state file, which is not read here"
            )
        missing = [r for r in range(self.world) if r not in optim]
        if missing:
            bf16 = any(n.startswith("bf16_") for n in optim.values()) or (config.get("bf16") or {}).get(
                "enabled"
            )
            prefix = "bf16_" if bf16 else ""
            raise RecoveryError(
                f"{tag_dir / f'{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt'}: missing (the "
                f"DeepSpeed checkpoint was saved by {self.world} ranks)"
            )
        self.optim_files = [tag_dir / optim[r] for r in range(self.world)]
        self._optim: dict[int, dict[str, Any]] = {}
        self.param_shapes: list[OrderedDict[str, tuple[int, ...]]] = [
            OrderedDict((k, tuple(v)) for k, v in g.items()) for g in self.model_states["param_shapes"]
        ]
        if self.stage3:
            self.groups = per_param_layout(self.param_shapes, self.world)
        else:
            first = self.rank_state(0)  # rank 0 holds a full partition: the padding sits on the last rank
            sizes = [m.numel() + pad for m, pad in zip(first["masters"], first["paddings"], strict=True)]
            try:
                self.groups = partitioned_layout(self.param_shapes, sizes, self.world)
            except ValueError as error:
                raise RecoveryError(
                    f"{tag_dir}: {error} (the optimizer files do not match the model states)"
                ) from None

    @property
    def zero_stage(self) -> int:
        stage = self.rank_state(0).get("zero_stage")
        if isinstance(stage, Opaque) and stage.args:
            return int(stage.args[0])
        return int(stage) if isinstance(stage, int) else (3 if self.stage3 else 2)

    def rank_state(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s optimizer file, read once: masters, per-group optimizer states, param groups."""
        if rank not in self._optim:
            raw = load_pickle(self.optim_files[rank])
            try:
                osd = raw["optimizer_state_dict"]
                if self.stage3:
                    base = osd["optimizer_state_dict"]
                    masters = list(osd["fp32_flat_groups"])
                else:
                    base = osd["base_optimizer_state"]
                    masters = list(osd["single_partition_of_fp32_groups"])
            except (KeyError, TypeError) as error:
                raise RecoveryError(
                    f"{self.optim_files[rank]}: not a DeepSpeed ZeRO optimizer state ({error!r} missing)"
                ) from None
            states = [base["state"][i] for i in sorted(base["state"])] if base.get("state") else []
            held = [*masters, *(v for s in states for k, v in s.items() if k != "step")]
            strange = next((v for v in held if not torch.is_tensor(v)), None)
            if strange is not None:  # e.g. a tensor subclass this reader does not build
                raise RecoveryError(
                    f"{self.optim_files[rank]}: holds a "
                    f"{getattr(strange, 'qualname', type(strange).__name__)} where DeepSpeed writes tensors"
                )
            self._optim[rank] = {
                "masters": masters,
                "states": states,
                "param_groups": list(base.get("param_groups") or []),
                "paddings": list(osd.get("group_paddings") or [0] * len(masters)),
                "zero_stage": osd.get("zero_stage"),
            }
        return self._optim[rank]

    def tensor(self, rank: int, group: int, key: str) -> torch.Tensor:
        """Rank `rank`'s 1-D tensor of `key` ("fp32" master or an optimizer state) for group `group`."""
        state = self.rank_state(rank)
        if self.stage3:
            if key not in state.setdefault("joined", {}):  # the rank's sub-groups, one after another
                parts = state["masters"] if key == "fp32" else [s[key] for s in state["states"]]
                state["joined"][key] = torch.cat([t.reshape(-1) for t in parts])
            whole = state["joined"][key]
            g = self.groups[group]
            held = sum(b - a for a, b in g.ranges[rank])
            return whole.narrow(0, g.start[rank], held)
        if key == "fp32":
            return state["masters"][group].reshape(-1)
        return state["states"][group][key].reshape(-1)

    def state_keys(self) -> list[str]:
        states = self.rank_state(0)["states"]
        return [k for k, v in states[0].items() if torch.is_tensor(v) and v.dim() > 0] if states else []

    def full(self, group: int, param: FlatParam, key: str = "fp32") -> torch.Tensor:
        out = torch.empty(param.numel, dtype=torch.float32)
        filled = 0
        for r in range(self.world):
            src = self.tensor(r, group, key)
            for p, first, count, pos in param_pieces(self.groups[group], r):
                if p.name != param.name:
                    continue
                if pos + count > src.numel():
                    raise RecoveryError(
                        f"{self.optim_files[r]}: holds {src.numel()} elements of group {group}, parameter "
                        f"{p.name!r} needs {pos + count} (the file does not match its model state file)"
                    )
                out.narrow(0, first, count).copy_(src.narrow(0, pos, count))
                filled += count
        if filled != param.numel:
            raise RecoveryError(
                f"{self.tag_dir}: parameter {param.name!r} is incomplete ({filled} of {param.numel} elements)"
            )
        return out.view(param.shape)

    def frozen_params(self) -> dict[str, torch.Tensor]:
        """Parameters the optimizer did not train, as saved (in the run's dtype): whole in the model state
        file at stages 1/2; at stage 3 each rank's file holds its piece."""
        shapes = self.model_states.get("frozen_param_shapes") or {}
        if not shapes:
            return {}
        ranks = [self.model_states]
        if self.stage3:
            names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(1, self.world)]
            ranks += [
                without_compile_prefix(load_pickle(self.tag_dir / n), force=self.compiled) for n in names
            ]
        out = {}
        for name, shape in shapes.items():
            found = [(state.get("frozen_param_fragments") or {}).get(name) for state in ranks]
            pieces = [piece for piece in found if piece is not None]
            if len(pieces) < len(found):
                raise RecoveryError(f"{self.tag_dir}: frozen parameter {name!r} has no saved fragment")
            numel = numel_of(tuple(shape))
            out[name] = torch.cat([p.reshape(-1) for p in pieces]).narrow(0, 0, numel).view(tuple(shape))
        return out

    def fp32_state_dict(self, *, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        ms = self.model_states
        module = ms.get("module") or {}
        out: dict[str, torch.Tensor] = {}
        for name in ms.get("buffer_names") or []:
            if name in module:
                out[name] = module[name].clone()
        if not exclude_frozen_parameters:
            out.update(self.frozen_params())
        for g, group in enumerate(self.groups):
            for p in group.params:
                out[p.name] = self.full(g, p)
        for alias, target in (ms.get("shared_params") or {}).items():
            if target in out:
                out[alias] = out[target]
        return out


# -- dslaunch files ----------------------------------------------------------------------------------------
def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise RecoveryError(f"{path}: truncated (no header)")
        size = int.from_bytes(head, "little")
        try:
            return json.loads(f.read(size)), 8 + size
        except ValueError:
            raise RecoveryError(f"{path}: malformed header") from None


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def dslaunch_fp32_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Our format: manifest.json, safetensors shard files (checked against the manifest's size and CRC-32)."""
    try:
        manifest = json.loads((tag_dir / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecoveryError(
            f"{tag_dir} has no {MANIFEST}: the save of tag {tag_dir.name!r} did not finish", "incomplete"
        ) from None
    except ValueError as error:
        raise RecoveryError(f"{tag_dir / MANIFEST}: malformed ({error})") from None
    shards: dict[str, torch.Tensor] = {}
    for entry in manifest["files"]:
        path = tag_dir / entry["name"]
        if not path.is_file():
            raise RecoveryError(f"{path}: missing (the manifest of tag {manifest['tag']!r} lists it)")
        data = path.read_bytes()
        if len(data) != entry["size"]:  # the runtime's verify_files says the same
            raise RecoveryError(
                f"{path}: {len(data)} bytes, but the manifest recorded {entry['size']} "
                "(truncated or overwritten)"
            )
        if zlib.crc32(data) != entry["crc32"]:
            raise RecoveryError(
                f"{path}: checksum mismatch (crc32 {zlib.crc32(data):#010x}, manifest "
                f"{entry['crc32']:#010x}): the file is corrupted"
            )
        if entry["kind"] != "shard":
            continue
        header, base = _read_safetensors_header(path)
        for g in range(len(manifest["groups"])):
            spec = header[f"group{g}.fp32"]
            a, b = spec["data_offsets"]
            raw = bytearray(data[base + a : base + b])
            shards[f"{entry['name']}:{g}"] = (
                torch.frombuffer(raw, dtype=_ST_DTYPES[spec["dtype"]]) if raw else torch.empty(0)
            )
    params: dict[str, torch.Tensor] = {}
    for g, group in enumerate(manifest["groups"]):
        flat = torch.zeros(group["numel"], dtype=torch.float32)
        for entry in manifest["files"]:
            if entry["kind"] != "shard":
                continue
            src, pos = shards[f"{entry['name']}:{g}"], 0
            for a, b in entry["ranges"][g]:
                flat[a:b] = src[pos : pos + b - a].float()
                pos += b - a
        for p in group["params"]:
            n = numel_of(tuple(p["shape"]))
            params[p["name"]] = flat[p["offset"] : p["offset"] + n].view(tuple(p["shape"])).clone()
    state = load_pickle(tag_dir / "mp_rank_00_model_states.pt")
    extras = state.get("module_extras") or {}
    out: dict[str, torch.Tensor] = {}
    for mk in manifest["module_keys"]:
        if mk["param"] is not None:
            out[mk["key"]] = params[mk["param"]]
        elif torch.is_tensor(extras.get(mk["key"])):
            out[mk["key"]] = extras[mk["key"]]
    return out


def get_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None, *, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor]:
    """The fp32 state dict of a dslaunch or DeepSpeed checkpoint (pipeline stages merged)."""
    root = Path(checkpoint_dir)
    parallel = model_parallel_root(root)
    if parallel is not None:
        what, degree = parallel
        raise RecoveryError(
            f"{root} is a {what} checkpoint ({what} degree {degree}, one sub-folder per rank): its "
            "shards are not merged into one state dict here; pass one rank's sub-folder for its shard",
            "refused",
        )  # fmt: skip
    stages = pipeline_stages(root)
    if stages:
        merged: dict[str, torch.Tensor] = {}
        for stage in stages:
            for key, value in get_fp32_state_dict(
                stage, tag, exclude_frozen_parameters=exclude_frozen_parameters
            ).items():
                if key in merged and not torch.equal(merged[key], value):
                    raise RecoveryError(f"{root}: tied weight {key!r} differs between pipeline stages")
                merged[key] = value
        return merged
    tag_dir = resolve_tag(root, tag)
    if is_deepspeed_tag(tag_dir):
        return DeepSpeedTag(tag_dir).fp32_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
    return dslaunch_fp32_state_dict(tag_dir)
