"""`offload_optimizer.ratio` before any training: which parameters go to the host for given sizes and ratio
(runtime/zero/offload_split.py), the pure choice behind `"ratio": "auto"` (`choose_ratio`, in
runtime/offload/auto_ratio.py), and the config's reading of the key, with its errors word for word. The
runs are tests/runtime/offload/test_ratio.py's.
"""

from __future__ import annotations

import pytest

ROWS = 12  # train_batch_size of the configs (one rank)

# -- the split -------------------------------------------------------------------------------------------


def test_split_count_takes_the_prefix_nearest_to_the_ratio() -> None:
    from runtime.zero.offload_split import split_count

    sizes = [155, 744, 312]  # in the order their gradients are ready
    assert split_count(sizes, 0.0) == 0
    assert split_count(sizes, 1.0) == 3
    assert split_count(sizes, 0.25) == 1  # 155 of 1211 (302.75 wanted): nearer than 0 or 899
    assert split_count(sizes, 0.5) == 2  # 899 is 294 off 605.5, 155 is 450 off
    assert split_count(sizes, 0.1) == 1  # 155 is 34 off 121.1, 0 is 121 off
    assert split_count(sizes, 0.05) == 0  # 60.55 wanted: nothing is nearer than 155
    assert split_count([10, 10, 10, 10], 0.5) == 2
    assert split_count([10, 10], 0.25) == 0  # a tie (5 off either way) keeps the shorter prefix
    assert split_count([0, 10, 0], 1.0) == 3  # 1.0 is all of them, empty ones too
    assert split_count([], 0.5) == 0


def test_split_refuses_a_ratio_outside_zero_to_one() -> None:
    from runtime.zero.offload_split import split_count

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError) as caught:
            split_count([1, 2], bad)
        assert str(caught.value) == (
            "zero_optimization.offload_optimizer.ratio must be between 0 and 1 (the share of the optimizer "
            f"on the host), got {bad}"
        )


def test_plan_split_sends_the_groups_ready_first_to_the_host() -> None:
    from runtime.zero.offload_split import plan_split

    # stage 3: four groups in model order; backward finishes them last to first
    numels, ready = [300, 40, 700, 160], [3, 2, 1, 0]
    split = plan_split(numels, ready, 0.25)
    assert (split.host, split.device) == ((3,), (0, 1, 2))  # 160 is nearest to 300 of 1200
    assert (split.host_numel, split.device_numel) == (160, 1040)
    assert split.achieved == pytest.approx(160 / 1200)
    split = plan_split(numels, ready, 0.75)
    assert (split.host, split.device) == ((1, 2, 3), (0,))  # 160 + 700 + 40 is the 900 wanted
    split = plan_split(numels, ready, 0.7)
    assert (split.host, split.device) == ((2, 3), (0, 1))  # 860 is 20 off 840, 900 is 60 off
    assert split.partial
    assert plan_split(numels, ready, 0.0).host == ()
    assert plan_split(numels, ready, 1.0).device == ()
    assert not plan_split(numels, ready, 1.0).partial
    assert plan_split([5, 5], [0, 0], 0.5).host == (0,)  # equal readiness keeps the group order


def test_split_count_at_least_gives_the_host_no_less_than_the_ratio() -> None:
    from runtime.zero.offload_split import split_count

    sizes = [155, 744, 312]
    assert split_count(sizes, 0.25, at_least=True) == 2  # 155 is short of 302.75: 899 is the first enough
    assert split_count(sizes, 0.1, at_least=True) == 1
    assert split_count(sizes, 0.8, at_least=True) == 3
    assert split_count(sizes, 0.0, at_least=True) == 0


GIB = 1 << 30
AUTO = {  # a 10.7B-element shard, Adam with bf16 weights: 16 bytes an element on the device, 14 on the host
    "shard_numel": 10 * GIB,
    "device_bytes_per_element": 16,
    "host_bytes_per_element": 14,
    "activation_bytes": 20 * GIB,
    "device_reserve": 8 * GIB,
}


def test_choose_ratio_keeps_what_fits_on_the_device() -> None:
    from runtime.offload.auto_ratio import RatioChoice, choose_ratio

    after = "free after the activations (20.0 GiB) and a reserve of 8.0 GiB"
    # 100 GiB free: 72 GiB for the state, 4.5 Gi of the 10 Gi elements; the host takes 0.55
    assert choose_ratio(device_free=100 * GIB, host_available=100 * GIB, **AUTO) == RatioChoice(
        0.55,
        "ratio 0.55: the device keeps 45% of the optimizer state (72.0 GiB), what fits in 72.0 GiB of the "
        f"device's 100.0 GiB {after}; the host holds the rest (77.0 GiB of 100.0 GiB available)",
    )
    # 62 GiB of room holds 0.3875 of the state: the host's 0.6125 rounds up to whole hundredths
    assert choose_ratio(device_free=90 * GIB, host_available=200 * GIB, **AUTO).ratio == 0.62
    assert choose_ratio(device_free=200 * GIB, host_available=0, **AUTO) == RatioChoice(
        0.0,
        "ratio 0: all of the optimizer state (160.0 GiB) fits in 172.0 GiB of the device's 200.0 GiB "
        + after,
    )
    assert choose_ratio(device_free=20 * GIB, host_available=200 * GIB, **AUTO) == RatioChoice(
        1.0,
        f"ratio 1: no optimizer state fits on the device (0.0 GiB of the device's 20.0 GiB {after}); the "
        "host holds all of it (140.0 GiB of 200.0 GiB available)",
    )


def test_choose_ratio_says_what_would_fit_when_nothing_does() -> None:
    from runtime.offload.auto_ratio import choose_ratio

    with pytest.raises(ValueError) as caught:
        choose_ratio(device_free=100 * GIB, host_available=40 * GIB, **AUTO)
    assert str(caught.value) == (
        "the optimizer state of this rank's 10,737,418,240 elements does not fit: the device can hold "
        "4,831,838,208 of them (72.0 GiB of the device's 100.0 GiB free after the activations (20.0 GiB) and "
        "a reserve of 8.0 GiB) and the host the rest only with 77.0 GiB, of 40.0 GiB available; both "
        "together hold about 7,899,671,990 elements"
    )


# -- the config ------------------------------------------------------------------------------------------


def _ratio_config(stage: int, **offload) -> dict:
    return {"train_batch_size": ROWS, "zero_optimization": {"stage": stage, "offload_optimizer": offload}}


def test_ratio_is_read_for_every_offloading_stage() -> None:
    from runtime.config import load_config

    for stage in (1, 2, 3):
        for ratio in (0, 0.3, 1):
            cfg = load_config(_ratio_config(stage, device="cpu", ratio=ratio), world_size=1)
            assert cfg.zero_optimization.offload_optimizer.ratio == ratio
            assert cfg.to_dict()["zero_optimization"]["offload_optimizer"]["ratio"] == ratio
    # "auto" is held as None until the engine chooses (runtime/offload/auto_ratio.py)
    auto = load_config(_ratio_config(3, device="cpu", ratio="auto"), world_size=1)
    assert auto.zero_optimization.offload_optimizer.ratio is None
    assert auto.to_dict()["zero_optimization"]["offload_optimizer"]["ratio"] is None
    default = load_config(_ratio_config(2, device="cpu"), world_size=1)
    assert default.zero_optimization.offload_optimizer.ratio == 1.0
    # 1.0 is the default, which the resolved config of a run without offload carries too
    plain = load_config(_ratio_config(2, device="none", ratio=1.0), world_size=1)
    assert plain.zero_optimization.offload_optimizer.device == "none"


@pytest.mark.parametrize(
    ("offload", "message"),
    [
        ({"device": "cpu", "ratio": 1.5}, "expected a number in [0.0, 1.0], got 1.5"),
        ({"device": "cpu", "ratio": -0.25}, "expected a number in [0.0, 1.0], got -0.25"),
        ({"device": "cpu", "ratio": "half"}, "expected a number in [0.0, 1.0], got str 'half'"),
        (
            {"ratio": 0.5},
            '0.5 needs offload_optimizer.device "cpu" (device is "none"): the ratio is the share of the '
            'optimizer state offloaded to the host; set "device": "cpu", or remove "ratio"',
        ),
        (
            {"device": "none", "ratio": 0.0},
            '0 needs offload_optimizer.device "cpu" (device is "none"): the ratio is the share of the '
            'optimizer state offloaded to the host; set "device": "cpu", or remove "ratio"',
        ),
        (
            {"ratio": "auto"},
            'auto needs offload_optimizer.device "cpu" (device is "none"): the ratio is the share of the '
            'optimizer state offloaded to the host; set "device": "cpu", or remove "ratio"',
        ),
    ],
)
def test_a_bad_ratio_names_the_key_and_what_it_takes(offload: dict, message: str) -> None:
    from runtime.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(_ratio_config(2, **offload), world_size=1)
    assert str(caught.value) == f"zero_optimization.offload_optimizer.ratio: {message}"


def test_ratio_belongs_to_offload_optimizer_only() -> None:
    from runtime.config import ConfigError, load_config

    zero = {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}
    config = {"train_batch_size": ROWS, "zero_optimization": zero}
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=1)
    assert str(caught.value).startswith("zero_optimization.offload_param.ratio: unknown key")
