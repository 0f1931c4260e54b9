"""scripts/bench/memory_peak.py's replay on made-up allocator events (CPU; no CUDA needed): the peak is
found where the live bytes were largest, and what was alive then is summed by the allocating line; a block
whose free waits for another stream is flagged."""

from __future__ import annotations

from scripts.bench.memory_peak import GIB, peak_breakdown, site

TORCH = {"filename": "/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}
MLP = {"filename": "/repo/runtime/sequence/tiled_mlp.py", "line": 40, "name": "forward"}
ATTN = {
    "filename": "/venv/lib/python3.12/site-packages/transformers/models/llama/x.py",
    "line": 7,
    "name": "f",
}
STATES = {"filename": "/repo/runtime/zero/flat.py", "line": 12, "name": "allocate"}


def _alloc(addr: int, gib: float, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def _free(addr: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": 0, "frames": []}


def test_the_peak_is_the_largest_live_set_and_is_grouped_by_the_first_frame_outside_torch() -> None:
    trace = [
        _alloc(1, 4.0, STATES),  # the states: alive throughout
        _alloc(2, 3.0, TORCH, MLP),  # a tile: freed before the attention's working set
        _free(2),
        _alloc(3, 2.0, TORCH, ATTN),
        _alloc(4, 2.0, TORCH, ATTN),  # the peak: 4 + 2 + 2 = 8 GiB (the tile's 7 came earlier)
        {"action": "free_requested", "addr": 3, "size": 0, "frames": []},  # not yet returned
        _free(3),
        _alloc(5, 1.0, MLP),
    ]
    result = peak_breakdown(trace)
    assert result["traced_peak_gib"] == 8.0 and result["trace_complete"]
    by_site = {row["site"]: (row["gib"], row["blocks"]) for row in result["by_site"]}
    assert by_site == {
        "runtime/zero/flat.py:12 allocate": (4.0, 1),
        "transformers/models/llama/x.py:7 f": (4.0, 2),
    }
    assert result["peak_during"] == ["transformers/models/llama/x.py:7 f"]  # torch's own frame skipped
    assert [(b["mib"], b["age"]) for b in result["largest_blocks"]] == [(4096.0, 4), (2048.0, 1), (2048.0, 0)]
    assert result["pending_free_gib"] == 0  # the free of block 3 was requested after the peak


def test_a_block_whose_free_waits_for_another_stream_is_told_apart() -> None:
    """A tensor freed while another stream still uses its memory (record_stream) is dead to Python, yet
    its block stays allocated until that stream's work is done: at the peak it counts, flagged."""
    trace = [
        _alloc(1, 2.0, MLP),
        {"action": "free_requested", "addr": 1, "size": 0, "frames": []},  # dead, the side stream reads it
        _alloc(2, 1.0, ATTN),  # the peak: 3 GiB, one of them only waiting
        _free(1),
    ]
    result = peak_breakdown(trace)
    assert result["traced_peak_gib"] == 3.0 and result["pending_free_gib"] == 2.0
    blocks = [(b["mib"], b["free_pending"]) for b in result["largest_blocks"]]
    assert blocks == [(2048.0, True), (1024.0, False)]


def test_a_block_with_only_torch_frames_is_named_so() -> None:
    assert site([TORCH]) == "(torch only)"
    assert peak_breakdown([])["traced_peak_gib"] == 0
