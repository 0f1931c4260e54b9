"""ZeRO-3 pieces that need no processes: unit planning, execution traces, and released parameters."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from torch import nn

from runtime.models import GPT, GPTConfig
from runtime.zero import stage3_param
from runtime.zero.stage3_param import ParamNotGathered, ShardedParameter
from runtime.zero.stage3_plan import UnitKind, plan_units
from runtime.zero.stage3_trace import ExecutionTrace, prefetch_candidates, reuse_distance
from tests.support.zero3_models import make_zero_net


def _units(model: nn.Module, threshold: int) -> dict[str, tuple]:
    plans = plan_units(model, [p for p in model.parameters() if p.requires_grad], threshold=threshold)
    return {p.root: (p.kind, p.params, p.users, p.persistent) for p in plans}


# -- planning ------------------------------------------------------------------------------------------
def test_gpt_blocks_are_units_and_the_tied_head_uses_the_embedding_unit() -> None:
    model = GPT(GPTConfig.named("tiny"))
    units = _units(model, threshold=0)
    # threshold 0: every module with parameters of its own is a unit, so the model keeps none itself
    assert list(units) == ["tok_emb", "pos_emb", *[f"blocks.{i}" for i in range(4)], "ln_f"]
    kind, params, users, _ = units["tok_emb"]
    assert kind is UnitKind.MODULE and params == ("tok_emb.weight",) and users == ("tok_emb", "lm_head")
    kind, params, _, _ = units["blocks.2"]
    assert kind is UnitKind.BLOCK and len(params) == 12 and all(p.startswith("blocks.2.") for p in params)
    assert units["ln_f"][1] == ("ln_f.weight", "ln_f.bias")
    assert not any(u[3] for u in units.values())


def test_small_modules_fold_into_their_parent_and_small_units_stay_gathered() -> None:
    model = GPT(GPTConfig.named("tiny"))  # embeddings of 32768 elements, blocks of ~198k
    units = _units(model, threshold=100_000)
    assert list(units) == ["", *[f"blocks.{i}" for i in range(4)]]
    kind, params, users, persistent = units[""]
    assert kind is UnitKind.ROOT and persistent and users == ("",)
    assert set(params) == {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "ln_f.bias"}
    assert not any(units[f"blocks.{i}"][3] for i in range(4))


def test_zero_net_units() -> None:
    units = _units(make_zero_net(), threshold=50)
    assert units["emb"][2] == ("emb", "head")  # tied: head gathers emb's unit
    assert units[""][1] == ("norm.weight", "norm.bias") and units[""][3]  # 48 elements: persistent
    assert set(units) == {"", "emb", "blocks.0", "blocks.1", "shared", "out"}


def test_a_module_registered_twice_becomes_a_user_and_frozen_parameters_are_left_out() -> None:
    shared = nn.Linear(8, 8)
    model = nn.Module()
    model.a = shared
    model.b = shared
    model.frozen = nn.Linear(8, 8)
    model.frozen.requires_grad_(False)
    units = _units(model, threshold=1)
    assert units["a"][2] == ("a", "b")
    assert "frozen" not in units and all("frozen" not in p for u in units.values() for p in u[1])


def test_parameters_outside_the_module_tree_are_refused() -> None:
    with pytest.raises(ValueError, match="not registered in the model's module tree"):
        plan_units(nn.Linear(2, 2), [nn.Parameter(torch.zeros(3))], threshold=0)


# -- traces --------------------------------------------------------------------------------------------
def test_trace_records_then_follows_and_rerecords_after_a_departure() -> None:
    trace = ExecutionTrace()
    trace.begin()
    for unit in (0, 1, 2, 1, 3):
        assert not trace.need(unit)  # recording
    trace.end()
    assert trace.recorded == [0, 1, 2, 1, 3]
    trace.begin()
    assert trace.need(0) and list(trace.upcoming()) == [1, 2, 1, 3]
    assert trace.need(1)
    assert not trace.need(3)  # the model took another path
    assert trace.invalidations == 1 and list(trace.upcoming()) == []
    trace.need(4)
    trace.end()
    assert trace.recorded == [0, 1, 3, 4]
    trace.begin()
    trace.need(0)
    trace.end()  # ended early: not this model's path either
    assert trace.recorded == [0] and trace.invalidations == 2


def test_prefetch_respects_both_budgets_and_order() -> None:
    sizes = {1: 10, 2: 30, 3: 10, 4: 5}
    pick = lambda **kw: prefetch_candidates([1, 2, 3, 1, 4], sizes.__getitem__, lambda u: u == 3, **kw)  # noqa: E731
    assert pick(prefetch_left=100, live_left=100) == [1, 2, 4]
    assert pick(prefetch_left=35, live_left=100) == [1]  # 2 does not fit, and nothing overtakes it
    assert pick(prefetch_left=100, live_left=9) == []


def test_a_unit_larger_than_the_prefetch_bucket_is_prefetched_when_nothing_else_is_in_flight() -> None:
    # DeepSpeed's soft bucket: a 10B model's layer is larger than the default 5e7 elements, and must
    # still upload while the layer before it computes (offload_param); the live limit stays hard
    sizes = {1: 300, 2: 300, 3: 10}
    pick = lambda **kw: prefetch_candidates([1, 2, 3], sizes.__getitem__, lambda u: False, **kw)  # noqa: E731
    assert pick(prefetch_left=50, live_left=10**6, nothing_in_flight=True) == [1]  # one unit, not two
    assert pick(prefetch_left=50, live_left=10**6) == []  # one is in flight already
    assert pick(prefetch_left=50, live_left=299, nothing_in_flight=True) == []
    assert pick(prefetch_left=700, live_left=10**6, nothing_in_flight=True) == [1, 2, 3]


def test_reuse_distance_counts_distinct_units_in_between() -> None:
    sizes = {1: 10, 2: 30, 3: 7}
    assert reuse_distance([2, 3, 2, 1], 1, sizes.__getitem__) == 37
    assert reuse_distance([1], 1, sizes.__getitem__) == 0
    assert reuse_distance([2, 3], 1, sizes.__getitem__) is None


# -- released parameters -------------------------------------------------------------------------------
class _Owner:
    """A ParamOwner that can gather on touch when allowed."""

    def __init__(self, values: dict[nn.Parameter, torch.Tensor], allow: bool) -> None:
        self.values, self.allow, self.touched = values, allow, 0

    def param_name(self, param: nn.Parameter) -> str:
        return "layer.weight"

    def touch(self, param: nn.Parameter):
        if not self.allow:
            return None
        self.touched += 1
        stage3_param.materialize(param, self.values[param])
        return contextlib.nullcontext()


def test_released_parameter_keeps_metadata_and_holds_no_memory() -> None:
    layer = nn.Linear(300, 200)
    weight = layer.weight
    stage3_param.release(weight)
    assert type(weight) is ShardedParameter and isinstance(weight, nn.Parameter)
    assert weight.shape == (200, 300) and weight.numel() == 60_000 and weight.dtype == torch.float32
    assert weight.requires_grad and weight.is_leaf and weight.grad is None and weight.dim() == 2
    assert weight.untyped_storage().nbytes() <= 4  # one shared element
    assert "not gathered" in repr(weight)
    assert sum(p.numel() for p in layer.parameters()) == 60_200  # counting parameters still works


def test_touching_a_released_parameter_raises_a_clear_error() -> None:
    layer = nn.Linear(3, 2)
    owner = _Owner({}, allow=False)
    stage3_param.register(layer.weight, owner)
    stage3_param.release(layer.weight)
    for action in (
        lambda: layer(torch.randn(4, 3)),
        lambda: layer.weight + 1,
        lambda: layer.weight.data,
        lambda: torch.save(layer.state_dict(), io.BytesIO()),  # keys are fine (from_pretrained), values not
        lambda: torch.save(layer.weight, io.BytesIO()),
        lambda: copy.deepcopy(layer),
    ):
        with pytest.raises(ParamNotGathered, match=r"'layer.weight' \(shape \(2, 3\)\).*GatheredParameters"):
            action()


def test_an_owner_that_can_gather_makes_the_operation_work() -> None:
    layer = nn.Linear(3, 2)
    values = layer.weight.detach().clone()
    owner = _Owner({layer.weight: values}, allow=True)
    stage3_param.register(layer.weight, owner)
    stage3_param.release(layer.weight)
    x = torch.randn(4, 3)
    out = layer(x)
    assert owner.touched == 1 and type(layer.weight) is nn.Parameter
    torch.testing.assert_close(out, x @ values.T + layer.bias)


def test_release_and_materialize_keep_a_custom_parameter_class() -> None:
    class MyParam(nn.Parameter):
        pass

    param = MyParam(torch.ones(3))
    stage3_param.release(param)
    assert type(param) is ShardedParameter
    stage3_param.materialize(param, torch.full((3,), 2.0))
    assert type(param) is MyParam and torch.equal(param.detach(), torch.full((3,), 2.0))
