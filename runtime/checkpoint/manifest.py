"""The checkpoint's table of contents: what was saved, how it is laid out, and how to check it.

A checkpoint directory looks like this (DeepSpeed's names where DeepSpeed has one)::

    save_dir/latest                          the newest complete tag (text), replaced atomically
    save_dir/<tag>/manifest.json             `Manifest`; written last: no manifest, no checkpoint
    save_dir/<tag>/mp_rank_00_model_states.pt          engine state (torch.save, loaded with weights_only)
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.safetensors   one per saving rank
    save_dir/.<tag>~new/                     a save in progress (staging); becomes <tag> when committed
    save_dir/.<tag>~old/                     the checkpoint it replaces, during the swap only
    save_dir/.checkpoint-commit.json         `PendingCommit`: a committed save still being swapped in

Model-parallel engines keep one such folder per part (`pipe_stage_SS_of_NN/`, `mp_rank_RR_of_NN/`,
`tp_rank_RR_of_NN/` inside save_dir), each with its own `latest`; the commit record stays in save_dir and
lists the parts. See runtime.checkpoint.commit for the order of the swap and why it is safe.

Layout, stage-independent: every flat group (a run of parameters laid out in one 1-D buffer, see
runtime.zero.partition) has a coordinate system, "flat index", given by its parameters' names, shapes
and offsets. Each rank's shard file holds, per group, 1-D tensors ("fp32" master weights plus one per
optimizer state key such as "exp_avg") whose elements are the concatenation of the flat ranges listed
for that file and group. Any new layout, world size or stage maps onto that by parameter name and
element range (runtime.checkpoint.reshard), so loading needs no conversion step.

Every file is listed with its size and CRC-32; a tag counts as complete only when its manifest exists.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.errors import UserError

FORMAT = "dslaunch-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
ENGINE_STATE = "mp_rank_00_model_states.pt"
MASTER_KEY = "fp32"  # the tensor name suffix of master weights in a shard file


def shard_file_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.safetensors"


def tensor_name(group: int, key: str) -> str:
    """Name of group `group`'s tensor for state `key` ("fp32", "exp_avg", ...) inside a shard file."""
    return f"group{group}.{key}"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which file or tag and why."""

    hint = "check the checkpoint directory and tag the message names"


class CheckpointNotFound(CheckpointError):
    """The directory, the tag, or the `latest` pointer is missing."""

    hint = "check the load directory and tag; its `latest` file names the newest complete save"


class CheckpointIncomplete(CheckpointError):
    """The tag directory has no manifest: its save never finished."""

    hint = "load an earlier tag (engine.load_checkpoint(dir, tag=...)); `latest` names the last complete one"


class CheckpointCorrupted(CheckpointError):
    """A file's size or checksum differs from the manifest, or its content is malformed."""

    hint = (
        "the file changed after it was saved (disk, copy or manual edit): load an earlier tag "
        "(engine.load_checkpoint(dir, tag=...)) or copy the checkpoint again"
    )


class CheckpointMismatch(CheckpointError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""

    hint = (
        "load it into the model and optimizer param groups it was saved from; load_module_strict=False "
        "skips parameters on one side only, load_optimizer_states=False loads the weights alone"
    )


class CheckpointRefused(CheckpointError):
    """A save that would write a useless checkpoint (non-finite weights, ranks disagreeing on the path)."""


class CheckpointWriteError(CheckpointError):
    """The filesystem refused a save (full, read-only, immutable, not writable, a file in the way)."""


# -- staging, and the commit record of a save being swapped in (runtime.checkpoint.commit writes them) ------
COMMIT_RECORD = ".checkpoint-commit.json"
COMMIT_FORMAT = "dslaunch-checkpoint-commit"
# '~' is not allowed in a tag, so no tag's own folder can look like a staging folder
_STAGED = re.compile(r"^\.(.+)~(new|old)$")


def staging_name(tag: str) -> str:
    """The folder a save of `tag` is written into before it is swapped in."""
    return f".{tag}~new"


def aside_name(tag: str) -> str:
    """The name the replaced checkpoint of `tag` has between the two renames of the swap."""
    return f".{tag}~old"


def staged_tag(name: str) -> str | None:
    """The tag of a staging or aside folder name; None for any other name."""
    match = _STAGED.match(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class PendingCommit:
    """A save whose every file is complete on every rank, recorded before any part is swapped in: from
    the moment this record exists the save is the checkpoint, whatever the swap has done so far."""

    tag: str
    latest: bool  # the save moves `latest` to `tag`
    parts: tuple[str, ...]  # the part folders, relative to the save directory ("." for itself)

    def to_json(self) -> str:
        return json.dumps({"format": COMMIT_FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> PendingCommit:
        try:
            raw = json.loads(text)
            if raw.get("format") != COMMIT_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            return cls(check_tag(raw["tag"]), bool(raw["latest"]), tuple(str(p) for p in raw["parts"]))
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointCorrupted(
                f"{where}: malformed commit record ({type(error).__name__}: {error})"
            ) from None


def read_commit(root: str | Path) -> PendingCommit | None:
    """The commit record in save directory `root`, None when there is none."""
    path = Path(root) / COMMIT_RECORD
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    return PendingCommit.from_json(text, str(path))


def pending_commit(folder: str | Path) -> PendingCommit | None:
    """The committed save that `folder` (a save directory, or a part folder inside one) is part of and
    that is not swapped in everywhere yet; None when there is none."""
    folder = Path(folder)
    for record_dir, part in ((folder, "."), (folder.parent, folder.name)):
        commit = read_commit(record_dir)
        if commit is not None and part in commit.parts:
            return commit
    return None


def current_tag_dir(folder: Path, tag: str, pending: PendingCommit | None) -> Path:
    """Where the complete files of `tag` are: its own folder, or, while a committed save of it is being
    swapped in and this part has not been swapped yet, that save's staging folder."""
    if pending is not None and pending.tag == tag and (folder / staging_name(tag)).is_dir():
        return folder / staging_name(tag)
    return folder / tag


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of a flat group."""

    name: str
    shape: tuple[int, ...]
    offset: int  # flat index of its first element

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GroupEntry:
    """One flat group: its parameters in flat order and the user's param group (the `model_parameters` /
    optimizer param group it came from, whatever the stage's own grouping) it belongs to."""

    optimizer_group: int
    numel: int  # padded flat size
    params: tuple[ParamEntry, ...]


@dataclass(frozen=True)
class FileEntry:
    """One file of the tag: checksum, and for shard files the flat ranges each group's tensors hold."""

    name: str
    kind: str  # "shard" | "engine_state"
    rank: int
    size: int
    crc32: int
    ranges: tuple[tuple[tuple[int, int], ...], ...] = ()  # per group: [(flat_start, flat_end), ...]


@dataclass(frozen=True)
class ModuleKey:
    """One entry of the module's state dict, in state-dict order: a trained parameter (by its flat-group
    name) or an extra (buffer or frozen parameter) stored in the engine state file."""

    key: str
    param: str | None = None  # name in a flat group; None: an extra


@dataclass(frozen=True)
class Manifest:
    tag: str
    world_size: int  # ranks that saved
    zero_stage: int
    param_dtype: str
    master_dtype: str
    groups: tuple[GroupEntry, ...]
    files: tuple[FileEntry, ...]
    module_keys: tuple[ModuleKey, ...]
    optimizer_class: str | None = None
    optimizer_state_keys: tuple[str, ...] = ()
    state_dtypes: dict[str, str] = field(default_factory=dict)  # state key -> dtype name
    format: str = FORMAT
    version: int = VERSION

    def shard_files(self) -> list[FileEntry]:
        return [f for f in self.files if f.kind == "shard"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise CheckpointCorrupted(f"{where}: not a dslaunch checkpoint manifest")
            if raw.get("version") != VERSION:
                raise CheckpointError(
                    f"{where}: checkpoint format version {raw.get('version')}; this runtime reads {VERSION}"
                )
            return cls(
                tag=raw["tag"],
                world_size=int(raw["world_size"]),
                zero_stage=int(raw["zero_stage"]),
                param_dtype=raw["param_dtype"],
                master_dtype=raw["master_dtype"],
                groups=tuple(
                    GroupEntry(
                        g["optimizer_group"],
                        g["numel"],
                        tuple(ParamEntry(p["name"], tuple(p["shape"]), p["offset"]) for p in g["params"]),
                    )
                    for g in raw["groups"]
                ),
                files=tuple(
                    FileEntry(
                        f["name"],
                        f["kind"],
                        f["rank"],
                        f["size"],
                        f["crc32"],
                        tuple(tuple((int(a), int(b)) for a, b in group) for group in f["ranges"]),
                    )
                    for f in raw["files"]
                ),
                module_keys=tuple(ModuleKey(k["key"], k["param"]) for k in raw["module_keys"]),
                optimizer_class=raw.get("optimizer_class"),
                optimizer_state_keys=tuple(raw.get("optimizer_state_keys", ())),
                state_dtypes=dict(raw.get("state_dtypes", {})),
            )
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointCorrupted(
                f"{where}: malformed manifest ({type(error).__name__}: {error})"
            ) from None


_TAG_OK = re.compile(r"^[A-Za-z0-9._+=@-]+$")


def check_tag(tag: str) -> str:
    """A tag is a single directory name."""
    if not isinstance(tag, str) or not _TAG_OK.match(tag) or tag in (".", ".."):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name (letters, digits and ._+=@- only)"
        )
    return tag


def read_latest(save_dir: str | Path) -> str | None:
    """The tag `latest` names, or None when there is no `latest` file. A committed save that a crash left
    half swapped in (`pending_commit`) is `latest` already if it moves `latest`."""
    pending = pending_commit(save_dir)
    if pending is not None and pending.latest:
        return pending.tag
    path = Path(save_dir) / LATEST
    try:
        return path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None


def complete_tags(root: str | os.PathLike[str]) -> list[str]:
    """The tags of `root`'s complete saves (folders holding a manifest), in natural order (step 10 after
    step 9), for messages that say what to pass."""
    folder = Path(root)
    if not folder.is_dir():
        return []
    names = [p.name for p in folder.iterdir() if (p / MANIFEST).is_file() and staged_tag(p.name) is None]
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def resolve_tag_dir(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The directory of `tag` (or of the tag `latest` names), with a clear error for each missing piece.
    A committed save that a crash left half swapped in counts as done (`pending_commit`)."""
    root = Path(load_dir)
    if root.exists() and not root.is_dir():
        raise CheckpointNotFound(
            f"{root} is a file, not a checkpoint directory",
            hint="pass the directory save_checkpoint was given (the one holding `latest` and the tag "
            "folders)",
        )
    if not root.is_dir():
        raise CheckpointNotFound(f"checkpoint directory {root} does not exist")
    pending = pending_commit(root)
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            found = complete_tags(root)
            if found:  # saved with save_latest=False, or `latest` lost: say which tags there are
                raise CheckpointNotFound(
                    f"{root} has no '{LATEST}' file; its complete tags: {', '.join(found)}",
                    hint=f"pass the tag to read (tag={found[-1]!r}, or --tag {found[-1]} on a command line)",
                )
            raise CheckpointNotFound(
                f"{root} has no '{LATEST}' file and no checkpoint tag folder (one holding {MANIFEST})",
                hint="pass the directory save_checkpoint was given (the one holding `latest` and the tag "
                "folders)",
            )
        if not tag:
            raise CheckpointCorrupted(f"{root / LATEST} is empty")
        tag_dir = current_tag_dir(root, check_tag(tag), pending)
        if not tag_dir.is_dir():
            raise CheckpointNotFound(f"{root / LATEST} names tag {tag!r}, but {tag_dir} does not exist")
        return tag_dir
    tag_dir = current_tag_dir(root, check_tag(str(tag)), pending)
    if not tag_dir.is_dir():
        if (root / staging_name(tag_dir.name)).is_dir():
            raise CheckpointIncomplete(
                f"the save of tag {tag_dir.name!r} in {root} did not finish (the process stopped while "
                f"writing it; its partial files are in {staging_name(tag_dir.name)}, which the next save "
                "removes), so it cannot be loaded"
            )
        available = complete_tags(root)
        hint = f"; complete tags there: {', '.join(available)}" if available else ""
        raise CheckpointNotFound(f"checkpoint tag {tag!r} not found: {tag_dir} does not exist{hint}")
    return tag_dir


def read_manifest(tag_dir: Path) -> Manifest:
    path = tag_dir / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointIncomplete(
            f"{tag_dir} has no {MANIFEST}: the save of tag {tag_dir.name!r} did not finish (the process "
            "stopped while writing it), so it cannot be loaded"
        ) from None
    manifest = Manifest.from_json(text, str(path))
    if manifest.tag != (staged_tag(tag_dir.name) or tag_dir.name):
        raise CheckpointCorrupted(f"{path} describes tag {manifest.tag!r}, but sits in {tag_dir}")
    return manifest
