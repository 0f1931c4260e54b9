"""What a user sees when `initialize` or a checkpoint call is given the wrong thing (issue 30's second sweep).

- `runtime.initialize` given an argument of a kind it does not take (no model, a function as the model, a
  number as the optimizer, model_parameters, training_data or lr_scheduler, the config twice or never)
  refuses it up front with a one-line UserError naming the argument, and still raises the TypeError /
  ValueError such calls raised before. DeepSpeed's own forms (a callable optimizer or scheduler) pass.
- On a one-rank world: an optimizer over another model's parameters and a model with nothing to train are
  UserErrors with a fix; `save_checkpoint(None)` names save_dir; a checkpoint of a 4->8->2 MLP loaded
  into a 4->16->2 one names the FIRST layer that differs with both shapes; a tag's folder or a file given
  as the checkpoint directory is named as such, by load_checkpoint and by ds_consolidate, and an output
  ds_consolidate cannot write is one line naming that output.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime
from tests.support.dist import run_distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 0,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


def _mlp(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _function_model() -> nn.Module:
    return _mlp()


WRONG_ARGUMENTS = {
    "no model": (dict(model=None), "runtime.initialize needs model=<torch.nn.Module>"),
    "a function as model": (
        dict(model=_function_model),
        "model must be a torch.nn.Module, got function (a function or class: call it to build the model)",
    ),
    "a number as optimizer": (dict(optimizer=5), "optimizer must be a torch.optim.Optimizer or a callable"),
    "a number as model_parameters": (dict(model_parameters=5), "model_parameters must be an iterable"),
    "the model as model_parameters": (
        dict(model_parameters=_mlp()),
        "model_parameters must be an iterable of tensors or of param-group dicts, got Sequential",
    ),
    "a number as training_data": (dict(training_data=5), "training_data must be a dataset"),
    "a number as lr_scheduler": (dict(lr_scheduler=5), "lr_scheduler must be a scheduler (with a step()"),
    "config and config_params": (
        dict(config_params=CONFIG),
        "runtime.initialize got a config twice: config= and config_params=",
    ),
    "config and args.deepspeed_config": (
        dict(args=argparse.Namespace(deepspeed_config="ds.json")),
        "got a config twice: config= and args.deepspeed_config",
    ),
    "no config": (dict(config=None), "runtime.initialize needs a config"),
}


@pytest.mark.parametrize("case", list(WRONG_ARGUMENTS))
def test_initialize_names_the_argument_of_the_wrong_kind(case: str) -> None:
    overrides, message = WRONG_ARGUMENTS[case]
    kwargs = {"model": _mlp(), "config": CONFIG, **overrides}
    with pytest.raises(runtime.UserError) as info:
        runtime.initialize(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert info.value.hint  # says what to pass instead
    assert isinstance(info.value, (TypeError, ValueError))  # what such calls raised before


def _one_rank(rank: int, world: int, root: str) -> dict:
    def error_of(fn) -> tuple[str, str, str]:
        try:
            fn()
        except Exception as error:  # the kind is asserted: a UserError subclass
            return type(error).__name__, str(error), getattr(error, "hint", "")
        return ("none", "", "")

    out = {}
    out["foreign_optimizer"] = error_of(
        lambda: runtime.initialize(
            model=_mlp(), optimizer=torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1), config=CONFIG
        )
    )
    out["nothing_to_train"] = error_of(
        lambda: runtime.initialize(model=_mlp(), model_parameters=[], config=CONFIG)
    )
    # DeepSpeed's callable forms still pass
    engine, _, _, scheduler = runtime.initialize(
        model=_mlp(),
        optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1),
        config={k: v for k, v in CONFIG.items() if k != "optimizer"},
    )
    out["callables"] = type(scheduler).__name__
    out["save_none"] = error_of(lambda: engine.save_checkpoint(None))
    engine.save_checkpoint(root, tag="t1")
    Path(root, "afile").write_text("not a checkpoint")
    out["tag_folder"] = error_of(lambda: engine.load_checkpoint(os.path.join(root, "t1")))
    out["a_file"] = error_of(lambda: engine.load_checkpoint(os.path.join(root, "afile")))
    wider, _, _, _ = runtime.initialize(model=_mlp(16), config=CONFIG)
    out["other_shape"] = error_of(lambda: wider.load_checkpoint(root))
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return run_distributed(_one_rank, 1, str(root), timeout=120)[0], root


def test_an_optimizer_that_does_not_fit_the_model_is_explained(one_rank: tuple[dict, Path]) -> None:
    out, _ = one_rank
    kind, message, hint = out["foreign_optimizer"]
    assert kind == "ParameterGroupError"
    assert message == (
        "the optimizer's param group 0 holds a tensor of shape (3, 3) that is not a parameter of the model "
        "given to runtime.initialize"
    )
    assert "torch.optim.AdamW(model.parameters())" in hint
    kind, message, hint = out["nothing_to_train"]
    assert kind == "ParameterGroupError" and message.startswith("no trainable parameters") and hint
    assert out["callables"] == "StepLR"


def test_checkpoint_paths_of_the_wrong_kind_are_named(one_rank: tuple[dict, Path]) -> None:
    out, root = one_rank
    kind, message, _ = out["save_none"]
    assert kind == "InitializeArgumentError"
    assert message == "save_dir must name a directory (a str or os.PathLike), got NoneType None"
    kind, message, hint = out["tag_folder"]
    assert message.startswith(f"{root}/t1 is the folder of one checkpoint (tag 't1')")
    assert hint.startswith(f"load_checkpoint({str(root)!r}, tag='t1')")
    kind, message, _ = out["a_file"]
    assert message == f"{root}/afile is a file, not a checkpoint directory"


def test_a_checkpoint_of_other_sizes_names_the_first_layer_that_differs(one_rank: tuple[dict, Path]) -> None:
    kind, message, hint = one_rank[0]["other_shape"]
    assert kind == "CheckpointMismatch"
    assert message == (
        "parameter '0.weight': shape [8, 4] in the checkpoint, [16, 4] in the model (2 more differ)"
    )
    assert "option named above" not in hint and "sizes it was saved with" in hint


def _consolidate(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """ds_consolidate's exit code and stderr (its main, run in this process)."""
    from runtime.checkpoint.consolidate import main

    code = main(list(args))
    return code, capsys.readouterr().err


def test_ds_consolidate_names_a_misplaced_input_and_an_unwritable_output(
    one_rank: tuple[dict, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _, root = one_rank
    # one tag's folder is read in place (as DeepSpeed users pass it); another tag beside it is named
    from runtime.checkpoint import load_state_dict_file

    out, ref = tmp_path / "out.safetensors", tmp_path / "ref.safetensors"
    assert _consolidate(capsys, str(root / "t1"), str(out))[0] == 0
    assert _consolidate(capsys, str(root), str(ref), "--tag", "t1")[0] == 0
    got, want = load_state_dict_file(out), load_state_dict_file(ref)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    code, err = _consolidate(capsys, str(root / "t1"), str(tmp_path / "out.safetensors"), "--tag", "t9")
    assert code == 1
    assert f"error: {root}/t1 is the folder of checkpoint tag 't1', not of tag 't9'" in err
    assert f"hint: pass the directory holding the tags, {root}, with tag 't9' (tags there: t1" in err
    code, err = _consolidate(capsys, str(root / "afile"), str(tmp_path / "out.safetensors"))
    assert code == 1 and f"error: {root}/afile is a file, not a checkpoint directory" in err
    output = root / "afile" / "out.safetensors"  # a file where its folder should be
    code, err = _consolidate(capsys, str(root), str(output))
    assert code == 1
    assert err.splitlines()[0] == f"ds_consolidate: error: cannot write {output}: File exists ({root}/afile)"
