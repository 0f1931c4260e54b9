"""runtime.config: DeepSpeed-style configs load into typed dataclasses; bad ones fail precisely."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch

from runtime.config import (
    Config,
    ConfigError,
    OptimizerConfig,
    load_config,
    model_hidden_size,
    render_config,
)
from tests.support.paths import TESTS

HERE = TESTS
FIXTURES = HERE / "configs"
SCRIPT_CONFIGS = HERE.parent / "scripts" / "configs"


class TinyHF(torch.nn.Module):
    """Stands in for an HF model: a `config` with hidden_size, weights in a chosen dtype."""

    def __init__(self, hidden: int = 64, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = {"hidden_size": hidden}
        self.proj = torch.nn.Linear(hidden, hidden).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed's documented example configs


def test_zero2_fp16_adamw_example_loads_with_every_value():
    cfg = load_config(FIXTURES / "ds_zero2_fp16_adamw.json", world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        64,
        8,
        4,
    )
    assert cfg.fp16.enabled and cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16
    assert cfg.fp16.hysteresis == 2 and cfg.fp16.min_loss_scale == 1.0 and cfg.param_dtype == torch.float16
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print == 2000
    z = cfg.zero_optimization
    assert z.stage == 2 and z.reduce_bucket_size == 500_000_000 and isinstance(z.reduce_bucket_size, int)
    assert z.allgather_bucket_size == 500_000_000 and z.overlap_comm is False and z.contiguous_gradients
    assert cfg.optimizer == OptimizerConfig(
        "AdamW",
        {
            "lr": 0.001,
            "betas": (0.8, 0.999),
            "eps": 1e-8,
            "weight_decay": 3e-7,
            "amsgrad": False,
            "adam_w_mode": True,
            "torch_adam": False,
        },
    )
    assert cfg.scheduler.type == "WarmupLR"
    assert dict(cfg.scheduler.params) == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
        "last_batch_iteration": -1,
    }
    assert cfg.notes == ()


def test_yaml_and_json_give_the_same_config():
    from_json = load_config(FIXTURES / "ds_zero2_fp16_adamw.json", world_size=4)
    from_yaml = load_config(FIXTURES / "ds_zero2_fp16_adamw.yaml", world_size=4)
    assert from_yaml == from_json


def test_zero3_offload_example_loads_with_stage3_keys():
    cfg = load_config(FIXTURES / "ds_zero3_offload.json", world_size=3)
    assert cfg.train_batch_size == 4 * 4 * 3
    z = cfg.zero_optimization
    assert z.stage == 3
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.stage3_prefetch_bucket_size == 940_000 and z.stage3_param_persistence_threshold == 10_000
    assert z.reduce_bucket_size == 1_000_000 and z.sub_group_size == 1_000_000_000
    assert z.stage3_gather_16bit_weights_on_model_save
    assert cfg.bf16.enabled and cfg.param_dtype == torch.bfloat16
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["adam_w_mode"] is True
    assert cfg.scheduler.params["total_num_steps"] == 10_000


def test_hf_style_config_full_of_auto_resolves_from_model_and_trainer_values():
    trainer_values = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0,
        "optimizer.params.lr": 5e-5,
        "optimizer.params.betas": [0.9, 0.999],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.warmup_num_steps": 100,
    }
    model = TinyHF(hidden=64, dtype=torch.bfloat16)
    cfg = load_config(FIXTURES / "hf_auto.json", world_size=2, model=model, auto_values=trainer_values)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        32,
        2,
        8,
    )
    z = cfg.zero_optimization
    # HF Trainer's formulas: h*h, 0.9*h*h, 10*h.
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        64 * 64,
        int(0.9 * 64 * 64),
        640,
    )
    assert cfg.bf16.enabled and not cfg.fp16.enabled  # "auto" matched the model's bf16 weights
    assert cfg.optimizer.params["lr"] == 5e-5 and cfg.gradient_clipping == 1.0
    assert cfg.scheduler.params["warmup_min_lr"] == 0.0 and cfg.scheduler.params["warmup_max_lr"] is None
    assert any("warmup_max_lr" in n and "optimizer's lr" in n for n in cfg.notes)
    assert '"auto"' not in json.dumps(cfg.to_dict())


def test_hf_style_config_without_trainer_values_names_every_unresolved_key():
    with pytest.raises(ConfigError) as err:
        load_config(FIXTURES / "hf_auto.json", world_size=2, model=TinyHF())
    msg = str(err.value)
    assert msg.startswith('optimizer.params.lr: "auto" cannot be resolved')
    assert "TrainingArguments" in msg
    for path in ("optimizer.params.betas", "scheduler.params.warmup_num_steps", "gradient_clipping"):
        assert path in msg


# ---------------------------------------------------------------------------------------------------------
# Batch arithmetic


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 3, (24, 4, 2)),
        ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
            3,
            (24, 4, 2),
        ),
        (
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            2,
            (16, 4, 2),
        ),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 2,
            },
            2,
            (16, 4, 2),
        ),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 2, (8, 4, 1)),
        ({"train_batch_size": 8.0, "train_micro_batch_size_per_gpu": 4}, 1, (8, 4, 2)),
    ],
)
def test_any_two_batch_terms_derive_the_third(given, world_size, expected):
    cfg = load_config(given, world_size=world_size)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected
    assert cfg.world_size == world_size


def test_batch_mismatch_shows_each_term_and_its_source():
    given = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as err:
        load_config(given, world_size=3)
    msg = str(err.value)
    assert msg.startswith(
        "train_batch_size: train_batch_size (32) != train_micro_batch_size_per_gpu (4) x "
        "gradient_accumulation_steps (2) x world_size (3) = 24"
    )
    assert "train_batch_size (32, from the config)" in msg and "world_size (3, data-parallel ranks)" in msg


# ---------------------------------------------------------------------------------------------------------
# Bad configs: each has its own precise message, starting with the key path

MICRO = {"train_micro_batch_size_per_gpu": 2}

BAD_CONFIGS = [
    pytest.param(
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
        "gradient_accumulation_steps",
        [
            "cannot derive it",
            "train_batch_size (30, from the config) is not divisible by",
            "x world_size (1, data-parallel ranks) = 4",
        ],
        id="batch-not-divisible",
    ),
    pytest.param(
        {"gradient_accumulation_steps": 4}, "train_batch_size", ["neither is given"], id="batch-missing"
    ),
    pytest.param(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
        "train_batch_size",
        ['both "auto"'],
        id="batch-all-auto",
    ),
    pytest.param(  # was "neither is given", which the key plainly there contradicts
        {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2},
        "train_micro_batch_size_per_gpu",
        ['"auto" is derived from train_batch_size, which is not given; set one of the two to a number'],
        id="batch-one-auto-other-missing",
    ),
    pytest.param(
        {**MICRO, "gradient_clipp1ng": 1.0},
        "gradient_clipp1ng",
        ['did you mean "gradient_clipping"?'],
        id="typo-top",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 2, "overlap_com": True}},
        "zero_optimization.overlap_com",
        ['did you mean "overlap_comm"?'],
        id="typo-nested",
    ),
    pytest.param(
        {
            **MICRO,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}},
        },
        "zero_optimization.offload_optimizer.pin_memroy",
        ['did you mean "pin_memory"?'],
        id="typo-deep",
    ),
    pytest.param(
        {**MICRO, "Gradient_Clipping": 1.0},
        "Gradient_Clipping",
        ['did you mean "gradient_clipping"?'],
        id="typo-case",
    ),
    pytest.param(
        {**MICRO, "stage3_prefetch_bucket_size": 10},
        "stage3_prefetch_bucket_size",
        ['belongs at "zero_optimization.stage3_prefetch_bucket_size"'],
        id="key-in-wrong-section",
    ),
    pytest.param(
        {**MICRO, "pipeline": {"stages": 2}},
        "pipeline",
        ["a pipeline section for a model that is not a PipelineModule"],
        id="pipeline-without-a-pipeline-module",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
        "zero_optimization.zero_quantized_weights",
        ["a DeepSpeed option dslaunch does not support: ZeRO++ quantized weights"],
        id="unsupported-zeropp",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
        "zero_optimization.offload_optimizer.device",
        ['"nvme" is not supported yet'],
        id="unsupported-nvme",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": "2"}},
        "zero_optimization.stage",
        ["expected an integer in [0, 3], got str '2'"],
        id="type-stage-string",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 4}},
        "zero_optimization.stage",
        ["expected an integer in [0, 3], got 4"],
        id="range-stage",
    ),
    pytest.param(
        {**MICRO, "fp16": {"enabled": "yes"}},
        "fp16.enabled",
        ["expected true or false, got str 'yes'"],
        id="type-bool",
    ),
    pytest.param(
        {**MICRO, "fp16": {"enabled": True, "hysteresis": 0}},
        "fp16.hysteresis",
        ["expected an integer >= 1, got 0"],
        id="range-hysteresis",
    ),
    pytest.param(
        {**MICRO, "gradient_clipping": -1},
        "gradient_clipping",
        ["expected a number >= 0.0, got -1.0"],
        id="range-clip",
    ),
    pytest.param(
        {**MICRO, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16.enabled",
        ["fp16 and bf16 cannot both be enabled"],
        id="fp16-and-bf16",
    ),
    pytest.param(
        {**MICRO, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
        "bfloat16",
        ['another name for "bf16"'],
        id="bf16-alias-twice",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Adma"}},
        "optimizer.type",
        ['did you mean "Adam"?'],
        id="optimizer-typo",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Lion", "params": {}}},
        "optimizer.type",
        ['optimizer "Lion" is not supported yet', "Adam, AdamW, Lamb, SGD"],
        id="optimizer-unsupported",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
        "optimizer.params.max_grad_norm",
        ['top-level "gradient_clipping"'],
        id="optimizer-max-grad-norm",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}},
        "optimizer.params.adam_w_mode",
        ['contradicts type "AdamW"'],
        id="adamw-without-w",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
        "optimizer.params.betas",
        ["expected a list of two numbers"],
        id="betas-length",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Adam", "params": {"lr": "3e-4"}}},
        "optimizer.params.lr",
        ["expected a number >= 0.0, got str '3e-4'"],
        id="lr-string",
    ),
    pytest.param(
        {**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
        "scheduler.params.total_num_steps",
        ["required", "WarmupDecayLR"],
        id="scheduler-missing-total",
    ),
    pytest.param(
        {
            **MICRO,
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {"total_num_steps": 10, "warmup_num_steps": 50},
            },
        },
        "scheduler.params.total_num_steps",
        ["10 is less than warmup_num_steps (50)"],
        id="scheduler-total-before-warmup",
    ),
    pytest.param(
        {**MICRO, "scheduler": {"type": "StepLR", "params": {}}},
        "scheduler.type",
        ['scheduler "StepLR" is not supported yet'],
        id="scheduler-unsupported",
    ),
    pytest.param(
        {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
        "scheduler.params.warmup_type",
        ["expected one of 'log', 'linear'"],
        id="scheduler-warmup-type",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Adam", "params": {"lr": "auto"}}},
        "optimizer.params.lr",
        ['"auto" cannot be resolved', "TrainingArguments"],
        id="auto-lr",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
        "zero_optimization.reduce_bucket_size",
        ['"auto" cannot be resolved', "hidden*hidden of the model's hidden size", "pass the model"],
        id="auto-bucket-without-model",
    ),
    pytest.param(
        {**MICRO, "fp16": {"enabled": "auto"}},
        "fp16.enabled",
        ['"auto" cannot be resolved', "needs the model"],
        id="auto-fp16-without-model",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param",
        ["parameter offload needs ZeRO stage 3 (stage is 2)"],
        id="offload-param-stage2",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer",
        ["needs ZeRO stage 1, 2 or 3 (stage is 0)"],
        id="offload-optimizer-stage0",
    ),
    pytest.param(
        {**MICRO, "optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 2}},
        "optimizer.type",
        ["trust ratio per parameter", "zero_allow_untested_optimizer"],
        id="lamb-with-zero",
    ),
    pytest.param(
        {**MICRO, "zero_optimization": {"stage": 2, "allgather_partitions": False}},
        "zero_optimization.allgather_partitions",
        ["a DeepSpeed option dslaunch does not support", "(False)", "set it to True"],
        id="default-only-key",
    ),
    pytest.param(
        {
            **MICRO,
            "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
        },
        "zero_optimization.cpu_offload",
        ['deprecated form of "offload_optimizer"'],
        id="legacy-and-new-offload",
    ),
    pytest.param(
        {**MICRO, "fp16": True},
        "fp16",
        ["expected a mapping of keys to values, got bool True"],
        id="section-not-mapping",
    ),
]


@pytest.mark.parametrize(("config", "path", "fragments"), BAD_CONFIGS)
def test_bad_config_names_the_key_and_the_problem(config, path, fragments):
    with pytest.raises(ConfigError) as err:
        load_config(config, world_size=1)
    msg = str(err.value)
    assert msg.startswith(f"{path}: "), msg
    assert err.value.path == path
    for fragment in fragments:
        assert fragment in msg, msg


def test_world_size_must_be_given_as_a_positive_int():
    with pytest.raises(ConfigError, match=r"^world_size: expected a positive integer, got 0"):
        load_config(MICRO, world_size=0)


# ---------------------------------------------------------------------------------------------------------
# Files


def test_missing_file_and_bad_json_name_the_file_and_position(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json: config file not found"):
        load_config(tmp_path / "nope.json", world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_micro_batch_size_per_gpu": 2,\n  "steps_per_print": 10,,\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON: line 3 column 25"):
        load_config(bad, world_size=1)


# Every way a config file can be unreadable is one ConfigError naming the file, with a hint about the text
# (not the key-level hint): a trailing comma, a comment, single quotes, YAML in a .json, bad YAML on one line,
# a directory, an empty file, UTF-16. A UTF-8 byte-order mark (Windows editors write one) is read past.
@pytest.mark.parametrize(
    ("name", "data", "message", "hint"),
    [
        (
            "comma.json",
            b'{\n "train_micro_batch_size_per_gpu": 2,\n}\n',
            "not valid JSON: line 3 column 1",
            "remove the trailing comma",
        ),
        (
            "comment.json",
            b'// ours\n{"train_micro_batch_size_per_gpu": 2}',
            "not valid JSON",
            "remove the comment",
        ),
        ("quotes.json", b"{'train_micro_batch_size_per_gpu': 2}", "not valid JSON", "use double quotes"),
        ("yaml.json", b"train_micro_batch_size_per_gpu: 2\n", "not valid JSON", "the text is YAML"),
        (
            "bad.yaml",
            b"train_micro_batch_size_per_gpu: [2\n",
            "not valid YAML: line 2 column 1: expected ','",
            "fix the file's text at that line",
        ),
        ("empty.json", b"  \n", "the config file is empty", "write the config"),
        ("empty.yaml", b"# nothing\n", "the config file is empty", "write the config"),
        (
            "utf16.json",
            '{"train_micro_batch_size_per_gpu": 2}'.encode("utf-16"),
            "not UTF-8 text (byte 0 is 0xff): it is UTF-16",
            "save the file as UTF-8",
        ),
        ("adir", None, "is a directory, not a config file", "name the file in it"),
    ],
)
def test_unreadable_config_files_are_one_line_naming_the_file_and_the_cause(
    tmp_path, name, data, message, hint
):
    path = tmp_path / name
    path.mkdir() if data is None else path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        load_config(path, world_size=1)
    assert str(err.value).startswith(f"{path}: {message}") and "\n" not in str(err.value)
    assert err.value.hint.startswith(hint)


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b'\xef\xbb\xbf{"train_micro_batch_size_per_gpu": 2}')
    assert load_config(path, world_size=1).train_micro_batch_size_per_gpu == 2


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        (
            "dup.json",
            '{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_clipping": 0.0}',
            "",
        ),
        (
            "dup.yaml",
            "train_micro_batch_size_per_gpu: 2\ngradient_clipping: 1.0\ngradient_clipping: 0.0\n",
            "line 3",
        ),
    ],
)
def test_duplicate_keys_are_errors_not_last_one_wins(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, world_size=1)
    assert str(err.value).startswith("gradient_clipping: duplicate key") and where in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# Defaults, aliases, notes, the resolved dict


def test_defaults_are_deepspeed_016_with_clipping_off():
    cfg = load_config(MICRO, world_size=1)
    assert cfg.gradient_clipping == 0.0 and cfg.steps_per_print == 10 and cfg.param_dtype == torch.float32
    assert cfg.zero_optimization.stage == 0 and cfg.optimizer is None and cfg.scheduler is None
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000
    assert cfg.zero_optimization.offload_optimizer.device == "none"


def test_deprecated_names_are_mapped_with_a_note():
    cfg = load_config(
        {
            **MICRO,
            "bfloat16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": True,
                "stage3_gather_fp16_weights_on_model_save": True,
                "prefetch_bucket_size": 1234,
            },
        },
        world_size=1,
    )
    z = cfg.zero_optimization
    assert cfg.bf16.enabled
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.stage3_gather_16bit_weights_on_model_save and z.stage3_prefetch_bucket_size == 1234
    text = "\n".join(cfg.notes)
    for old in (
        "bfloat16",
        "zero_optimization.cpu_offload",
        "zero_optimization.cpu_offload_param",
        "stage3_gather_fp16_weights_on_model_save",
    ):
        assert old in text


def test_moot_zero_tuning_keys_are_noted_only_when_changed():
    zero = {"stage": 2, "allgather_bucket_size": 2e8, "contiguous_gradients": False, "sub_group_size": 1e9}
    text = "\n".join(load_config({**MICRO, "zero_optimization": zero}, world_size=1).notes)
    assert "zero_optimization.allgather_bucket_size: 200000000 has no effect" in text
    assert "zero_optimization.contiguous_gradients: False has no effect" in text
    assert "sub_group_size" not in text  # the default value: nothing to say
    defaults = load_config({**MICRO, "zero_optimization": {"stage": 2}}, world_size=1).notes
    assert not any("has no effect" in note for note in defaults)


# DeepSpeed 0.19.8's DeepSpeedZeroConfig, every key at its default (deepspeed/runtime/zero/config.py; the
# null ones are "decided later" or "off" there) but the deprecated names, which DeepSpeed too refuses beside
# the keys that replaced them
DEEPSPEED_ZERO_DEFAULTS = {
    "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000, "overlap_comm": None, "compute_grad_norm": True,
    "load_from_fp32_weights": True, "elastic_checkpoint": False, "offload_param": None,
    "offload_optimizer": None, "zenflow": None, "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000, "stage3_model_persistence_threshold": 2**63 - 1,
    "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": False, "stage3_module_granularity_threshold": 0,
    "stage3_use_all_reduce_for_fetch_params": False, "stage3_allgather_sequential": False,
    "ignore_unused_parameters": True,
    "legacy_stage1": False, "round_robin_gradients": False, "parameter_alignment": False,
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
    "memory_efficient_linear": True, "pipeline_loading_checkpoint": False, "override_module_apply": True,
    "log_trace_cache_warnings": False, "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False,
}  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeeds_whole_zero_section_at_its_defaults_loads_as_our_defaults(stage: int) -> None:
    """A config that spells out every ZeRO key of DeepSpeed 0.19.8 at its default (as a dump of
    DeepSpeed's config does) reads as our defaults: nothing unknown, nothing refused, overlap on."""
    zero = {**DEEPSPEED_ZERO_DEFAULTS, "stage": stage}
    got = load_config({**MICRO, "zero_optimization": zero}, world_size=1).zero_optimization
    want = load_config({**MICRO, "zero_optimization": {"stage": stage}}, world_size=1).zero_optimization
    assert got == want and got.overlap_comm
    legacy = {"stage": stage, "cpu_offload": None, "cpu_offload_param": None}  # null: not set, as there
    assert load_config({**MICRO, "zero_optimization": legacy}, world_size=1).zero_optimization == want


def test_legacy_boolean_zero_optimization_means_stage_1():
    cfg = load_config({**MICRO, "zero_optimization": True}, world_size=1)
    assert cfg.zero_optimization.stage == 1 and "legacy" in cfg.notes[0]


def test_ignored_and_disabled_keys_are_accepted_with_notes():
    cfg = load_config(
        {
            **MICRO,
            "flops_profiler": {"enabled": False},
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {"stage": 2, "round_robin_gradients": True, "allgather_partitions": True},
        },
        world_size=1,
    )
    text = "\n".join(cfg.notes)
    assert "flops_profiler: ignored (disabled" in text
    assert "zero_force_ds_cpu_optimizer: False ignored" in text
    assert "zero_optimization.round_robin_gradients: True ignored" in text
    assert "allgather_partitions" not in text  # the default value needs no note


def test_deepspeed_019_top_level_keys_are_known() -> None:
    """DeepSpeed 0.19.8's top-level keys (deepspeed/runtime/constants.py) at their defaults read silently;
    away from them each is noted or refused by name."""
    defaults = {"gradient_allreduce_op": "mean", "managed_gradient_accumulation": True,
                "disable_allgather": False, "disable_python_gc": False, "vocabulary_size": None,
                "use_data_before_expert_parallelism": False}  # fmt: skip
    cfg = load_config({**MICRO, **defaults}, world_size=1)
    assert not cfg.notes and not cfg.disable_python_gc
    changed = {"disable_python_gc": True, "disable_allgather": True, "vocabulary_size": 50304,
               "expert_parallel": {"enabled": False}}  # fmt: skip
    cfg = load_config({**MICRO, **changed}, world_size=1)
    assert cfg.disable_python_gc
    text = "\n".join(cfg.notes)
    assert "disable_allgather: True ignored" in text and "vocabulary_size: 50304 ignored" in text
    assert "expert_parallel: ignored (disabled" in text
    refused = {
        "gradient_allreduce_op": ("sum", "gradients summed over the ranks"),
        "managed_gradient_accumulation": (False, "engine.set_gradient_accumulation_boundary(True)"),
        "use_data_before_expert_parallelism": (True, "expert-parallel (MoE)"),
        "expert_parallel": ({"enabled": True}, "AutoEP expert parallelism"),
    }
    for key, (value, words) in refused.items():
        with pytest.raises(ConfigError) as error:
            load_config({**MICRO, key: value}, world_size=1)
        assert str(error.value).startswith(f"{key}: a DeepSpeed option dslaunch does not support")
        assert words in str(error.value), str(error.value)


def test_case_insensitive_type_names_are_canonical():
    cfg = load_config(
        {
            **MICRO,
            "optimizer": {"type": "adamw"},
            "scheduler": {"type": "warmupcosinelr", "params": {"total_num_steps": 2000}},
        },
        world_size=1,
    )
    assert cfg.optimizer.type == "AdamW" and cfg.scheduler.type == "WarmupCosineLR"
    assert cfg.scheduler.params["cos_min_ratio"] == 1e-4 and cfg.scheduler.params["warmup_num_steps"] == 1000


def test_fp16_auto_follows_the_model_dtype():
    half = load_config(
        {**MICRO, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}},
        world_size=1,
        model=TinyHF(dtype=torch.float16),
    )
    full = load_config({**MICRO, "fp16": {"enabled": "auto"}}, world_size=1, model=TinyHF())
    assert half.fp16.enabled and not half.bf16.enabled and half.param_dtype == torch.float16
    assert not full.fp16.enabled and full.param_dtype == torch.float32


def test_hidden_size_found_on_config_attributes_and_embeddings():
    from dataclasses import dataclass

    @dataclass
    class GPTLikeConfig:
        n_embd: int = 96

    class GPTLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = GPTLikeConfig()

    assert model_hidden_size(TinyHF(hidden=48)) == 48
    assert model_hidden_size(GPTLike()) == 96
    assert model_hidden_size(torch.nn.Sequential(torch.nn.Embedding(10, 32), torch.nn.Linear(32, 8))) == 32
    assert model_hidden_size(torch.nn.Linear(3, 3)) is None


def test_stage3_auto_values_at_lower_stages_fall_back_to_defaults():
    cfg = load_config(
        {
            **MICRO,
            "zero_optimization": {
                "stage": 2,
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        },
        world_size=1,
    )
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000


def test_resolved_dict_is_read_only_json_and_pickle_friendly():
    cfg = load_config(FIXTURES / "ds_zero3_offload.json", world_size=2)
    with pytest.raises(TypeError):
        cfg.raw["train_batch_size"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        cfg.optimizer.params["lr"] = 1.0  # type: ignore[index]
    again = load_config(json.loads(json.dumps(cfg.raw)), world_size=2)
    assert again == cfg  # the resolved dict is itself a valid config that loads to the same thing
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    assert isinstance(cfg.to_dict()["optimizer"]["params"]["betas"], list)


def test_render_config_shows_values_and_notes():
    cfg = load_config({**MICRO, "zero_optimization": {"stage": 1, "cpu_offload": True}}, world_size=2)
    text = render_config(cfg)
    assert text.startswith("dslaunch config (world_size=2, param_dtype=float32)")
    assert '"train_batch_size": 4' in text and "notes:" in text and "cpu_offload" in text


def test_the_input_mapping_is_not_modified():
    given = {**MICRO, "zero_optimization": {"stage": 2, "cpu_offload": True}, "bfloat16": {"enabled": True}}
    before = copy.deepcopy(given)
    load_config(given, world_size=1)
    assert given == before


# ---------------------------------------------------------------------------------------------------------
# scripts/configs: the example job's configs load at any world size


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "zero3_offload", "bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_example_job_configs_load_at_any_world_size(name, world_size):
    cfg: Config = load_config(SCRIPT_CONFIGS / f"{name}.json", world_size=world_size)
    assert (
        cfg.train_batch_size
        == cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world_size
    )
    assert cfg.gradient_clipping == 1.0 and cfg.optimizer.type == "AdamW"
    assert cfg.scheduler.type in ("WarmupLR", "WarmupCosineLR") and cfg.notes == ()
    expected_stage = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3_offload": 3}.get(name)
    if expected_stage is not None:
        assert cfg.zero_optimization.stage == expected_stage
    assert cfg.fp16.enabled == (name == "fp16") and cfg.bf16.enabled == (name == "bf16")
    assert (cfg.zero_optimization.offload_optimizer.device == "cpu") == (name == "zero3_offload")


@pytest.mark.parametrize(
    "path",
    [
        FIXTURES / "ds_zero2_fp16_adamw.json",
        FIXTURES / "ds_zero3_offload.json",
        *sorted(SCRIPT_CONFIGS.glob("*.json")),
    ],
    ids=lambda p: p.name,
)
def test_the_resolved_dict_reloads_to_the_same_config(path):
    """Checkpoint manifests store config.raw; loading it back must give the same config."""
    cfg = load_config(path, world_size=2)
    assert load_config(cfg.to_dict(), world_size=2) == cfg


def test_null_optimizer_and_scheduler_mean_none():
    cfg = load_config({**MICRO, "optimizer": None, "scheduler": None}, world_size=1)
    assert cfg.optimizer is None and cfg.scheduler is None


def test_combination_refusals_are_config_errors_naming_the_key() -> None:
    """Refusals that combine sections with the job's shape live in runtime.config.combinations, as
    ConfigErrors starting with the key path; the job's facts (stages, degrees) are arguments."""
    from runtime.config.combinations import check_offload_param, check_pipeline

    zero3 = {"stage": 3, "offload_param": {"device": "cpu"}}
    alone = load_config({**MICRO, "zero_optimization": zero3}, world_size=2)
    with pytest.raises(ConfigError) as refused:
        check_offload_param(alone.zero_optimization)
    assert str(refused.value).startswith(
        "zero_optimization.offload_param.device: 'cpu' needs zero_optimization.offload_optimizer"
    )

    class Pipeline(torch.nn.Module):  # what a PipelineModule looks like to the config package
        is_pipeline_module = True

    section = {"pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2}}
    piped = load_config({**MICRO, **section}, world_size=2, model=Pipeline())
    assert (piped.pipeline.stages, piped.tensor_parallel.autotp_size) == (2, 2)
    with pytest.raises(ConfigError) as refused:
        check_pipeline(piped, stages=2, chunks_per_stage=1, model_dim=1)
    assert str(refused.value) == (
        "tensor_parallel.autotp_size: 2 but the PipelineModule's topology has a model dimension of 1"
    )
    # one micro-batch for two stages: GPipe, the same schedule as 1F1B then
    assert check_pipeline(piped, stages=2, chunks_per_stage=1, model_dim=2) == "gpipe"
