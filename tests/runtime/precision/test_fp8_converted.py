"""A model that reaches the engine already converted to float8 (runtime/fp8.py `adopt_converted`), as
Accelerate's `mixed_precision="fp8"` hands it over: `accelerator.prepare` runs torchao's conversion with
FSDP2's float8 all-gather on (its default), which wraps each converted weight in a new Parameter, after
the user built the optimizer on the old ones. Device: CPU (gloo); float8 is torchao's CPU path, as in
test_fp8.py.

The engine puts the optimizer's Parameters back and trains the float8 layers as they came: equal to the
same conversion in plain PyTorch (test_fp8.py's reference and tolerances), at ZeRO 2 and 3 (also built
under zero.Init) over two ranks; and through Accelerate itself its ZeRO-3 losses equal its ZeRO-2 ones
and stay within float8's rounding of the bf16 run's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from runtime.fp8 import select_linears
from tests.runtime.precision.test_fp8 import (
    ACCUMULATION,
    LR,
    SMALL,
    STEPS,
    _config,
    _reference,
    assert_follows_reference,
    make_net,
)
from tests.support.accelerate_steps import train_prepared
from tests.support.dist import run_distributed
from tests.support.models import train_engine
from tests.support.parity import ROWS

pytest.importorskip("torchao.float8")


def _converted_after_the_optimizer(rank: int, world_size: int) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    import runtime

    out: dict[str, Any] = {}
    for name, stage, partitioned in (
        ("stage 2", 2, False),
        ("stage 3", 3, False),
        ("stage 3, built under zero.Init", 3, True),  # torchao wraps the sharded Parameters
    ):
        ds_config = _config(stage, fp8=False)
        del ds_config["optimizer"]  # the client's optimizer, built before the conversion
        if partitioned:
            with runtime.zero.Init(config_dict_or_path=ds_config):
                model = make_net(0)
        else:
            model = make_net(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # the reference's
        chosen = set(select_linears(model, SMALL).converted)  # the reference's layers
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn, c=chosen: fqn in c)
        wrapped = sum(isinstance(p, WeightWithDynamicFloat8CastTensor) for p in model.parameters())
        engine, *_ = runtime.initialize(model=model, optimizer=optimizer, config=ds_config)
        kinds = sorted({type(m).__name__ for m in engine.module.modules() if isinstance(m, nn.Linear)})
        losses, _ = train_engine(
            engine, steps=STEPS, accumulation=ACCUMULATION, rows=ROWS, rank=rank, world_size=world_size
        )
        out[name] = {
            "losses": losses,
            "master": engine.full_state_dict(),
            "kinds": kinds,
            "wrapped": wrapped,
            "plain": all(type(p) is nn.Parameter for p in engine.module.parameters()),
        }
        engine.destroy()
    return out


def test_a_model_converted_after_its_optimizer_trains_as_converted_plain_pytorch() -> None:
    got = run_distributed(_converted_after_the_optimizer, 2)[0]
    reference = _reference(2)
    for name, run in got.items():
        assert run["wrapped"] == 4, name  # torchao wrapped the four block linears' weights
        assert run["plain"], name  # and the engine holds plain Parameters again
        assert run["kinds"] == ["Float8Linear", "Linear"], name
        assert_follows_reference(run, reference, name)


# -- through Accelerate: mixed_precision="fp8" with a DeepSpeedPlugin ---------------------------------------
SEQ, MICRO, BATCHES = 16, 2, 3


def _accelerate_fp8(rank: int, world_size: int) -> dict:
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import AORecipeKwargs
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    out: dict[str, Any] = {}
    for name, stage, precision in (("bf16", 3, "bf16"), ("fp8 stage 2", 2, "fp8"), ("fp8 stage 3", 3, "fp8")):
        AcceleratorState._reset_state(reset_partial_state=True)
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=1, gradient_clipping=1.0)
        handlers = [AORecipeKwargs()] if precision == "fp8" else []
        accelerator = Accelerator(
            deepspeed_plugin=plugin, mixed_precision=precision, kwargs_handlers=handlers
        )
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
        model = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        rows = torch.randint(0, 64, (BATCHES * MICRO * world_size, SEQ), generator=gen)
        loader = DataLoader(TensorDataset(rows), batch_size=MICRO)
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = train_prepared(accelerator, engine, optimizer, loader)
        float8 = sum(type(m).__name__ == "Float8Linear" for m in engine.module.modules())
        out[name] = {"losses": losses, "float8": float8, "engine": type(engine).__module__}
    return out


def test_accelerate_mixed_precision_fp8_trains_with_a_deepspeed_plugin() -> None:
    for got in run_distributed(_accelerate_fp8, 2):
        bf16, fp8_2, fp8_3 = got["bf16"], got["fp8 stage 2"], got["fp8 stage 3"]
        assert fp8_3["engine"] == "runtime.engine.engine"  # our engine, under DeepSpeed's name
        # Accelerate converts every linear but the first and the last: 2 layers x 7, less q_proj of layer 0
        assert (bf16["float8"], fp8_2["float8"], fp8_3["float8"]) == (0, 13, 13)
        assert len(fp8_3["losses"]) == BATCHES
        assert fp8_3["losses"] == fp8_2["losses"]  # one rank's arithmetic at either stage
        for a, b in zip(fp8_3["losses"], bf16["losses"], strict=True):
            assert a != b and abs(a - b) <= 0.01 * abs(b)  # float8's matmuls, within their rounding


def test_the_fp8_section_converts_only_what_is_not_float8_yet() -> None:
    from torchao.float8 import convert_to_float8_training

    from runtime.fp8 import convert_model

    model = make_net(0)
    convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn == "blocks.0.0")
    first = model.blocks[0][0]
    selection = convert_model(model, SMALL)
    assert selection.already == ("blocks.0.0",)
    assert selection.converted == ("blocks.0.2", "blocks.1.0", "blocks.1.2")
    assert model.blocks[0][0] is first  # left as it came, not converted a second time
    assert selection.summary("tensorwise") == (
        "fp8: 3 of 6 linear layers train in float8 (tensorwise scaling), and 1 more came converted by "
        "torchao (left as they are); kept in bf16: inp (dims not divisible by 16), out (dims not "
        "divisible by 16)"
    )
