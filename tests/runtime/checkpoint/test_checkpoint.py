"""Checkpoint parts without processes: the tensor file format, resharding math, tag resolution and its
errors, what engine state may hold, durable writes, and the resumable data loader."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import pytest
import torch

from runtime.checkpoint.data_position import ResumableDataLoader, ResumableSampler
from runtime.checkpoint.durable import DurableFile, file_crc32
from runtime.checkpoint.engine_state import check_loadable
from runtime.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointIncomplete,
    CheckpointNotFound,
    FileEntry,
    GroupEntry,
    Manifest,
    ParamEntry,
    read_manifest,
    resolve_tag_dir,
)
from runtime.checkpoint.reshard import Target, plan_copies, source_index
from runtime.checkpoint.shards import saved_pieces
from runtime.checkpoint.tensorfile import TensorFileError, TensorFileReader, TensorFileWriter, save_tensors
from runtime.zero.partition import plan_flat_layout

# ------------------------------------------------------------------------------------------ tensor files


def test_tensor_file_round_trips_every_dtype_and_reads_element_ranges(tmp_path: Path) -> None:
    tensors = {
        "f32": torch.randn(5, 7),
        "bf16": torch.randn(33).to(torch.bfloat16),
        "f16": torch.randn(2, 3).half(),
        "i64": torch.arange(10),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0),
    }
    record = save_tensors(tmp_path / "t.safetensors", tensors, {"k": "v"})
    assert record.size == (tmp_path / "t.safetensors").stat().st_size
    assert (record.size, record.crc32) == file_crc32(tmp_path / "t.safetensors")
    with TensorFileReader(tmp_path / "t.safetensors") as reader:
        assert reader.metadata == {"k": "v"}
        for name, tensor in tensors.items():
            assert torch.equal(reader.tensor(name), tensor), name
        assert torch.equal(reader.read("f32", 9, 4), tensors["f32"].reshape(-1)[9:13])
        assert reader.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values()) + 16


def test_tensor_file_layout_is_the_public_safetensors_format(tmp_path: Path) -> None:
    """8-byte little-endian header length, JSON header padded to 8, data back to back in header order."""
    a, b = torch.arange(3, dtype=torch.float32), torch.arange(2, dtype=torch.int64)
    save_tensors(tmp_path / "t.safetensors", {"a": a, "b": b})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["b"] == {"dtype": "I64", "shape": [2], "data_offsets": [12, 28]}
    assert raw[8 + n :] == a.numpy().tobytes() + b.numpy().tobytes()


def test_tensor_file_written_in_pieces_and_refusing_wrong_order(tmp_path: Path) -> None:
    data = torch.arange(10, dtype=torch.float32)
    with TensorFileWriter(
        tmp_path / "p.safetensors", [("x", torch.float32, (10,)), ("y", torch.float32, (1,))]
    ) as w:
        w.write("x", data[:4])
        w.write("x", data[4:])
        with pytest.raises(TensorFileError, match="declared order"):
            w.write("z", data[:1])
        w.write("y", data[:1])
        w.commit()
    with TensorFileReader(tmp_path / "p.safetensors") as reader:
        assert torch.equal(reader.tensor("x"), data)
    with TensorFileWriter(tmp_path / "q.safetensors", [("x", torch.float32, (10,))]) as w:
        w.write("x", data[:3])
        with pytest.raises(TensorFileError, match="not \\(fully\\) written"):
            w.commit()
    assert not (tmp_path / "q.safetensors").exists()
    assert not list(tmp_path.glob(".q.safetensors.tmp-*"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-5], "truncated or padded"),
        (lambda raw: raw[:6], "truncated"),
        (lambda raw: struct.pack("<Q", 10**12) + raw[8:], "corrupt or truncated header"),
        (lambda raw: raw[:8] + b"X" + raw[9:], "corrupt header"),
    ],
)
def test_damaged_tensor_file_is_a_clear_error_naming_the_file(tmp_path: Path, damage, message: str) -> None:
    path = tmp_path / "shard.safetensors"
    save_tensors(path, {"x": torch.randn(100)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TensorFileError, match=message) as info:
        TensorFileReader(path)
    assert str(path) in str(info.value)


def test_durable_file_appears_only_on_commit(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    out = DurableFile(target)
    out.write(b"hello")
    assert not target.exists()
    record = out.commit()
    assert target.read_bytes() == b"hello" and record.size == 5
    with pytest.raises(RuntimeError), DurableFile(target) as again:
        again.write(b"other")
        raise RuntimeError("crash while writing")
    assert target.read_bytes() == b"hello"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


# ------------------------------------------------------------------------------------------- resharding


def _manifest_for(numels: list[int], world: int, bucket: int, replicated: bool = False) -> Manifest:
    """A manifest as W saving ranks of a flat group would write it (layout for `world`, or replicated)."""
    layout = plan_flat_layout(numels, world_size=1 if replicated else world, bucket_numel=bucket, align=4)
    params = tuple(
        ParamEntry(f"p{i}", (n,), s.offset) for i, (n, s) in enumerate(zip(numels, layout.slots, strict=True))
    )
    files = []
    for rank in range(world):
        pieces = saved_pieces(layout, 0 if replicated else rank, world, rank)
        ranges = (tuple((p.flat_start, p.flat_end) for p in pieces),)
        files.append(FileEntry(f"r{rank}", "shard", rank, 0, 0, ranges))
    return Manifest(
        "t", world, 0, "float32", "float32", (GroupEntry(0, layout.numel, params),), tuple(files), ()
    )


def _saved_tensors(manifest: Manifest, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each file's group-0 tensor holds, built from the true parameter values."""
    group = manifest.groups[0]
    flat = torch.full((group.numel,), float("nan"))
    for p in group.params:
        flat[p.offset : p.offset + p.numel] = values[p.name]
    return {f.name: torch.cat([flat[a:b] for a, b in f.ranges[0]]) for f in manifest.files}


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize(
    ("old_world", "new_world", "old_bucket", "new_bucket"),
    [(2, 3, 40, 25), (3, 1, 9, 1000), (1, 4, 1000, 17), (4, 2, 17, 17)],
)
def test_resharding_fills_every_element_of_any_new_layout(
    replicated: bool, old_world: int, new_world: int, old_bucket: int, new_bucket: int
) -> None:
    numels = [13, 1, 30, 7, 64, 5, 2]
    values = {f"p{i}": torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)}
    manifest = _manifest_for(numels, old_world, old_bucket, replicated)
    stored = _saved_tensors(manifest, values)
    index = source_index(manifest)
    new = plan_flat_layout(numels, world_size=new_world, bucket_numel=new_bucket, align=8)
    for rank in range(new_world):
        targets = [
            Target(f"p{p.param}", p.param_offset, p.shard_offset, p.numel) for p in new.param_pieces(rank)
        ]
        shard = torch.zeros(new.shard_numel)
        for c in plan_copies(index, targets):
            shard[c.dst_offset : c.dst_offset + c.numel] = stored[c.file][
                c.src_offset : c.src_offset + c.numel
            ]
        for piece in new.param_pieces(rank):
            want = values[f"p{piece.param}"][piece.param_offset : piece.param_offset + piece.numel]
            assert torch.equal(shard[piece.shard_offset : piece.shard_offset + piece.numel], want)


def test_replicated_state_is_written_in_equal_slices_by_every_rank() -> None:
    layout = plan_flat_layout([100, 30], world_size=1, bucket_numel=60, align=4)
    slices = [saved_pieces(layout, 0, 3, r) for r in range(3)]
    covered = [(p.flat_start, p.flat_end) for pieces in slices for p in pieces]
    assert covered[0][0] == 0 and covered[-1][1] == layout.numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    sizes = [sum(p.numel for p in pieces) for pieces in slices]
    assert max(sizes) - min(sizes) <= 1


def test_a_missing_shard_is_named_not_silently_zero() -> None:
    manifest = _manifest_for([50, 50], 2, 1000)
    partial = Manifest(**{**manifest.__dict__, "files": manifest.files[:1]})
    with pytest.raises(CheckpointError, match=r"no data for elements \[\d+, 50\) of parameter 'p\d'"):
        plan_copies(source_index(partial), [Target("p0", 0, 0, 50), Target("p1", 0, 50, 50)])
    with pytest.raises(CheckpointError, match="parameter 'nope' is not in the checkpoint"):
        plan_copies(source_index(manifest), [Target("nope", 0, 0, 1)])


# -------------------------------------------------------------------------------------- tags and manifest


def test_tag_resolution_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        resolve_tag_dir(tmp_path / "nowhere", None)
    with pytest.raises(CheckpointNotFound, match="has no 'latest' file"):
        resolve_tag_dir(tmp_path, None)
    (tmp_path / "latest").write_text("global_step7")
    with pytest.raises(CheckpointNotFound, match=r"names tag 'global_step7', but .* does not exist"):
        resolve_tag_dir(tmp_path, None)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / MANIFEST).write_text("{}")
    with pytest.raises(CheckpointNotFound, match=r"tag 'other' not found.*complete tags there: good"):
        resolve_tag_dir(tmp_path, "other")
    with pytest.raises(CheckpointError, match="not a plain directory name"):
        resolve_tag_dir(tmp_path, "../escape")
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointIncomplete, match="save of tag 'half' did not finish"):
        read_manifest(tmp_path / "half")
    with pytest.raises(CheckpointError, match="not a dslaunch checkpoint manifest"):
        read_manifest(tmp_path / "good")


def test_manifest_round_trips_through_json() -> None:
    manifest = _manifest_for([5, 9], 2, 8)
    assert Manifest.from_json(manifest.to_json(), "m") == manifest


def test_engine_state_refuses_values_that_would_need_code_to_load() -> None:
    check_loadable({"step": 3, "lr": [1e-3], "t": torch.ones(2), "nested": {"ok": (1, "a", None)}}, "x")
    with pytest.raises(CheckpointError, match=r"client_state\['nested'\]\['bad'\] is a pathlib.PosixPath"):
        check_loadable({"nested": {"bad": Path("/tmp")}}, "client_state")


# ------------------------------------------------------------------------------------------ data loader


def _loader(world: int, rank: int, batch: int = 2) -> ResumableDataLoader:
    data = torch.arange(40)
    sampler = ResumableSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
    return ResumableDataLoader(data, batch_size=batch, sampler=sampler)


def test_data_loader_resumes_at_the_same_global_sample_at_any_world_size() -> None:
    served: list[int] = []
    saved = []
    for rank in range(2):
        loader = _loader(2, rank, batch=3)
        loader.sampler.set_epoch(4)
        it = iter(loader)
        for _ in range(2):
            served += next(it).tolist()
        saved.append(loader.state_dict())
    assert saved[0] == {"epoch": 4, "consumed": 6, "world_size": 2}
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5 + 4)).tolist()
    assert sorted(served) == sorted(order[:12])
    for world in (1, 2, 3, 4):
        rest: list[int] = []
        for rank in range(world):
            loader = _loader(world, rank)
            loader.load_state_dict(saved[0])
            rest += [int(i) for batch in loader for i in batch]
        # the rest of the same shuffled epoch (DistributedSampler pads it to a multiple of the world size)
        padded = order + order[: -len(order) % world]
        assert sorted(rest) == sorted(padded[12:]), world
    fresh = _loader(2, 0)
    fresh.load_state_dict(saved[0])
    fresh.sampler.set_epoch(5)  # a new epoch starts from its beginning
    assert len(list(fresh)) == 10
