"""Flat-buffer index math (runtime.zero.partition): slots, buckets, pieces and shards, no processes."""

from __future__ import annotations

import random

import pytest

from runtime.zero.partition import align_up, intersect, plan_flat_layout


def test_align_up_and_intersect() -> None:
    assert [align_up(n, 8) for n in (0, 1, 8, 9, 16)] == [0, 8, 8, 16, 16]
    assert intersect(0, 10, 5, 20) == (5, 10)
    assert intersect(0, 5, 5, 10) is None  # half-open ranges that only touch do not overlap
    assert intersect(3, 4, 0, 100) == (3, 4)


def test_small_layout_by_hand() -> None:
    # sizes 5, 100, 30 with align 8, buckets of <= 128 elements, 3 ranks
    layout = plan_flat_layout([5, 100, 30], world_size=3, bucket_numel=128, align=8)
    # param 1 starts at the next multiple of 8; param 2 would end at 142 > 128, so it opens bucket 1
    assert [(s.offset, s.numel, s.bucket) for s in layout.slots] == [(0, 5, 0), (8, 100, 0), (120, 30, 1)]
    # bucket 0 holds 108 elements, padded to a multiple of 3*8 = 24 -> 120; bucket 1: 30 -> 48
    assert [(b.start, b.numel, b.params, b.shard_offset) for b in layout.buckets] == [
        (0, 120, (0, 1), 0),
        (120, 48, (2,), 40),
    ]
    assert layout.numel == 168 and layout.shard_numel == 56
    assert layout.buckets[0].piece(2) == (80, 120)
    assert layout.buckets[1].piece(1) == (136, 152)
    # rank 1 holds param 1's elements 32..71 (flat 40..79) and param 2's elements 16..29 (flat 136..149)
    assert [(p.param, p.param_offset, p.shard_offset, p.numel) for p in layout.param_pieces(1)] == [
        (1, 32, 0, 40),
        (2, 16, 40, 14),
    ]


def test_layout_invariants_on_random_sizes() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        world = rng.randint(1, 5)
        align = rng.choice([1, 4, 64])
        numels = [rng.choice([0, 1, 3, 17, 64, 100, 1000]) for _ in range(rng.randint(1, 12))]
        bucket_numel = rng.choice([1, 50, 300, 10**9])
        layout = plan_flat_layout(numels, world_size=world, bucket_numel=bucket_numel, align=align)

        # buckets tile [0, numel) and split evenly over ranks at aligned offsets
        cursor = shard = 0
        for index, bucket in enumerate(layout.buckets):
            assert bucket.index == index and bucket.start == cursor
            assert bucket.numel % (world * align) == 0 and bucket.numel > 0
            assert bucket.shard_offset == shard
            cursor, shard = bucket.end, shard + bucket.piece_numel
        assert cursor == layout.numel and shard == layout.shard_numel
        assert layout.numel == layout.shard_numel * world

        # every parameter is aligned, inside its bucket, and parameters do not overlap
        previous_end = 0
        for index, (slot, numel) in enumerate(zip(layout.slots, numels, strict=True)):
            bucket = layout.buckets[slot.bucket]
            assert slot.numel == numel and slot.offset % align == 0
            assert bucket.start <= slot.offset and slot.offset + numel <= bucket.end
            assert index in bucket.params
            assert slot.offset >= previous_end
            previous_end = slot.offset + numel
            # a bucket only grows past bucket_numel when a single parameter is that large
            if len(bucket.params) > 1:
                first = layout.slots[bucket.params[0]]
                last = layout.slots[bucket.params[-1]]
                assert last.offset + last.numel - first.offset <= bucket_numel

        # the pieces of all ranks cover every element of every parameter exactly once
        covered = [[0] * n for n in numels]
        for rank in range(world):
            for piece in layout.param_pieces(rank):
                for k in range(piece.numel):
                    covered[piece.param][piece.param_offset + k] += 1
                    flat = layout.slots[piece.param].offset + piece.param_offset + k
                    assert layout.owner_of(flat) == (rank, piece.shard_offset + k)
                assert piece.shard_offset >= 0 and piece.shard_offset + piece.numel <= layout.shard_numel
        assert all(c == 1 for counts in covered for c in counts)


def test_big_parameter_gets_its_own_bucket() -> None:
    layout = plan_flat_layout([10, 1000, 10], world_size=2, bucket_numel=100, align=1)
    assert [b.params for b in layout.buckets] == [(0,), (1,), (2,)]


def test_contiguous_shards() -> None:
    one_bucket = plan_flat_layout([10, 20], world_size=4, bucket_numel=10**6, align=4)
    assert one_bucket.shard_is_contiguous
    assert one_bucket.shard_range(1) == one_bucket.buckets[0].piece(1)
    single_rank = plan_flat_layout([10, 20], world_size=1, bucket_numel=10, align=4)
    assert single_rank.shard_is_contiguous and single_rank.shard_range(0) == (0, single_rank.numel)
    several = plan_flat_layout([10, 20], world_size=2, bucket_numel=10, align=4)
    assert not several.shard_is_contiguous
    with pytest.raises(ValueError, match="not contiguous"):
        several.shard_range(0)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="world_size"):
        plan_flat_layout([1], world_size=0, bucket_numel=10)
    with pytest.raises(ValueError, match="bucket_numel"):
        plan_flat_layout([1], world_size=1, bucket_numel=0)
    with pytest.raises(ValueError, match="sizes"):
        plan_flat_layout([-1], world_size=1, bucket_numel=10)
    with pytest.raises(IndexError, match="outside"):
        plan_flat_layout([4], world_size=1, bucket_numel=10, align=1).owner_of(99)
