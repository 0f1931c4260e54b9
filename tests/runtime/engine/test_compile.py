"""engine.compile() at ZeRO 0-3 (runtime/compile.py) and the config's `compile` section.

Each case trains a tiny GPT twice in one process per rank, from the same seed on the same batches: the
eager engine, then the same engine built again and compiled (backend "eager": dynamo traces and
AOT-free graphs run, so CPU checks take seconds). The compiled losses must equal the eager ones step for
step, and dynamo's counters must not move after the first step (no recompile, no new graph break per
step). ZeRO-3 at world 1 with `offload_param` (sharded parameters, so gather hooks) and at world 2 take
the per-region path; the others compile the whole model; a model `torch.compile`d before `initialize`
takes the same paths. The Hugging Face routes run the same check:
`TrainingArguments(torch_compile=True)` (Accelerate calls engine.compile()) and Accelerate's regional
compilation (it compiles each block of the engine's module itself).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch

from runtime.config import ConfigError, load_config
from tests.support.accelerate_steps import train_prepared
from tests.support.dist import run_distributed
from tests.support.logs import captured_log
from tests.support.paths import TESTS

STEPS = 4
MICRO = 2
SEQ = 16


def _train(rank: int, world: int, stage: int, accumulation: int, ckpt: bool, offload: bool, how: str | None):
    """Losses, dynamo's counters after each step, the engine, and the compile warnings `initialize`
    logged. `how` the model is compiled: None (eager), "engine" (engine.compile()), "before"
    (torch.compile(model) before initialize) or "in place" (model.compile() before initialize)."""
    import runtime
    from runtime.activation_checkpointing import checkpoint
    from runtime.compile import compile_counts
    from runtime.models import GPT, GPTConfig

    torch.manual_seed(0)
    model: Any = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, max_seq_len=SEQ))
    if how == "before":
        model = torch.compile(model, backend="eager")
    elif how == "in place":
        model.compile(backend="eager")
    if ckpt:
        model.checkpoint_fn = checkpoint
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    with captured_log("runtime.compile", logging.WARNING) as warnings:
        engine, *_ = runtime.initialize(model=model, model_parameters=model.parameters(), config=config)
    if how == "engine":
        engine.compile(backend="eager")
    gen = torch.Generator().manual_seed(1 + rank)
    losses, counts = [], []
    for _ in range(STEPS):
        for _ in range(accumulation):
            ids = torch.randint(0, 64, (MICRO, SEQ + 1), generator=gen)
            loss = engine(ids[:, :-1], ids[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        counts.append(compile_counts())
    return losses, counts, engine, warnings


def _case(
    rank: int, world: int, stage: int, accumulation: int, ckpt: bool, offload: bool, how: str = "engine"
) -> dict:
    eager, _, plain, _ = _train(rank, world, stage, accumulation, ckpt, offload, None)
    compiled, counts, engine, warnings = _train(rank, world, stage, accumulation, ckpt, offload, how)
    return {
        "eager": eager, "compiled": compiled, "counts": counts, "warnings": warnings,
        "plan": getattr(engine, "compile_plan", None),  # none for a model compiled in place
        "keys": (sorted(plain.module.state_dict()), sorted(engine.module.state_dict())),
    }  # fmt: skip


def _check(result: dict, whole_model: bool) -> None:
    torch.testing.assert_close(result["compiled"], result["eager"], rtol=1e-5, atol=1e-6)
    counts = result["counts"]
    assert counts[0]["graphs_compiled"] > 0
    assert counts[-1] == counts[0], counts  # nothing compiled after the first step: no recompile
    assert counts[-1]["graph_breaks"] == 0
    assert result["plan"].whole_model is whole_model
    assert not result["plan"].loss  # our GPT has no `loss_function` of Hugging Face's


@pytest.mark.parametrize(
    ("stage", "accumulation", "ckpt", "offload", "whole"),
    [
        (0, 1, False, False, True),
        (1, 2, False, False, True),
        (2, 2, True, False, True),
        (3, 1, True, True, False),
    ],
)
def test_compiled_engine_equals_eager_world1(
    stage: int, accumulation: int, ckpt: bool, offload: bool, whole: bool
) -> None:
    (result,) = run_distributed(_case, 1, stage, accumulation, ckpt, offload)
    _check(result, whole)
    regions = ("tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f", "lm_head")
    assert result["plan"].regions == (regions if not whole else ("", *regions))


def test_compiled_zero3_world2_with_accumulation_and_checkpointing():
    results = run_distributed(_case, 2, 3, 2, True, False)
    for result in results:
        _check(result, whole_model=False)


@pytest.mark.parametrize(("stage", "whole"), [(2, True), (3, False)])
def test_a_model_compiled_before_initialize_is_compiled_by_the_engines_plan(stage: int, whole: bool) -> None:
    """`deepspeed.initialize(model=torch.compile(model))`, what many DeepSpeed users write: the engine
    trains the module inside the `OptimizedModule` and compiles it by its own plan with the same backend
    (run as it came, dynamo would trace ZeRO-3's gather hooks and fail). Over two ranks the losses equal
    the eager engine's, nothing recompiles after the first step, and the weights keep their own names
    (no `_orig_mod.` prefix in a checkpoint)."""
    for result in run_distributed(_case, 2, stage, 1, False, False, "before"):
        _check(result, whole)
        plain, compiled = result["keys"]
        assert compiled == plain and not any("_orig_mod" in key for key in compiled)


def test_a_model_compiled_in_place_before_initialize_trains_and_is_told_what_zero3_costs_it() -> None:
    """`model.compile()` before initialize at ZeRO-3: it trains as the eager engine does, and rank 0
    says once that only the layers below the gather hooks run compiled, and that engine.compile() is
    the way (its compiler cannot be read back from the module to recompile it by the plan)."""
    results = run_distributed(_case, 2, 3, 1, False, False, "in place")
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["compiled"], result["eager"], rtol=1e-5, atol=1e-6)
        assert len(result["warnings"]) == (1 if rank == 0 else 0), result["warnings"]
    assert "call engine.compile() after initialize instead" in results[0]["warnings"][0]


# -- the config's compile section ---------------------------------------------------------------------------


def _load(section: dict) -> Any:
    return load_config({"train_batch_size": 2, "compile": section}, world_size=1)


def test_deepcompile_is_read_with_a_note_saying_what_it_means_here():
    config = _load({"deepcompile": True, "double_buffer": True, "free_activation": False})
    assert config.compile.deepcompile
    assert any(n.startswith("compile.deepcompile: true: engine.compile() compiles") for n in config.notes)


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("offload_activation", "activation_checkpointing.cpu_checkpointing"),
        ("offload_opt_states", "zero_optimization.offload_optimizer"),
        ("symmetric_memory", "symmetric-memory"),
        ("offload_parameters", "zero_optimization.offload_param"),
        ("autoep_non_moe", "no AutoEP"),
    ],
)
def test_deepcompile_features_we_lack_are_refused_by_key(key: str, hint: str):
    with pytest.raises(ConfigError) as error:
        _load({"deepcompile": True, key: True})
    assert str(error.value).startswith(f"compile.{key}: a DeepSpeed option dslaunch does not support")
    assert hint in str(error.value)


# DeepSpeed 0.19.8's CompileConfig with every key at its default (deepspeed/compile/config.py)
DEEPSPEED_DEFAULTS = {
    "deepcompile": False, "autoep_non_moe": False, "free_activation": False,
    "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
    "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
    "symmetric_memory": False, "debug_log": False, "offload_parameters": False, "sync_before_reduce": False,
    "sync_after_reduce": False, "sync_before_allgather": False, "sync_after_allgather": False,
    "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None,
}  # fmt: skip


def test_deepspeeds_whole_compile_section_at_its_defaults_reads_without_a_note():
    config = _load(DEEPSPEED_DEFAULTS)
    assert not config.compile.deepcompile and config.compile.passes is None
    assert not [n for n in config.notes if n.startswith("compile.")]


def test_deepcompiles_zero_passes_are_read_and_its_parallelism_passes_refused():
    config = _load({"deepcompile": True, "passes": ["z1", "Z3"], "sync_after_allgather": True})
    assert config.compile.passes == ("z1", "z3")
    assert any(n.startswith("compile.passes: ['z1', 'z3']: DeepCompile's ZeRO passes") for n in config.notes)
    assert any(n.startswith("compile.sync_after_allgather: True ignored") for n in config.notes)
    with pytest.raises(ConfigError) as error:
        _load({"deepcompile": True, "passes": ["z3", "autotp"]})
    assert str(error.value).startswith("compile.passes[1]: a DeepSpeed option dslaunch does not support")
    assert "tensor_parallel" in error.value.hint
    with pytest.raises(ConfigError, match=r"compile\.passes\[0\]: expected one of 'z1', 'z3', 'autosp'"):
        _load({"passes": ["z2"]})
    with pytest.raises(ConfigError, match=r"compile\.passes: expected a list of pass names"):
        _load({"passes": "z3"})


def test_a_typo_in_the_compile_section_gets_did_you_mean():
    with pytest.raises(ConfigError, match=r'compile\.deepcompil: unknown key; did you mean "deepcompile"'):
        _load({"deepcompil": True})


# -- the Hugging Face route: TrainingArguments(torch_compile=True) with a DeepSpeed config ---------------


def _trainer_losses(rank: int, world: int, out: str) -> dict:
    import sys

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    sys.path.insert(0, str(TESTS / "scripts"))
    from hf_trainer import SEQ, VOCAB, RecordLosses, Tokens

    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "train_batch_size": "auto", "zero_optimization": {"stage": 3},
          "compile": {"deepcompile": True}}  # fmt: skip
    result: dict = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to="none",
            seed=0, deepspeed=ds, disable_tqdm=True, learning_rate=3e-3, save_strategy="no",
            torch_compile=compiled, torch_compile_backend="eager" if compiled else None,
        )  # fmt: skip
        recorder = RecordLosses()
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(32), callbacks=[recorder])
        trainer.train()
        engine = trainer.model_wrapped
        result[compiled] = (recorder.losses, engine.is_compiled, getattr(engine, "compile_plan", None))
    return result


def test_trainer_torch_compile_with_a_deepspeed_config_compiles_our_engine(tmp_path) -> None:
    """Accelerate calls engine.compile(backend, compile_kwargs) for torch_compile=True: ZeRO-3 over two
    ranks trains to the same losses compiled, through the per-unit path."""
    results = run_distributed(_trainer_losses, 2, str(tmp_path))
    for result in results:
        (eager, eager_compiled, _), (losses, is_compiled, plan) = result[False], result[True]
        assert (eager_compiled, is_compiled) == (False, True)
        assert not plan.whole_model and "transformer.h.0" in plan.regions
        assert plan.loss  # HF's loss from the logits runs compiled too, not in the eager glue
        assert len(losses) == 3
        torch.testing.assert_close(losses, eager, rtol=1e-5, atol=1e-6)


# -- Accelerate's regional compilation: `accelerate launch --dynamo_use_regional_compilation` --------------


def _accelerate_losses(rank: int, world: int) -> dict:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from runtime.compile import compile_counts

    result: dict = {}
    for regional in (False, True):
        AcceleratorState._reset_state(reset_partial_state=True)
        dynamo = TorchDynamoPlugin(backend="eager", use_regional_compilation=True) if regional else None
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=1, gradient_clipping=1.0)
        accelerator = Accelerator(deepspeed_plugin=plugin, dynamo_plugin=dynamo)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        rows = torch.randint(0, 64, (STEPS * MICRO * world, SEQ), generator=torch.Generator().manual_seed(1))
        loader = DataLoader(TensorDataset(rows), batch_size=MICRO)
        # `prepare` wraps the model in our engine, then compiles every block of `engine.module` in place
        # (accelerate.utils.compile_regions_deepspeed: `block.compile()`, the hooks inside `_call_impl`)
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        counters.clear()
        counts: list[dict[str, int]] = []
        record = functools.partial(lambda into: into.append(compile_counts()), counts)
        losses = train_prepared(accelerator, engine, optimizer, loader, record)
        hooked = [name for name, module in engine.module.named_modules() if module._forward_pre_hooks]
        result[regional] = {"losses": losses, "counts": counts, "hooked": hooked}
    return result


def test_accelerate_regional_compilation_of_a_zero3_engine_equals_eager() -> None:
    """Accelerate compiles each block of the engine's module in place (`nn.Module.compile`: the compiled
    function is `_call_impl`, which runs our ZeRO-3 gather and release hooks). Dynamo never traces
    `_call_impl` (torch.nn's own frame, in its skip list) and compiles the block's `forward` under it, so
    the hooks run eager around the graph: the same split as engine.compile()'s regions. Over two
    ranks the losses equal the uncompiled run's, and no step after the first compiles again or breaks a
    graph."""
    for result in run_distributed(_accelerate_losses, 2):
        eager, regional = result[False], result[True]
        assert "transformer.h.0" in regional["hooked"]  # the blocks carry gather hooks: sharded parameters
        assert eager["counts"][-1]["graphs_compiled"] == 0
        counts = regional["counts"]
        assert counts[0]["graphs_compiled"] >= 1 and counts[0]["calls_captured"] > 0, counts
        assert counts[-1] == counts[0], counts  # nothing compiled after the first step
        assert counts[-1]["graph_breaks"] == 0
        assert len(regional["losses"]) == STEPS
        torch.testing.assert_close(regional["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
