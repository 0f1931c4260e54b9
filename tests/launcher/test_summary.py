"""The failure summary (launcher.summary) and the worker error file (launcher.errorfile): pure functions."""

from __future__ import annotations

import json

import pytest

from launcher.errorfile import MAX_TRACEBACK, WorkerError, error_file_env, parse_error_file, read_error_file
from launcher.summary import Failure, arrange_failures, cap_tail, lost_peer, rank_ranges, summary_lines


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([0], "0"), ([3, 1, 2, 0], "0-3"), ([0, 1, 2, 3, 5, 7, 8], "0-3,5,7-8"), ([9, 4, 4], "4,9"), ([], "")],
)
def test_rank_ranges(ranks, text) -> None:
    assert rank_ranges(ranks) == text


def _fail(rank: int, code: int = 2, message: str = "", kind: str = "", hint: str = "") -> Failure:
    tail = (f"rank {rank} line",)
    where = f"rank {rank} (local rank {rank}) on localhost"
    return Failure(code, where, f"exited with code {code}", rank, tail, message, hint, kind)


def test_identical_user_errors_fold_into_one_line_and_a_hint_without_a_tail() -> None:
    failures = [_fail(r, 2, "ConfigError: bad key", "user_input", "check ds.json") for r in (2, 0, 1, 3, 5)]
    assert summary_lines(failures, 0, "j") == [
        "ranks 0-3,5 failed the same way (exit code 2): ConfigError: bad key",
        "  hint: check ds.json",
    ]


def test_one_user_error_is_one_line_and_the_hint() -> None:
    lines = summary_lines([_fail(1, 2, "DataError: missing shard", "user_input", "run prep.py")], 0, "j")
    assert lines == [
        "FAILED: rank 1 (local rank 1) on localhost exited with code 2: DataError: missing shard",
        "  hint: run prep.py",
    ]


def test_different_messages_are_not_folded_and_the_root_cause_keeps_its_tail() -> None:
    failures = [
        _fail(0, 1, "ValueError: a", "exception"),
        _fail(1, 1, "ValueError: b", "exception"),
        _fail(2, 1, "ValueError: a", "user_input"),
        _fail(3, 1, "ValueError: a", "exception"),
    ]
    assert summary_lines(failures, 1, "dsl-x") == [
        "ranks 0,3 failed the same way (exit code 1): ValueError: a",
        "  the first failure of attempt 1 (job dsl-x); all other workers were stopped",
        "  last 1 line(s) of rank 0:",
        "    rank 0 line",
        "also: rank 1 (local rank 1) on localhost exited with code 1: ValueError: b",
        "also: rank 2 (local rank 2) on localhost exited with code 1: ValueError: a",
    ]


def test_a_rank_caught_by_the_stop_while_exiting_with_the_same_error_is_folded() -> None:
    # rank 1 failed first (exit 2); rank 0 had written the same error when the stop's SIGTERM hit its exit
    failures = [
        _fail(1, 2, "CheckpointCorrupted: x", "user_input"),
        _fail(0, 143, "CheckpointCorrupted: x", "user_input"),
    ]
    assert summary_lines(failures, 1, "dsl-x")[0] == (
        "ranks 0-1 failed the same way (exit code 2): CheckpointCorrupted: x"
    )


def test_messages_differing_only_in_a_memory_address_are_folded() -> None:
    # repr() of a function or object differs per process: the ranks still failed the same way
    failures = [_fail(r, 2, f"TypeError: got <function f at 0x7f{r}a0>", "user_input") for r in (0, 1)]
    assert summary_lines(failures, 0, "j")[0] == (
        "ranks 0-1 failed the same way (exit code 2): TypeError: got <function f at 0x7f0a0>"
    )


def test_failures_without_a_message_are_never_folded() -> None:
    lines = summary_lines([_fail(0, 7), _fail(1, 7)], 0, "j")
    assert lines[0] == "FAILED: rank 0 (local rank 0) on localhost exited with code 7"
    assert lines[-1] == "also: rank 1 (local rank 1) on localhost exited with code 7"
    assert not any("same way" in line for line in lines)


def test_many_different_failures_end_in_a_count() -> None:
    failures = [_fail(r, 1, f"ValueError: {r}", "exception") for r in range(8)]
    lines = summary_lines(failures, 0, "j")
    assert lines[-1] == "also: rank(s) 5-7 failed in other ways (see their output or logs)"
    assert sum(line.startswith("also: rank ") for line in lines) == 4


STACK = "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"
TORCH_DOC = {"message": {"message": "RuntimeError: boom\nsecond line", "extraInfo": {"py_callstack": STACK}}}


def test_error_file_in_torch_format_with_and_without_our_fields(tmp_path) -> None:
    path = tmp_path / "err.json"
    assert error_file_env(str(path)) == {
        "DSLAUNCH_ERROR_FILE": str(path),
        "TORCHELASTIC_ERROR_FILE": str(path),
    }
    path.write_text(json.dumps(TORCH_DOC))
    err = read_error_file(str(path))
    assert err == WorkerError(
        "RuntimeError: boom", "", "exception", TORCH_DOC["message"]["extraInfo"]["py_callstack"]
    )
    ours = {"message": {"message": "ConfigError: x", "extraInfo": {"kind": "user_input", "hint": "h"}}}
    assert parse_error_file(json.dumps(ours).encode()) == WorkerError("ConfigError: x", "h", "user_input", "")
    assert parse_error_file(b'{"message": "bare string"}') == WorkerError("bare string")


@pytest.mark.parametrize(
    "data", [b"", b"{", b"[]", b'{"message": {}}', b'{"message": {"message": "  "}}', b"\xff"]
)
def test_a_missing_empty_or_malformed_error_file_is_no_error(tmp_path, data) -> None:
    assert read_error_file(str(tmp_path / "absent.json")) is None
    assert parse_error_file(data) is None


def test_a_huge_traceback_keeps_its_end() -> None:
    stack = "x" * (MAX_TRACEBACK + 10) + "\nValueError: the end\n"
    doc = {"message": {"message": "ValueError: the end", "extraInfo": {"py_callstack": stack}}}
    err = parse_error_file(json.dumps(doc).encode())
    assert err is not None and err.traceback.endswith("\nValueError: the end\n")
    assert err.traceback.startswith(f"[... {len(stack) - MAX_TRACEBACK} characters cut ...]\n")


GLOO_LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"


def test_the_root_cause_is_the_first_failure_that_did_not_only_lose_its_peer() -> None:
    # Arrival order: two ranks that lost their peer (one says so only in its output), then the real one.
    lost_tail = Failure(1, "rank 2 (local rank 0) on w2", "exited with code 1", 2, ("x", "Broken pipe"))
    real = _fail(1, 1, "ValueError: shard 1 is corrupt", "exception")
    arranged = arrange_failures([_fail(0, 1, GLOO_LOST, "exception"), lost_tail, real, _fail(3, 7)])
    assert [f.rank for f in arranged] == [1, 0, 2]  # rank 3: later, no message, no lost peer: the stop's
    lines = summary_lines(arranged, 0, "j")
    assert (
        lines[0]
        == "FAILED: rank 1 (local rank 1) on localhost exited with code 1: ValueError: shard 1 is corrupt"
    )
    assert lines[-2:] == [
        "rank 0: lost its peer (gloo: Connection closed by peer) -- a consequence of rank 1's failure",
        "rank 2: lost its peer (torch.distributed: Broken pipe) -- a consequence of rank 1's failure",
    ]


def test_when_every_rank_lost_a_peer_the_first_is_named_and_the_hint_says_what_to_check() -> None:
    lines = summary_lines(arrange_failures([_fail(0, 1, GLOO_LOST), _fail(2, 1, GLOO_LOST + "3")]), 0, "j")
    assert lines[0].startswith("FAILED: rank 0 (local rank 0) on localhost exited with code 1: RuntimeError")
    assert lines[-2] == "rank 2: lost its peer (gloo: Connection closed by peer)"
    assert lines[-1].startswith("  hint: no rank failed by itself, each lost a peer: ") and "OOM" in lines[-1]
    alone = summary_lines([_fail(1, 1, GLOO_LOST)], 0, "j")  # its peer vanished without a trace
    assert alone[0].startswith("FAILED: rank 1 ") and alone[-1] == lines[-1]
    # ...unless the peer was a rank that had exited 0 while the others still ran collectives with it
    finished = summary_lines([_fail(0, 1, GLOO_LOST)], 0, "j", finished=[1, 2, 3])
    assert finished[-1].startswith("  hint: ranks 1-3 had already exited with code 0 while the others still ")


def test_the_tail_is_capped_in_bytes_keeping_the_end_of_each_line() -> None:
    tail = ["early line", "é" * 300 + "END", *["y" * 100] * 50]
    kept, cut = cap_tail(tail, max_bytes=1000, max_line=60)
    short = "y" * 30 + " [... 40 bytes cut ...] " + "y" * 30
    assert kept == [short] * 11  # 11 x 85 bytes fit in 1000
    assert cut == 11 * 40 + 39 * 101 + 604 + 11
    kept, cut = cap_tail(tail[:2], max_bytes=1000, max_line=60)
    assert kept == ["early line", "é" * 15 + " [... 543 bytes cut ...] " + "é" * 13 + "END"] and cut == 543


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process "
         "exited or there was a network error, NCCL version 2.21.5", "NCCL: remote process exited"),
        ("RuntimeError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
         "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", "NCCL: collective timed out"),
        ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
         "1800000ms for recv operation to complete", "gloo: timed out waiting for a peer"),
        ("DistNetworkError: Connection reset by peer", "torch.distributed: Connection reset by peer"),
        ("ValueError: shard 3 is corrupt", None),
    ],
)  # fmt: skip
def test_what_counts_as_a_lost_peer(message: str, reason: str | None) -> None:
    assert lost_peer(_fail(0, 1, message)) == reason
    huge_hint = {"message": {"message": "x", "extraInfo": {"hint": "h" * 100_000}}}
    assert len(parse_error_file(json.dumps(huge_hint).encode()).hint) == 4096


def test_a_runaway_message_and_hint_are_cut_in_the_summary() -> None:
    lines = summary_lines(
        [_fail(0, 1, "ValueError: " + "v" * 4000 + " end", "user_input", "h" * 4000)], 0, "j"
    )
    assert len(lines) == 2 and all(len(line.encode()) < 1200 for line in lines)
    assert lines[0].endswith("v end") and "bytes cut ...]" in lines[0] and "bytes cut ...]" in lines[1]


def test_an_abort_in_interpreter_shutdown_says_to_destroy_the_process_group() -> None:
    """The CI-seen failure of a plain DDP script: training done, then SIGABRT at exit from a gloo thread."""
    how = "was killed by SIGABRT (exit code 134); aborted (a C++ exception or assertion)"
    tail = ("{'train_loss': '3.828'}", "terminate called without an active exception")
    lines = summary_lines([Failure(134, "rank 1 (local rank 1) on localhost", how, 1, tail)], 0, "j")
    assert lines[-1].startswith("  hint: the rank aborted while its interpreter shut down")
    assert "torch.distributed.destroy_process_group()" in lines[-1]
    # another abort (an assertion in NCCL, say) gets no such hint
    other = Failure(134, "rank 1 (local rank 1) on localhost", how, 1, ("NCCL assertion failed",))
    assert not any("interpreter shut down" in line for line in summary_lines([other], 0, "j"))
