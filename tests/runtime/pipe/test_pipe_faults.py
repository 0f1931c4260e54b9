"""Pipeline and tensor-parallel input errors (issue 30): each is a `UserError`, one line naming the key path
or the module argument, exit code 2 under dslaunch; a layer that raises inside a stage is reported as the
user's own exception, not torch's wrapper.

Three layers, the cheap ones first: the config sections and pure checks in this process; the engines'
checks on one spawn of 2 gloo ranks (every rank must raise the same error, none may hang); two real
dslaunch runs for what a user sees (the folded one-line summary, the stage's root cause), and a third
for a stage out of GPU memory (the engine's explanation through torch's stage wrapper).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runtime.config import load_config
from runtime.config.combinations import check_data_parallel_engine
from runtime.config.parallel import read_pipeline_section, read_tensor_parallel_section
from runtime.errors import UserError, error_record
from runtime.parallel.topology import topology_for
from runtime.pipe.config import PipelineError, check_schedule
from runtime.pipe.partition import partition_uniform
from tests.integration.test_user_errors import DSLAUNCH, FAILED_LINE, ROOT, _env, free_port
from tests.support.dist import run_distributed

MICRO = {"train_micro_batch_size_per_gpu": 4}
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _message(fn: Any) -> str:
    """The error's message, after checking that it is a UserError (one line and exit code 2)."""
    try:
        fn()
    except Exception as error:
        assert isinstance(error, UserError), f"{type(error).__name__}: {error}"
        assert "\n" not in str(error)
        return str(error)
    return "no error"


# -- in this process ---------------------------------------------------------------------------------------
def test_section_typos_get_did_you_mean_and_bad_values_their_key_path() -> None:
    assert _message(lambda: read_pipeline_section({"stagse": 2})) == (
        'pipeline.stagse: unknown key; did you mean "stages"?'
    )
    assert _message(lambda: read_pipeline_section({"schedule": "zigzag"})).startswith(
        "pipeline.schedule: expected one of '1f1b', 'gpipe', 'interleaved_1f1b', 'looped_bfs', got str"
    )
    assert _message(lambda: load_config({**MICRO, "tensor_parallel": {"autotp_szie": 2}}, world_size=1)) == (
        'tensor_parallel.autotp_szie: unknown key; did you mean "autotp_size"?'
    )
    assert _message(lambda: read_tensor_parallel_section({"autotp_size": -1})) == (
        "tensor_parallel.autotp_size: expected an integer >= 0, got -1"
    )
    assert _message(lambda: read_tensor_parallel_section({"autotp_size": "2"})) == (
        "tensor_parallel.autotp_size: expected an integer >= 0, got str '2'"
    )
    assert _message(lambda: read_tensor_parallel_section({"preset_model": "llama"})) == (
        "tensor_parallel.preset_model: a DeepSpeed option dslaunch does not support: AutoTP model presets; "
        "remove this key"
    )


def test_tensor_parallel_of_one_or_zero_is_no_tensor_parallelism_as_in_deepspeed() -> None:
    for size in (1, 0):  # DeepSpeed's autotp_size default is 0, "disabled"
        config = load_config({**MICRO, "tensor_parallel": {"autotp_size": size}}, world_size=2)
        assert config.train_batch_size == 8
        assert read_tensor_parallel_section({"tp_size": size}).autotp_size == 1
    # the config carries the degree; the plain engine refuses it (config/combinations)
    two = load_config({**MICRO, "tensor_parallel": {"autotp_size": 2}}, world_size=2)
    assert two.tensor_parallel.autotp_size == 2
    assert _message(lambda: check_data_parallel_engine(two)) == (
        "tensor_parallel.autotp_size: 2 needs the model sharded over a tensor-parallel grid, which "
        "runtime.initialize does for such a config (runtime.parallel.plan.build_parallel_plan), not this "
        "engine alone"
    )


def test_degrees_and_layer_counts_that_cannot_be_laid_out() -> None:
    assert _message(lambda: topology_for(2, tp=4)) == (
        "1 pipeline stages x tensor-parallel degree 4 = 4 ranks per replica does not divide the world size 2"
    )
    assert _message(lambda: partition_uniform(1, 2)) == (
        "the pipeline has 2 stages but only 1 layers; every stage needs at least one layer"
    )
    explicit = read_pipeline_section({"schedule": "1f1b"})
    assert _message(lambda: check_schedule(explicit, 4, 1, 2)) == (
        "gradient_accumulation_steps: 2 micro-batches, but pipeline.schedule '1f1b' needs at least one per "
        "stage (4)"
    )
    # the default runs them, as DeepSpeed does: GPipe is 1F1B when every micro-batch is in flight at once
    assert check_schedule(read_pipeline_section({}), 4, 1, 2) == "gpipe"


def test_layer_specs_are_checked_when_written_with_names_the_same_on_every_rank() -> None:
    from runtime.pipe import LayerSpec

    # the arguments against the class's constructor: it used to be a TypeError when a stage built it
    assert _message(lambda: LayerSpec(nn.Linear, 4)) == (
        "LayerSpec(Linear, ...): the arguments do not fit Linear(in_features: int, out_features: int, "
        "bias: bool = True, device=None, dtype=None): missing a required argument: 'out_features'"
    )
    # no memory address (it differs per rank, so the launcher could not fold the ranks' errors)
    assert (
        _message(lambda: LayerSpec(torch.tanh))
        == "LayerSpec needs an nn.Module subclass, got function torch.tanh"
    )
    assert _message(lambda: LayerSpec(lambda x: x)) == (
        "LayerSpec needs an nn.Module subclass, got function tests.runtime.pipe.test_pipe_faults.<lambda>"
    )


def test_a_pipeline_checkpoint_root_and_the_random_streams_refuse_in_one_line(tmp_path: Path) -> None:
    from runtime.parallel.rng import RNGStatesTracker
    from runtime.pipe.checkpoint import pipeline_stage_dirs

    assert _message(lambda: pipeline_stage_dirs(tmp_path)) == (
        f"{tmp_path} holds no pipeline stage directories (pipe_stage_SS_of_NN)"
    )
    (tmp_path / "pipe_stage_01_of_02").mkdir()
    assert _message(lambda: pipeline_stage_dirs(tmp_path)) == (
        f"{tmp_path}: the checkpoint of a 2-stage pipeline lacks stages [0]"
    )
    tracker = RNGStatesTracker()
    tracker.add("a", 7)
    assert _message(lambda: tracker.add("b", 7)) == (
        "RNG tracker: seed 7 already starts another stream; give 'b' its own"
    )


def test_a_stage_folder_given_as_the_checkpoint_directory_names_the_directory(tmp_path: Path) -> None:
    from runtime.parallel.folders import data_parallel_root, misplaced_root

    stage = tmp_path / "pipe_stage_01_of_04"
    stage.mkdir()
    (stage / "latest").write_text("t1")  # a stage folder is a ZeRO checkpoint of its own: it used to load
    expected = (
        f"{stage} is one rank's part of a checkpoint saved with 4 pipeline stages, not a checkpoint "
        "directory: load_checkpoint takes the directory save_checkpoint was given"
    )
    assert _message(lambda: data_parallel_root(stage)) == expected
    assert str(misplaced_root(stage)) == expected and misplaced_root(tmp_path) is None


def test_a_pipeline_engine_given_a_stage_or_tag_folder_names_the_directory(tmp_path: Path) -> None:
    from runtime.checkpoint.manifest import MANIFEST
    from runtime.parallel.folders import part_root

    ours = ("pipe_stage_01_of_02", "pipe_stage_", "pipeline stage 1 of 2")  # the engine's checkpoint_folder
    stage = tmp_path / "pipe_stage_00_of_02"
    tag = stage / "global_step3"
    tag.mkdir(parents=True)
    (tag / MANIFEST).write_text("{}")
    assert _message(lambda: part_root(stage, ours, loading=True)) == (
        f"{stage} is one rank's part of a checkpoint saved with 2 pipeline stages, not a checkpoint "
        "directory: load_checkpoint takes the directory save_checkpoint was given"
    )
    assert _message(lambda: part_root(tag, ours, loading=True)).startswith(
        f"{tag} is the folder of one checkpoint (tag 'global_step3'), not a checkpoint directory"
    )
    assert part_root(tmp_path, ours, loading=False) == str(tmp_path / "pipe_stage_01_of_02")


def test_the_error_file_names_the_exception_behind_a_pipeline_stage() -> None:
    try:
        try:
            raise ValueError("bad shape in my layer")
        except ValueError as error:  # what torch.distributed.pipelining's stage does
            raise RuntimeError("\n  [Stage 1] failed to run forward:\n  args: ('Tensor(...)',)\n") from error
    except RuntimeError as wrapped:
        record = error_record(wrapped, "callstack")["message"]
    assert record["message"] == "ValueError: bad shape in my layer (in pipeline stage 1, forward)"
    assert record["extraInfo"]["kind"] == "exception"
    try:
        try:
            raise PipelineError("the last stage needs a loss: PipelineModule(..., loss_fn=...)")
        except PipelineError as error:
            raise RuntimeError("[Stage 1] failed to run forward:") from error
    except RuntimeError as wrapped:
        record = error_record(wrapped, "callstack")["message"]
    assert record["extraInfo"]["kind"] == "user_input"  # still the user's one line
    assert record["message"].startswith("the last stage needs a loss")


# -- the engines, on 2 gloo ranks ------------------------------------------------------------------------
class _OddMLP(nn.Module):
    """Projections AutoTP shards (up/down) whose width, 3, no degree of 2 divides."""

    def __init__(self) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(4, 3), nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x))


def _engine_faults(rank: int, world_size: int, save_dir: str) -> dict[str, Any]:
    import runtime
    from runtime.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
    from tests.support.tp_models import GPT2Block, TinyLM, lm_batch, lm_loss

    def pipe(**extra: Any) -> dict[str, Any]:
        return {**MICRO, "gradient_accumulation_steps": 2, **SGD, "steps_per_print": 0, **extra}

    def mlp(stages: int = 2) -> PipelineModule:
        torch.manual_seed(0)
        layers = [LayerSpec(nn.Linear, 4, 8), torch.tanh, LayerSpec(nn.Linear, 8, 2)]
        return PipelineModule(layers, num_stages=stages, loss_fn=nn.functional.mse_loss)

    def batches(rows: int, count: int = 2) -> Any:
        gen = torch.Generator().manual_seed(3)
        return iter([(torch.randn(rows, 4, generator=gen), torch.randn(rows, 2, generator=gen))] * count)

    out: dict[str, str | float] = {}
    out["stages"] = _message(lambda: mlp(stages=3))
    out["layers"] = _message(lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=2))
    module = mlp()
    out["pipeline_stages"] = _message(lambda: PipelineEngine(module, pipe(pipeline={"stages": 4})))
    out["zero2"] = _message(lambda: PipelineEngine(module, pipe(zero_optimization={"stage": 2})))
    offload = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    out["offload"] = _message(lambda: PipelineEngine(module, pipe(zero_optimization=offload)))
    no_params = PipelineModule(
        [LayerSpec(nn.Linear, 4, 4), torch.tanh], num_stages=2, partition_method="uniform"
    )
    out["no_params"] = _message(lambda: PipelineEngine(no_params, pipe()))
    engine = PipelineEngine(module, pipe())
    out["stage"] = engine.stage_id
    out["micro_size"] = _message(lambda: engine.train_batch(batches(rows=3)))  # on every rank, no hang
    out["a_list"] = _message(lambda: engine.train_batch(list(batches(rows=4))))
    # PipelineModule's arguments, checked on every rank before anything is built (a layer that is no
    # layer used to fail only on the stage owning it; wrong types deep inside, as AttributeError etc.)
    specs = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Linear, 8, 2)]
    out["arguments"] = [
        _message(lambda: PipelineModule(specs, num_stages="2")),
        _message(lambda: PipelineModule(specs, num_stages=2, partition_method=3)),
        _message(lambda: PipelineModule(specs, num_stages=2, loss_fn="mse")),
        _message(lambda: PipelineModule([*specs, 3], num_stages=2)),
        # a misspelt tied attribute left the copies untied, silently
        _message(
            lambda: PipelineModule(
                [TiedLayerSpec("e", nn.Linear, 4, 4, tied_weight_attr="wieght"), nn.Tanh()] * 2,
                num_stages=2,
                partition_method="uniform",
            )
        ),
    ]
    # fewer micro-batches than stages: trains (GPipe), the loss is the forward's
    engine = PipelineEngine(mlp(), pipe(gradient_accumulation_steps=1, train_batch_size=4))
    out["one_micro_eval"] = float(engine.eval_batch(batches(4, 1)))
    out["one_micro_train"] = float(engine.train_batch(batches(4, 1)))
    out["one_micro_schedule"] = engine.schedule_name
    # a checkpoint loaded into wider layers names each stage's FIRST parameter that differs (it named the
    # stage's last); a stage's folder given as the directory names the directory to give
    stages_dir = os.path.join(save_dir, "pipe")
    engine.save_checkpoint(stages_dir, tag="t1")
    torch.manual_seed(0)
    wide = [LayerSpec(nn.Linear, 4, 16), torch.tanh, LayerSpec(nn.Linear, 16, 2)]
    wider = PipelineEngine(PipelineModule(wide, num_stages=2, loss_fn=nn.functional.mse_loss), pipe())
    out["wider"] = _message(lambda: wider.load_checkpoint(stages_dir))
    out["stage_dir"] = _message(
        lambda: engine.load_checkpoint(os.path.join(stages_dir, "pipe_stage_00_of_02"))
    )

    def lm(heads: int = 4) -> nn.Module:
        torch.manual_seed(0)
        return TinyLM(lambda: GPT2Block(heads=heads))

    def tp(size: Any, **extra: Any) -> dict[str, Any]:
        return {**MICRO, **SGD, "steps_per_print": 0, "tensor_parallel": {"autotp_size": size}, **extra}

    out["heads"] = _message(lambda: runtime.initialize(model=lm(heads=1), config=tp(2)))
    out["width"] = _message(lambda: runtime.initialize(model=_OddMLP(), config=tp(2)))
    # nothing AutoTP knows by name: it used to train with every weight whole on every rank
    plain_mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    out["no_projection"] = _message(lambda: runtime.initialize(model=plain_mlp, config=tp(2)))
    out["tp_world"] = _message(lambda: runtime.initialize(model=lm(), config=tp(4)))
    # autotp_size 1 is the plain engine: the same loss as without the section
    losses = []
    for config in (tp(1), {**MICRO, **SGD, "steps_per_print": 0}):
        plain = runtime.initialize(model=lm(), config=config)[0]
        tokens, labels = lm_batch(0, rank)
        losses.append(float(lm_loss(plain, tokens, labels).detach()))
        out["tp1_engine"] = type(plain).__name__
    out["tp1_loss"], out["no_section_loss"] = losses
    # training_data with tensor parallelism: one loader over the data ranks (both model ranks of the one
    # data rank read the same micro-batches)
    tokens = torch.arange(8 * 6).reshape(8, 6) % 13
    _, _, loader, _ = runtime.initialize(model=lm(), config=tp(2), training_data=tokens)
    out["tp_loader"] = [len(loader), next(iter(loader)).tolist()]
    # a checkpoint saved at tensor-parallel degree 2, resumed without tensor parallelism
    runtime.initialize(model=lm(), config=tp(2))[0].save_checkpoint(save_dir)
    plain = runtime.initialize(model=lm(), config=tp(1))[0]
    out["tp_resume"] = _message(lambda: plain.load_checkpoint(save_dir))
    return out


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_engine_faults, 2, str(tmp_path_factory.mktemp("tp2")), timeout=240)


def test_pipeline_engine_input_errors_are_one_line_on_every_rank(faults: list[dict]) -> None:
    for r in faults:
        assert r["wider"] == (
            "parameter '0.weight': shape [8, 4] in the checkpoint, [16, 4] in the model (1 more differ)"
            if r["stage"] == 0
            else "parameter '2.weight': shape [2, 8] in the checkpoint, [2, 16] in the model"
        )
        assert r["stage_dir"].endswith(
            "pipe/pipe_stage_00_of_02 is one rank's part of a checkpoint saved with 2 pipeline stages, not a "
            "checkpoint directory: load_checkpoint takes the directory save_checkpoint was given"
        )
        assert r["stages"] == (
            "PipelineModule(num_stages=3) does not divide the world size 2: every data-parallel replica "
            "needs one rank per stage"
        )
        assert (
            r["layers"] == "the pipeline has 2 stages but only 1 layers; every stage needs at least one layer"
        )
        assert r["pipeline_stages"] == "pipeline.stages: 4 but the PipelineModule was built with 2 stages"
        assert r["zero2"].startswith(
            "zero_optimization.stage: 2 cannot be combined with pipeline parallelism"
        )
        assert r["offload"] == (
            "zero_optimization.offload_optimizer.device: 'cpu': optimizer offload is not supported with "
            "pipeline parallelism yet"
        )
        assert r["no_params"] == "pipeline stage 1 holds layers 1: tanh and no trainable parameter"
        assert r["micro_size"] == (
            "the data iterator gave a micro-batch of 3 samples, but train_micro_batch_size_per_gpu is 4"
        )
        assert r["a_list"] == (
            f"stage {r['stage']}: the data iterator is a list, not an iterator: pass iter(...) of it (each "
            "next() is one micro-batch), or deepspeed.utils.RepeatingLoader(...) to go round it again"
        )
        assert r["arguments"] == [
            "PipelineModule(num_stages='2'): expected an integer >= 1, got str '2'",
            "PipelineModule(partition_method=...): expected a string ('parameters', 'uniform' or "
            "'type:REGEX'), got int 3",
            "PipelineModule(loss_fn=...): expected a function (or None), got str 'mse'",
            "PipelineModule layer 2 is int 3: not a LayerSpec, nn.Module or callable",
            "TiedLayerSpec('e', Linear, tied_weight_attr='wieght'): Linear has no parameter 'wieght' "
            "(its own: weight, bias)",
        ]
        assert r["one_micro_schedule"] == "gpipe"
        assert r["one_micro_train"] == pytest.approx(r["one_micro_eval"], rel=1e-6)


def test_tensor_parallel_input_errors_are_one_line_naming_the_degree(faults: list[dict]) -> None:
    for r in faults:
        assert r["heads"] == "tensor_parallel.autotp_size 2 does not divide h.0.attn.num_heads = 1"
        assert r["width"] == (
            "tensor_parallel.autotp_size 2 does not divide dim 0 (3) of the weight up_proj of shape (3, 4)"
        )
        assert r["no_projection"] == (
            "tensor_parallel.autotp_size 2: AutoTP finds no projection to shard in Sequential: it knows "
            "Linear layers named q_proj, k_proj, v_proj, gate_proj, up_proj, o_proj, down_proj and Conv1D "
            "layers named c_attn, c_fc, c_proj; its layers with weights to split are 0 (Linear), 2 (Linear)"
        )
        assert r["tp_world"] == (
            "tensor_parallel.autotp_size: 4 does not divide the world size 2: each data-parallel replica "
            "needs 4 ranks"
        )
        assert r["tp1_engine"] == "Engine" and r["tp1_loss"] == r["no_section_loss"]
        assert r["tp_loader"] == faults[0]["tp_loader"] and r["tp_loader"][0] == 2  # 8 samples, micro 4
        assert r["tp_resume"].endswith(
            "holds a checkpoint saved with tensor-parallel degree 2 (tp_rank_00_of_02, tp_rank_01_of_02), "
            "but this engine has no tensor parallelism"
        )


# -- under dslaunch ----------------------------------------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn
import runtime
from runtime.pipe import LayerSpec, PipelineModule


class Picky(nn.Linear):
    calls = 0

    def forward(self, x):
        Picky.calls += 1
        if Picky.calls > 1:  # the schedule's first call only infers shapes
            raise RAISED
        return super().forward(x)


runtime.init_distributed()
layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(Picky, 4, 4)]
module = PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss)
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": PIPELINE}
engine, *_ = runtime.initialize(model=module, config=config)
engine.train_batch(iter([(torch.ones(2, 4), torch.ones(2, 4))] * 2))
"""


def _dslaunch(
    tmp_path: Path, pipeline: dict, raised: str = 'ValueError("bad shape in my layer")'
) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    source = SCRIPT.replace("PIPELINE", json.dumps(pipeline)).replace("RAISED", raised)
    script.write_text(source, encoding="utf-8")
    args = [*DSLAUNCH, "--num_gpus", "2", "--master_port", str(free_port()), str(script)]
    return subprocess.run(args, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_a_pipeline_section_typo_under_dslaunch_is_one_clean_line(tmp_path: Path) -> None:
    result = _dslaunch(tmp_path, {"stagse": 2})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.count('pipeline.stagse: unknown key; did you mean "stages"?') == 1, output
    assert FAILED_LINE.search(output) and "Traceback" not in output, output


def test_a_layer_raising_in_a_stage_is_reported_as_the_users_exception(tmp_path: Path) -> None:
    result = _dslaunch(tmp_path, {})
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    summary = [line for line in output.splitlines() if line.startswith("dslaunch: FAILED")]
    assert summary == [
        "dslaunch: FAILED: rank 1 (local rank 1) on localhost exited with code 1: ValueError: bad shape in "
        "my layer (in pipeline stage 1, forward)"
    ], output


def test_a_stage_out_of_memory_is_explained_in_one_line_with_the_pipeline_stage(tmp_path: Path) -> None:
    """torch's pipelining wraps a stage's OutOfMemoryError in its own RuntimeError; the engine unwraps it
    and says it in its terms (runtime/engine/oom.py): the phase, the stage, what to change; exit code 2."""
    oom = 'torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")'
    result = _dslaunch(tmp_path, {}, raised=oom)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    summary = [line for line in output.splitlines() if line.startswith("dslaunch: FAILED")]
    assert len(summary) == 1 and summary[0].startswith(
        "dslaunch: FAILED: rank 1 (local rank 1) on localhost exited with code 2: CUDA out of memory. The "
        "forward and backward (pipeline stage 1, forward) of step 1 asked for 2.00 GiB"
    ), output
    assert "  hint: lower the peak with, cheapest first: train_micro_batch_size_per_gpu 2 -> 1" in output
