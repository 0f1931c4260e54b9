"""DeepSpeedExamples' `training/pipeline_parallelism/train.py`, its `train_pipe` as written, on 2 gloo ranks.

The example seeds with `torch.manual_seed` and `deepspeed.runtime.utils.set_random_seed`, builds a
`PipelineModule` of an AlexNet's layers ("parameters" partition, 2 stages), hands the dataset to
`deepspeed.initialize(args=..., training_data=...)` and calls `engine.train_batch()` with no iterator.
Here the layers are LayerSpecs of a small AlexNet-like net (3x8x8 images, random tensors), so the module
builds them itself and the seed decides their weights, as in DeepSpeed:

- the initial weights equal DeepSpeed's recipe, computed below with plain torch (DeepSpeed 0.19.8's
  `PipelineModule.__init__`: without `seed_layers`, the "parameters" partition builds every spec once to
  count its parameters, then the stage builds its own from the generator as it stands; with
  `seed_layers`, `set_random_seed(base_seed + layer index)` before each layer), at 1 and 2 stages;
- the losses of `train_batch()` / `eval_batch()` without an iterator equal those with DeepSpeed's loader
  built by hand (a sampler over the data-parallel ranks, in order, micro-batch sized, repeating), and a
  single process without pipeline that trains the same weights on the same samples.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import numpy
import pytest
import torch
from torch import nn

from runtime.pipe import LayerSpec
from tests.support.dist import run_distributed

SEED, BASE_SEED = 1138, 1234  # the example's --seed; PipelineModule's default base_seed
MICRO, GAS, STEPS, SAMPLES, CLASSES = 4, 2, 3, 28, 5  # 3 steps + 2 evals read 36: the data wraps once
CONFIG = {  # the example's ds_config.json, smaller
    "train_batch_size": MICRO * GAS,
    "train_micro_batch_size_per_gpu": MICRO,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "steps_per_print": 0,
}


def flatten(x: torch.Tensor) -> torch.Tensor:
    return torch.flatten(x, 1)


def layers() -> list[Any]:
    """An AlexNet's shape (features, flatten, classifier), LayerSpecs so that the seed decides."""
    return [
        LayerSpec(nn.Conv2d, 3, 4, 3, padding=1),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.MaxPool2d, 2),
        LayerSpec(nn.Conv2d, 4, 4, 3, padding=1),
        LayerSpec(nn.ReLU),
        flatten,
        LayerSpec(nn.Linear, 4 * 4 * 4, 16),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, 16, CLASSES),
    ]


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    images = torch.randn(SAMPLES, 3, 8, 8, generator=gen)
    return torch.utils.data.TensorDataset(images, torch.randint(0, CLASSES, (SAMPLES,), generator=gen))


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _example(rank: int, world_size: int, config_path: str, save_dir: str) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import RepeatingLoader

    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args(["--deepspeed_config", config_path])
    out: dict[str, Any] = {}

    def seeded_module(num_stages: int = 2, **kwargs: Any) -> Any:
        torch.manual_seed(SEED)
        deepspeed.runtime.utils.set_random_seed(SEED)
        return PipelineModule(
            layers=layers(),
            loss_fn=torch.nn.CrossEntropyLoss(),
            num_stages=num_stages,
            partition_method="parameters",
            activation_checkpoint_interval=0,
            **kwargs,
        )

    # train_pipe, as the example writes it
    net = seeded_module()
    out |= {"stage": net.stage_id, "parts": list(net.parts), "initial": _weights(net)}
    engine, _, loader, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=dataset(),
    )
    out["losses"] = [float(engine.train_batch()) for _ in range(STEPS)]
    out["eval"] = float(engine.eval_batch())
    out["eval_one"] = float(engine.eval_batch(num_micro_batches=1))  # fewer than the stages: GPipe
    out["loader_batches"] = len(loader)

    # the same with DeepSpeed's loader built by hand and given to train_batch
    net = seeded_module()
    engine, *_ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
    sampler = torch.utils.data.DistributedSampler(
        dataset(),
        num_replicas=engine.grid.get_data_parallel_world_size(),
        rank=engine.grid.get_data_parallel_rank(),
        shuffle=False,
    )
    data_iter = iter(RepeatingLoader(torch.utils.data.DataLoader(dataset(), MICRO, sampler=sampler)))
    out["by_hand"] = [float(engine.train_batch(data_iter)) for _ in range(STEPS)]
    out["by_hand_eval"] = float(engine.eval_batch(data_iter))
    out["by_hand_eval_one"] = float(engine.eval_batch(data_iter, num_micro_batches=1))

    # a checkpoint after 2 steps keeps the loader's place: the resumed run reads step 3's batch
    def example_engine() -> Any:
        net = seeded_module()
        return deepspeed.initialize(
            args=args, model=net, model_parameters=net.parameters(), training_data=dataset()
        )[0]

    engine = example_engine()
    for _ in range(2):
        engine.train_batch()
    engine.save_checkpoint(save_dir)
    engine = example_engine()
    engine.load_checkpoint(save_dir)
    out["resumed"] = float(engine.train_batch())

    # initial weights at 2 stages and at 1 (pp1 x dp2), with and without seed_layers
    out["seeded"] = _weights(seeded_module(seed_layers=True))
    out["pp1"] = _weights(seeded_module(1))
    out["pp1_seeded"] = _weights(seeded_module(1, seed_layers=True))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("example")
    config = root / "ds_config.json"
    config.write_text(json.dumps(CONFIG), encoding="utf-8")
    return run_distributed(_example, 2, str(config), str(root / "ckpt"), timeout=240)


# -- DeepSpeed's recipe, in plain torch ------------------------------------------------------------------
def _set_random_seed(seed: int) -> None:
    """deepspeed.runtime.utils.set_random_seed: Python's, numpy's and torch's generators."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def _build(spec: LayerSpec) -> nn.Module:
    return spec.typename(*spec.module_args, **spec.module_kwargs)


def deepspeed_initial_weights(first: int, stop: int, seed_layers: bool) -> dict[str, torch.Tensor]:
    """The weights DeepSpeed's PipelineModule gives layers [first, stop) (one stage) after the example's
    seeding: unseeded, after its "parameters" count built every spec once; seeded, each layer reseeded."""
    torch.manual_seed(SEED)
    _set_random_seed(SEED)
    specs = layers()
    if not seed_layers:
        for spec in specs:  # _count_layer_params builds each spec for real, one after another
            if isinstance(spec, LayerSpec):
                _build(spec)
    weights = {}
    for index in range(first, stop):
        if seed_layers:
            _set_random_seed(BASE_SEED + index)
        if isinstance(specs[index], LayerSpec):
            for name, value in _build(specs[index]).state_dict().items():
                weights[f"{index}.{name}"] = value
    return weights


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_a_seed_gives_deepspeeds_initial_weights_at_two_stages_and_at_one(results: list[dict]) -> None:
    parts = results[0]["parts"]
    assert [r["stage"] for r in results] == [0, 1] and results[1]["parts"] == parts
    assert parts == [0, 6, 9]  # by parameters: the convolutions | the classifier
    for r in results:
        first, stop = parts[r["stage"]], parts[r["stage"] + 1]
        _assert_equal(r["initial"], deepspeed_initial_weights(first, stop, seed_layers=False))
        _assert_equal(r["seeded"], deepspeed_initial_weights(first, stop, seed_layers=True))
        _assert_equal(r["pp1"], deepspeed_initial_weights(0, 9, seed_layers=False))
        _assert_equal(r["pp1_seeded"], deepspeed_initial_weights(0, 9, seed_layers=True))


class _Whole(nn.Module):
    """All layers in one module, each stage's with the weights that stage started from."""

    def __init__(self, initial: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.funcs = [_build(spec) if isinstance(spec, LayerSpec) else spec for spec in layers()]
        for index, func in enumerate(self.funcs):
            if isinstance(func, nn.Module):
                self.add_module(str(index), func)
        self.load_state_dict(initial)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for func in self.funcs:
            x = func(x)
        return x


def test_train_batch_without_an_iterator_reads_deepspeeds_loader(results: list[dict]) -> None:
    initial = {**results[0]["initial"], **results[1]["initial"]}
    model = _Whole(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-8)
    data = dataset()
    order = [i % SAMPLES for i in range(MICRO * (GAS * (STEPS + 1) + 1))]  # in order, one data rank
    micro_batches = [order[i : i + MICRO] for i in range(0, len(order), MICRO)]
    losses = []
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        step_losses = []
        for indices in micro_batches[step * GAS : (step + 1) * GAS]:
            images, labels = data[indices]
            loss = nn.functional.cross_entropy(model(images), labels)
            step_losses.append(float(loss.detach()))
            if step < STEPS:
                (loss / GAS).backward()
        if step < STEPS:
            optimizer.step()
        losses.append(sum(step_losses) / GAS)
    with torch.no_grad():
        images, labels = data[micro_batches[-1]]
        eval_one = float(nn.functional.cross_entropy(model(images), labels))
    assert results[0]["loader_batches"] == SAMPLES // MICRO  # this data rank's (the only one's) samples
    for r in results:
        assert r["losses"] == r["by_hand"] and r["eval"] == r["by_hand_eval"]  # the same batches
        assert r["losses"] == pytest.approx(losses[:STEPS], rel=1e-5)  # the pipeline tests' tolerance
        assert r["eval"] == pytest.approx(losses[STEPS], rel=1e-5)
        assert r["eval_one"] == r["by_hand_eval_one"] == pytest.approx(eval_one, rel=1e-5)
        assert r["resumed"] == pytest.approx(r["losses"][2], rel=1e-6)  # the loader's place came back


def test_the_example_script_names_resolve() -> None:
    """What train.py imports besides the model: set_random_seed under DeepSpeed's path (issue 29)."""
    import deepspeed
    import deepspeed.runtime.utils

    from runtime.deepspeed_api.utils import set_random_seed

    assert deepspeed.runtime.utils.set_random_seed is set_random_seed
    set_random_seed(2**70 + 3)  # any int, as DeepSpeed's takes it
    first = (random.random(), float(numpy.random.rand()), float(torch.rand(())))
    _set_random_seed(2**70 + 3)
    assert (random.random(), float(numpy.random.rand()), float(torch.rand(()))) == first
