"""zero.Init: a model built sharded never exists whole on a rank, and trains exactly like one built whole.

At world sizes 2 and 3 every rank builds an 8-layer GPT (6.5 MB in fp32) inside `runtime.zero.Init` while
its own module-registration hooks add up, at every module registration, the bytes of all live parameter
storages plus the Init shards, and assert they stay below 75% of the full model (the full model is over
the limit, so it cannot have existed). GPT's `init_weights` re-initializes every weight from the parent
after the children were sharded, so this also covers touching sharded parameters during construction.
Then, against the same GPT built without Init from the same seed:

- the initial weights are bit-identical (same RNG draws, in the same order, on full tensors);
- GatheredParameters reads an Init-sharded weight, and a change made on one rank (modifier_rank) reaches
  every rank's shard;
- stage 3 training gives the same losses and weights for both;
- a released parameter touched outside a gather names itself in the error; `module.to(dtype)` / `.cpu()`
  that change nothing keep the sharded parameters, `module.half()` is refused naming what to do; a config
  asking for stage 2 is refused; the same model built under Init trains with stage 1 too (the engine
  gathers it whole), and GatheredParameters(modifier_rank=...) updates stage 1's fp32 master shards.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as module_hooks
from torch.utils.weak import WeakIdKeyDictionary

from tests.support.dist import run_distributed

STEPS = 3


def _gpt_config():
    from runtime.models import GPTConfig

    return GPTConfig(n_layer=8, n_head=4, n_embd=128, vocab_size=256, max_seq_len=16)


def _engine_config(stage: int = 3) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
    }


def _build_under_init(limit: int) -> tuple[object, int, list[str]]:
    """Build the GPT inside zero.Init while checking live parameter bytes at each module registration."""
    import runtime
    from runtime.models import GPT
    from runtime.zero import init as zero_init
    from runtime.zero import stage3_param

    tracked = WeakIdKeyDictionary()
    peak = 0
    violations: list[str] = []

    def live_bytes() -> int:
        storages: dict[int, int] = {}
        for param in list(tracked.keys()):
            if not stage3_param.is_released(param):
                storage = param.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values()) + zero_init.shard_bytes()

    def on_param(module, name, param):
        if param is not None:
            tracked[param] = True

    def on_module(parent, name, child):
        nonlocal peak
        now = live_bytes()
        peak = max(peak, now)
        if now > limit:
            violations.append(f"{now} B of parameters alive when {type(child).__name__} was registered")

    handles = [
        module_hooks.register_module_parameter_registration_hook(on_param),
        module_hooks.register_module_module_registration_hook(on_module),
    ]
    try:
        torch.manual_seed(0)
        with runtime.zero.Init(config_dict_or_path=_engine_config()):
            model = GPT(_gpt_config())
    finally:
        for handle in handles:
            handle.remove()
    peak = max(peak, live_bytes())
    return model, peak, violations


def _train(engine, rank: int, world_size: int) -> list[float]:
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 256, (2 * world_size, 17), generator=gen)[2 * rank : 2 * rank + 2]
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _run(rank: int, world_size: int) -> dict:
    import runtime
    from runtime.models import GPT
    from runtime.zero import GatheredParameters, ParamNotGathered

    full_bytes = _gpt_config().num_params() * 4
    limit = int(0.75 * full_bytes)
    model, peak, violations = _build_under_init(limit)
    problems = list(violations)

    torch.manual_seed(0)
    plain = GPT(_gpt_config())
    released = [n for n, p in model.named_parameters() if runtime.zero.stage3_param.is_released(p)]
    if len(released) != len(list(plain.parameters())):
        problems.append(f"only {len(released)} parameters are sharded after construction")
    try:
        model.blocks[3].mlp.fc.weight.sum()
        problems.append("touching an Init-sharded parameter outside a gather did not raise")
    except ParamNotGathered as error:
        if "Linear.weight" not in str(error) or "GatheredParameters" not in str(error):
            problems.append(f"unclear error: {error}")

    # a conversion that changes nothing returns the sharded parameters (Lightning's precision plugin and
    # teardown); one that changes their dtype is refused in one line saying what to do instead
    weight = model.blocks[3].mlp.fc.weight
    converted = model.to(dtype=torch.float32).cpu().float()
    if converted is not model or model.blocks[3].mlp.fc.weight is not weight:
        problems.append("a no-op conversion replaced the sharded parameters")
    try:
        model.half()
        problems.append("module.half() on Init-sharded parameters did not raise")
    except ParamNotGathered as error:
        if "bf16/fp16 section" not in str(error) or "torch.float16" not in str(error):
            problems.append(f"unclear error: {error}")
    if not runtime.zero.stage3_param.is_released(weight) or weight.dtype != torch.float32:
        problems.append("a refused conversion changed the parameter")

    # read, then modify on the last rank, before the engine exists
    with GatheredParameters([model.tok_emb.weight, model.pos_emb.weight]):
        if not torch.equal(model.tok_emb.weight, plain.tok_emb.weight):
            problems.append("GatheredParameters: Init-built tok_emb differs from the plain build")
    with GatheredParameters(model.pos_emb.weight, modifier_rank=world_size - 1), torch.no_grad():
        if rank == world_size - 1:
            model.pos_emb.weight.mul_(0.5)
    with torch.no_grad():
        plain.pos_emb.weight.mul_(0.5)

    sharded, _, _, _ = runtime.initialize(model=model, config=_engine_config())
    whole, _, _, _ = runtime.initialize(model=plain, config=_engine_config())
    first_sharded = sharded.full_state_dict(rank0_only=False)
    first_whole = whole.full_state_dict(rank0_only=False)
    for key, value in first_whole.items():
        if not torch.equal(first_sharded[key], value):
            problems.append(f"initial {key} differs between the Init build and the plain build")
    losses = (_train(sharded, rank, world_size), _train(whole, rank, world_size))
    if losses[0] != losses[1]:
        problems.append(f"losses differ: {losses[0]} vs {losses[1]}")
    last_sharded = sharded.full_state_dict(rank0_only=False)
    for key, value in whole.full_state_dict(rank0_only=False).items():
        if not torch.equal(last_sharded[key], value):
            problems.append(f"trained {key} differs")
    sharded.destroy()
    whole.destroy()

    # refused config; a model built under Init trained by a stage that does not shard parameters
    try:
        runtime.zero.Init(config_dict_or_path=_engine_config(stage=2))
        problems.append("zero.Init accepted a stage-2 config")
    except ValueError as error:
        if "stage" not in str(error):
            problems.append(f"unclear error: {error}")
    model, _, _ = _build_under_init(limit)
    with GatheredParameters(model.pos_emb.weight, modifier_rank=0), torch.no_grad():
        model.pos_emb.weight.mul_(0.5)  # every rank changes it; rank 0's version is kept
    stage1, _, _, _ = runtime.initialize(model=model, config=_engine_config(stage=1))
    stage1_losses = _train(stage1, rank, world_size)
    if stage1_losses[0] != losses[0][0]:
        problems.append(f"stage 1 on an Init-built model: first loss {stage1_losses[0]} vs {losses[0][0]}")
    # stage 1 keeps whole working weights, but a change must still reach every rank's fp32 master shard
    with GatheredParameters(model.ln_f.bias, modifier_rank=world_size - 1), torch.no_grad():
        model.ln_f.bias.fill_(float(rank))
    if not torch.equal(
        stage1.full_state_dict(rank0_only=False)["ln_f.bias"], torch.full((128,), world_size - 1.0)
    ):
        problems.append("stage 1: GatheredParameters(modifier_rank=...) did not reach the masters")
    stage1.destroy()
    return {"problems": problems, "peak": peak, "limit": limit, "full": full_bytes}


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_init_never_holds_the_whole_model_and_trains_the_same(world_size: int) -> None:
    results = run_distributed(_run, world_size, timeout=180)
    for rank, got in enumerate(results):
        assert got["full"] > got["limit"]
        assert not got["problems"], f"rank {rank}: " + "\n".join(got["problems"])
        # the shards of the whole model plus the largest module under construction
        assert got["peak"] <= got["limit"], (
            f"rank {rank}: peak {got['peak']} B over the limit {got['limit']} B"
        )
