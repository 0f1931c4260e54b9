"""`zero_to_fp32`: DeepSpeed's names, its command line and output files, for our checkpoints and DeepSpeed's.

- DeepSpeed's own checkpoints (tests/fixtures/deepspeed) give exactly DeepSpeed's recorded
  `get_fp32_state_dict_from_zero_checkpoint` output (keys, order, dtypes, values) through every road:
  the compat function, `convert_zero_checkpoint_to_fp32_state_dict`, `load_state_dict_from_zero_checkpoint`
  and `ds_consolidate`.
- Every folder `engine.save_checkpoint` writes carries `zero_to_fp32.py`, which runs with torch alone
  (`runtime` and `deepspeed` made unimportable) in DeepSpeed's forms: `. pytorch_model.bin`, an output
  folder that does not exist yet, `--safe_serialization --max_shard_size` (shards + index JSON), `-t`,
  `--exclude_frozen_parameters`, `-d`; and on a DeepSpeed folder too.
- Issue 30's rows: the module and the script exit 1 with one accurate line on every error (missing or
  empty folder, missing or truncated shard, ours or DeepSpeed's, unwritable output); a pipeline root is
  consolidated; a tensor-parallel root is refused with its degree named.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.deepspeed import tiny
from tests.support.dist import run_distributed
from tests.support.paths import REPO, TESTS

FIXTURES = TESTS / "fixtures" / "deepspeed"
NAMES = [tiny.fixture_name(s, d, f) for s, d, f in tiny.ALL]
ROOT = REPO


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_deepspeed_checkpoints_give_deepspeeds_fp32_state_dict(tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )
    from safetensors.torch import load_file

    from runtime.checkpoint import consolidate_checkpoint, load_state_dict_file

    for name in NAMES:
        ckpt = FIXTURES / name / "ckpt"
        want = torch.load(FIXTURES / name / "expected_fp32.pt")
        assert _same(get_fp32_state_dict_from_zero_checkpoint(str(ckpt)), want), name
        assert _same(get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="global_step4"), want), name
        files = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path / name))
        assert files == [str(tmp_path / name / "pytorch_model.bin")]
        assert _same(torch.load(files[0]), want), name
        files = convert_zero_checkpoint_to_fp32_state_dict(
            str(ckpt), str(tmp_path / name), safe_serialization=True, max_shard_size="3KB"
        )
        index = json.loads((tmp_path / name / "model.safetensors.index.json").read_text())
        assert len(files) == 4 and set(index["weight_map"].values()) == {Path(f).name for f in files[:-1]}
        merged = {}
        for f in files[:-1]:
            merged.update(load_file(f))
        assert _same({k: merged[k] for k in want}, want), name
        model = load_state_dict_from_zero_checkpoint(tiny.make_model(5), str(ckpt))
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items() if v.dtype == want[k].dtype)
        if name.endswith("_frozen"):  # DeepSpeed marks frozen parameters: left out on request
            kept = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), exclude_frozen_parameters=True)
            assert _same(kept, {k: v for k, v in want.items() if k != "norm.bias"}), name
        consolidate_checkpoint(ckpt, tmp_path / f"{name}.safetensors", dtype=torch.float32)
        consolidated = load_state_dict_file(tmp_path / f"{name}.safetensors")
        assert _same(consolidated, {k: v.float() for k, v in want.items()}), name


def _save(rank: int, world: int, plain: str, pipe: str) -> dict:
    """A ZeRO-2 checkpoint with a frozen parameter after one step, and a 2-stage pipeline checkpoint."""
    import runtime
    from runtime.pipe import PipelineModule
    from tests.support.pipe_cases import mlp_layers, mse

    model = tiny.make_model(0)
    model.norm.bias.requires_grad_(False)  # frozen: --exclude_frozen_parameters leaves it out
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = runtime.initialize(
        model=model, model_parameters=trained, config=tiny.config(2, "fp32", world)
    )
    x, y = tiny.batch(1, rank, world)
    engine.backward(tiny.loss_fn(engine(x), y))
    engine.step()
    engine.save_checkpoint(plain, client_state={"note": "ours"})
    engine.destroy()
    torch.manual_seed(0)
    module = PipelineModule(mlp_layers(4), num_stages=2, loss_fn=mse)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam"}}
    pipeline, *_ = runtime.initialize(model=module, config=config)
    pipeline.save_checkpoint(pipe)
    return {"stage": {k: v.clone() for k, v in pipeline.full_state_dict().items()}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("saved")
    results = run_distributed(_save, 2, str(root / "plain"), str(root / "pipe"))
    pipeline = {}
    for r in results:
        pipeline.update(r["stage"])
    return {"plain": root / "plain", "pipe": root / "pipe", "pipeline": pipeline}


def _run_script(script: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """The script in a clean interpreter where dslaunch's packages cannot be imported."""
    code = (
        "import runpy, sys; sys.modules.update(runtime=None, deepspeed=None, launcher=None); "
        f"sys.argv = [{str(script)!r}, *{list(argv)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_every_save_carries_a_zero_to_fp32_that_needs_only_torch(saved: dict, tmp_path: Path) -> None:
    from runtime.checkpoint import get_fp32_state_dict_from_checkpoint

    plain = saved["plain"]
    script = plain / "zero_to_fp32.py"
    assert os.access(script, os.X_OK)
    want = get_fp32_state_dict_from_checkpoint(plain)
    done = _run_script(script, ".", "pytorch_model.bin", cwd=plain)  # the HF docs' recipe
    assert done.returncode == 0, done.stderr
    assert done.stdout == "zero_to_fp32.py: 9 tensors, 1334 elements written to pytorch_model.bin\n"
    assert _same(torch.load(plain / "pytorch_model.bin"), want)
    # the script's other forms, in this process (the same file, run as a module namespace)
    command = runpy.run_path(str(script))["main"]
    out = tmp_path / "new" / "folder"
    assert (
        command(
            [str(plain), str(out), "--safe_serialization", "--max_shard_size", "2KB", "-t", "global_step1"]
        )
        == 0
    )
    from safetensors.torch import load_file

    shards = sorted(out.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    merged = {k: v for p in shards for k, v in load_file(p).items()}
    assert _same({k: merged[k] for k in want}, want)
    assert command([str(plain), str(tmp_path / "x"), "--exclude_frozen_parameters", "-d"]) == 0
    assert sorted(torch.load(tmp_path / "x" / "pytorch_model.bin")) == sorted(
        want
    )  # ours keeps frozen as extras
    # the same script reads DeepSpeed's folders
    ds = FIXTURES / "zero3_bf16" / "ckpt"
    assert command([str(ds), str(tmp_path / "ds.bin")]) == 0
    assert _same(torch.load(tmp_path / "ds.bin"), torch.load(FIXTURES / "zero3_bf16" / "expected_fp32.pt"))


def _faults(tmp_path: Path, plain: Path) -> list[tuple[list[str], str]]:
    """(argv, the one stderr line after "PROG: error: ") for each fault."""
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    shutil.copytree(plain, broken)
    shard = broken / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    missing = tmp_path / "missing"
    shutil.copytree(plain, missing)
    (missing / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.safetensors").unlink()
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ds = tmp_path / "deepspeed"
    shutil.copytree(FIXTURES / "zero3_bf16" / "ckpt", ds)
    ds_shard = ds / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ds_shard.write_bytes(ds_shard.read_bytes()[:5000])
    tp = tmp_path / "tp"
    for r in range(2):
        shutil.copytree(plain, tp / f"tp_rank_{r:02d}_of_02")
    return [
        ([str(tmp_path / "nope"), "out"], f"checkpoint directory {tmp_path / 'nope'} does not exist"),
        ([str(empty), "out"], f"{empty} has no 'latest' file"),
        (
            [str(broken), "out"],
            f"{shard}: 100 bytes, but the manifest recorded {size} (truncated or overwritten)",
        ),
        (
            [str(missing), "out"],
            f"{missing / 'global_step1' / 'zero_pp_rank_0_mp_rank_00_optim_states.safetensors'}: missing",
        ),
        ([str(ds), "out"], f"{ds_shard}: cannot be read ("),
        ([str(plain), str(a_file / "out")], f"[Errno 20] Not a directory: '{a_file / 'out'}'"),
        (
            [str(tp), "out"],
            f"{tp} is a tensor-parallel checkpoint (tensor-parallel degree 2, one sub-folder per rank)",
        ),
    ]


def test_module_and_script_exit_1_with_one_line_on_every_error(
    saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from deepspeed.utils.zero_to_fp32 import main as module_main

    script_main = runpy.run_path(str(saved["plain"] / "zero_to_fp32.py"))["main"]
    for argv, message in _faults(tmp_path, saved["plain"]):
        for prog, main in (("zero_to_fp32", module_main), ("zero_to_fp32.py", script_main)):
            assert main(argv) == 1, (prog, argv)
            err = capsys.readouterr().err
            assert err.startswith(f"{prog}: error: {message}") and err.count("\n") == 1, (prog, err)
    # as processes: the exit status reaches the shell (`zero_to_fp32 ckpt out && upload out` stops)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'compat'}")
    nope = str(tmp_path / "nope")
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", nope, "out.safetensors"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert (
        done.returncode == 1
        and f"zero_to_fp32: error: checkpoint directory {nope} does not exist" in done.stderr
    )
    done = _run_script(saved["plain"] / "zero_to_fp32.py", nope, "out", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        1,
        f"zero_to_fp32.py: error: checkpoint directory {nope} does not exist\n",
    )


def test_pipeline_root_is_consolidated(saved: dict, tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, main

    pipe, want = saved["pipe"], saved["pipeline"]
    got = get_fp32_state_dict_from_zero_checkpoint(str(pipe))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert main([str(pipe), str(tmp_path / "out")]) == 0
    root_script = runpy.run_path(str(pipe / "zero_to_fp32.py"))["main"]  # in the save_dir, as DeepSpeed's
    assert root_script([str(pipe), str(tmp_path / "script.bin")]) == 0  # the standalone merge
    for path in (tmp_path / "out" / "pytorch_model.bin", tmp_path / "script.bin"):
        written = torch.load(path)
        assert sorted(written) == sorted(want) and all(torch.equal(written[k], want[k]) for k in want)


def test_the_script_reads_a_save_that_a_crash_left_half_swapped_in(saved: dict, tmp_path: Path) -> None:
    """A committed save whose swap a crash interrupted (runtime.checkpoint.commit) is the checkpoint: the
    script, which repeats the commit record's names without importing dslaunch, finds its files as the
    runtime does."""
    from runtime.checkpoint import get_fp32_state_dict_from_checkpoint
    from runtime.checkpoint.manifest import COMMIT_RECORD, PendingCommit, staging_name

    root = tmp_path / "ckpt"
    shutil.copytree(saved["plain"], root)
    want = get_fp32_state_dict_from_checkpoint(root)
    (root / "global_step1").rename(root / staging_name("global_step1"))  # committed, not yet swapped in
    (root / COMMIT_RECORD).write_text(PendingCommit("global_step1", True, (".",)).to_json())
    assert _same(get_fp32_state_dict_from_checkpoint(root), want)  # the runtime's reading of it
    command = runpy.run_path(str(root / "zero_to_fp32.py"))["main"]
    assert command([str(root), str(tmp_path / "out.bin")]) == 0
    assert _same(torch.load(tmp_path / "out.bin"), want)


def test_every_form_users_pass_is_read_or_named(
    saved: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The save directory, one tag's folder (alone or with its own tag) and a pipeline's root give the same
    state dict through the runtime's function, DeepSpeed's, `ds_consolidate`, the `zero_to_fp32` module and
    the standalone script; a form that cannot work says in one line what to pass, naming the tags there."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from deepspeed.utils.zero_to_fp32 import main as module_main

    from runtime.checkpoint import (
        CheckpointNotFound,
        get_fp32_state_dict_from_checkpoint,
        load_state_dict_file,
    )
    from runtime.checkpoint.consolidate import main as consolidate_main

    plain, pipe = saved["plain"], saved["pipe"]
    folder = plain / "global_step1"
    want = get_fp32_state_dict_from_checkpoint(plain)
    script_main = runpy.run_path(str(plain / "zero_to_fp32.py"))["main"]
    for read in (get_fp32_state_dict_from_checkpoint, get_fp32_state_dict_from_zero_checkpoint):
        for tag in (None, "global_step1"):
            assert _same(read(str(folder), tag), want), (read, tag)
    for i, argv in enumerate(([str(folder)], [str(folder), "-t", "global_step1"])):
        assert consolidate_main([*argv, str(tmp_path / f"c{i}.safetensors")]) == 0
        assert _same(load_state_dict_file(tmp_path / f"c{i}.safetensors"), want)
        for name, main in (("m", module_main), ("s", script_main)):
            assert main([argv[0], str(tmp_path / f"{name}{i}.bin"), *argv[1:]]) == 0, (name, argv)
            assert _same(torch.load(tmp_path / f"{name}{i}.bin"), want)
    whole = saved["pipeline"]
    got = get_fp32_state_dict_from_checkpoint(pipe)
    assert sorted(got) == sorted(whole) and all(torch.equal(got[k], whole[k]) for k in whole)
    assert consolidate_main([str(pipe), str(tmp_path / "pipe.safetensors")]) == 0
    written = load_state_dict_file(tmp_path / "pipe.safetensors")
    assert sorted(written) == sorted(whole) and all(torch.equal(written[k], whole[k]) for k in whole)
    capsys.readouterr()

    # a tag folder with another tag, and a directory whose `latest` is gone: the folder and its tags named
    with pytest.raises(CheckpointNotFound) as error:
        get_fp32_state_dict_from_checkpoint(folder, "global_step9")
    assert (str(error.value), error.value.hint) == (
        f"{folder} is the folder of checkpoint tag 'global_step1', not of tag 'global_step9'",
        f"pass the directory holding the tags, {plain}, with tag 'global_step9' (tags there: global_step1)",
    )
    assert script_main([str(folder), str(tmp_path / "x.bin"), "-t", "global_step9"]) == 1
    assert capsys.readouterr().err == (
        f"zero_to_fp32.py: error: {folder} is the folder of checkpoint tag 'global_step1', not of "
        f"'global_step9'; pass {plain} with -t global_step9; tags there: global_step1\n"
    )
    unpointed = tmp_path / "unpointed"
    shutil.copytree(plain, unpointed)
    (unpointed / "latest").unlink()
    assert consolidate_main([str(unpointed), str(tmp_path / "y.safetensors")]) == 1
    assert capsys.readouterr().err == (
        f"ds_consolidate: error: {unpointed} has no 'latest' file; its complete tags: global_step1\n"
        "ds_consolidate: hint: pass the tag to read (tag='global_step1', or --tag global_step1 on a command "
        "line)\n"
    )
    assert script_main([str(unpointed), str(tmp_path / "y.bin")]) == 1
    assert capsys.readouterr().err == (
        f"zero_to_fp32.py: error: {unpointed} has no 'latest' file and is not a checkpoint tag folder; "
        "pass the folder that holds 'latest', or -t TAG; tags there: global_step1\n"
    )
    # one stage's tag folder is not the model: ds_consolidate names the pipeline's root and the tag
    stage = pipe / "pipe_stage_00_of_02"
    tag = (stage / "latest").read_text()
    assert consolidate_main([str(stage / tag), str(tmp_path / "z.safetensors")]) == 1
    assert capsys.readouterr().err == (
        f"ds_consolidate: error: {stage} is one rank's part of a checkpoint saved with 2 pipeline stages, "
        "not a checkpoint directory: ds_consolidate takes the directory save_checkpoint was given\n"
        f"ds_consolidate: hint: ds_consolidate {pipe} --tag {tag} ...\n"
    )
