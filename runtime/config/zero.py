"""The `zero_optimization` section: ZeRO stage, bucket sizes, offload, and the stage-3 knobs.

Owns DeepSpeed's deprecated aliases (cpu_offload, ...), the keys we accept without acting on, the ZeRO++ /
MiCS / NVMe features we refuse by name, and "auto" for the hidden-size-derived stage-3 values (resolved the
way HF Trainer does: reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
stage3_param_persistence_threshold = 10*h). `offload_optimizer` reads into the offload's own
`OffloadSettings` (runtime/config/offload.py, which says what its keys do); `offload_param` into
`OffloadConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from runtime.config.checks import Bool, Choice, Float, Int
from runtime.config.offload import (
    GRAD_TRANSFER_CHOICES,
    UPDATE_CHOICES,
    OffloadDevice,
    OffloadSettings,
    with_overrides,
)
from runtime.config.reader import AUTO, AutoRefused, ConfigError, SectionReader


@dataclass(frozen=True)
class OffloadConfig:
    """`zero_optimization.offload_param`: stage 3's working weight shards in host memory."""

    device: OffloadDevice = "none"  # ("nvme" is refused when read)
    pin_memory: bool = False  # DeepSpeed 0.19.8 defaults to True

    @property
    def enabled(self) -> bool:
        """Whether the section offloads anything (device is not "none")."""
        return self.device != "none"


@dataclass(frozen=True)
class ZeroConfig:
    """`zero_optimization`. Sizes count elements, not bytes, as in DeepSpeed."""

    # 0: plain data parallelism (all-reduce); 1: optimizer state sharded; 2: also gradients; 3: also weights
    stage: int = 0
    # elements per gradient bucket reduced (or reduce-scattered) in one collective
    reduce_bucket_size: int = 500_000_000
    # accepted with no effect: gathers go per reduce bucket (a non-default value gets a note)
    allgather_bucket_size: int = 500_000_000
    # reduce buckets while backward runs; False waits for each reduction before going on
    overlap_comm: bool = True
    # accepted with no effect: gradients always live in one flat buffer (a non-default value gets a note)
    contiguous_gradients: bool = True
    # use the reduce-scatter collective; False emulates it with all-reduce and a slice (runtime.comm)
    reduce_scatter: bool = True
    # where master weights and optimizer state live and step (runtime/config/offload.py has its keys)
    offload_optimizer: OffloadSettings = field(default_factory=OffloadSettings)
    # stage 3 only: the working weight shards in host memory
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    # stage 3: elements gathered ahead of use along the recorded trace; 0 turns prefetching off
    stage3_prefetch_bucket_size: int = 50_000_000
    # stage 3: gather units with fewer elements stay gathered for the whole run
    stage3_param_persistence_threshold: int = 100_000
    # stage 3: gathered elements beyond which nothing more is prefetched or kept for reuse
    stage3_max_live_parameters: int = 1_000_000_000
    # stage 3: a unit needed again within this many elements of the trace is kept, not released
    stage3_max_reuse_distance: int = 1_000_000_000
    # stage 3: save_16bit_model may gather the full weights (otherwise it raises, not write empty tensors)
    stage3_gather_16bit_weights_on_model_save: bool = False
    # accepted with no effect: each rank steps its whole shard at once (a non-default value gets a note)
    sub_group_size: int = 1_000_000_000


_HIDDEN_SIZE_NAMES = ("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "embed_dim")


def model_hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size: from `model.config` (HF and most GPT configs) or the model itself, else the
    widest nn.Embedding. None when nothing fits."""
    for holder in (getattr(model, "config", None), model):
        if holder is None:
            continue
        for name in _HIDDEN_SIZE_NAMES:
            value = holder.get(name) if isinstance(holder, Mapping) else getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        sizes = (
            holder.get("hidden_sizes")
            if isinstance(holder, Mapping)
            else getattr(holder, "hidden_sizes", None)
        )
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
            return max(sizes)
    widths = [m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(widths) if widths else None


def _from_hidden(
    model: torch.nn.Module | None, formula: Callable[[int], int], text: str
) -> Callable[[], int]:
    def resolve() -> int:
        if model is None:
            raise AutoRefused(
                f"it is {text} of the model's hidden size; pass the model (runtime.initialize does) "
                "or set a number"
            )
        hidden = model_hidden_size(model)
        if hidden is None:
            raise AutoRefused(
                f"it is {text} of the model's hidden size, and none was found (looked for config."
                f"{'/'.join(_HIDDEN_SIZE_NAMES)} and nn.Embedding widths); set a number"
            )
        return formula(hidden)

    return resolve


def _default_for_auto(r: SectionReader, key: str, default: Any) -> Callable[[], Any]:
    """ "auto" on a pure performance knob: DeepSpeed's default, with a note."""

    def resolve() -> Any:
        r.ctx.note(f'{r.key_path(key)}: "auto" resolved to the default {default}')
        return default

    return resolve


def _read_offload_optimizer(r: SectionReader) -> OffloadSettings:
    base = _read_offload_device(r, buffer_count_default=4)
    # "auto" (any spelling) or null: decided at startup, held as None
    update = r.get("update", Choice(UPDATE_CHOICES, nullable=True), None, auto=lambda: None)
    transfer = r.get("grad_transfer", Choice(GRAD_TRANSFER_CHOICES, nullable=True), None, auto=lambda: None)
    # DeepSpeed's ZeRO-Offload++ share of the optimizer on the host (runtime/zero/offload_split.py)
    ratio_given = r.has("ratio")
    # "auto" is held as None (the engine chooses: runtime/offload/auto_ratio.py); absent means 1.0
    chosen_later = ratio_given and r.data["ratio"] == AUTO
    ratio = r.get("ratio", Float(0.0, 1.0), None if chosen_later else 1.0, auto=lambda: None)
    cfg = OffloadSettings(
        device=base.device,
        pin_memory=base.pin_memory,
        ratio=ratio,
        update=None if update == "auto" else update,
        host_share=r.get("host_share", Float(0.0, 1.0, nullable=True), None, auto=lambda: None),
        grad_transfer=None if transfer == "auto" else transfer,
    )
    r.finish()
    cfg, overrides = with_overrides(cfg)  # the DSLAUNCH_OFFLOAD_* benchmark variables, read once here
    if overrides:
        cfg = replace(cfg, overrides=tuple(overrides))
        for note in overrides:
            r.ctx.note(note)
    if cfg.device == "none" and ratio_given and ratio != 1.0:
        asked = "auto" if ratio is None else f"{ratio:g}"
        # a share of the optimizer on the host means nothing without a host side: refuse rather than run
        # without offload when the user planned for one (1.0, the default, is what a resolved config
        # without offload carries)
        raise ConfigError(
            r.key_path("ratio"),
            f'{asked} needs offload_optimizer.device "cpu" (device is "none"): the ratio is the share of '
            'the optimizer state offloaded to the host; set "device": "cpu", or remove "ratio"',
        )
    if cfg.device == "none":
        for key in ("update", "host_share", "grad_transfer"):
            if getattr(cfg, key) is not None:
                r.ctx.note(f'{r.key_path(key)}: {getattr(cfg, key)!r} has no effect (device is "none")')
    return cfg


def _read_offload_param(r: SectionReader) -> OffloadConfig:
    cfg = _read_offload_device(r, buffer_count_default=5)
    r.finish()
    return cfg


def _read_offload_device(r: SectionReader, buffer_count_default: int) -> OffloadConfig:
    """The keys both offload sections share (the caller reads its own, then finishes)."""
    device = r.get("device", Choice(("none", "cpu", "nvme"), nullable=True), "none") or "none"
    if device == "nvme":
        raise ConfigError(
            r.key_path("device"), '"nvme" is not supported yet (NVMe offload); use "cpu" or "none"'
        )
    checked = cast(OffloadDevice, device)  # the Choice above left "none" or "cpu"
    cfg = OffloadConfig(device=checked, pin_memory=r.get("pin_memory", Bool(), False))
    r.ignored("buffer_count", buffer_count_default, "NVMe/prefetch buffer count has no effect on CPU offload")
    r.ignored("fast_init", False, "no effect on CPU offload")
    r.ignored("nvme_path", None, "NVMe offload is not supported")
    for key in ("pipeline_read", "pipeline_write", "pipeline", "super_offload"):
        r.ignored(key, False, "NVMe/SuperOffload pipelining is not implemented")
    r.ignored("buffer_size", 100_000_000, "NVMe buffer size")
    r.ignored("max_in_cpu", 1_000_000_000, "NVMe offload is not supported")
    r.ignored("cpuadam_cores_perc", 0.8, "the CPU optimizer uses torch's thread pool")
    return cfg


def read_zero(r: SectionReader, model: torch.nn.Module | None) -> ZeroConfig:
    """Read `zero_optimization` (an empty reader gives stage 0 with DeepSpeed's defaults)."""
    # Deprecated DeepSpeed spellings first, so the rest reads one vocabulary.
    data = dict(r.data)
    _map_legacy_offload(r, data)
    r.data = data
    r.alias("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")
    for short in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
    ):
        r.alias(short, f"stage3_{short}", "DeepSpeed accepts both names")

    stage = r.get("stage", Int(0, 3), 0)
    big = Int(0)
    hidden_reduce = _from_hidden(model, lambda h: h * h, "hidden*hidden")
    stage3_only = stage == 3
    cfg = ZeroConfig(
        stage=stage,
        reduce_bucket_size=r.get("reduce_bucket_size", Int(1), 500_000_000, auto=hidden_reduce),
        allgather_bucket_size=r.get(
            "allgather_bucket_size",
            Int(1),
            500_000_000,
            auto=_default_for_auto(r, "allgather_bucket_size", 500_000_000),
        ),
        # null is DeepSpeed's default (on at stage 3, off below); ours is on at every stage
        overlap_comm=r.get("overlap_comm", Bool(nullable=True), True) is not False,
        contiguous_gradients=r.get("contiguous_gradients", Bool(), True),
        reduce_scatter=r.get("reduce_scatter", Bool(), True),
        offload_optimizer=_read_offload_optimizer(r.section("offload_optimizer")),
        offload_param=_read_offload_param(r.section("offload_param")),
        stage3_prefetch_bucket_size=r.get(
            "stage3_prefetch_bucket_size",
            big,
            50_000_000,
            auto=_from_hidden(model, lambda h: int(0.9 * h * h), "0.9*hidden*hidden")
            if stage3_only
            else lambda: None,
        ),
        stage3_param_persistence_threshold=r.get(
            "stage3_param_persistence_threshold",
            big,
            100_000,
            auto=_from_hidden(model, lambda h: 10 * h, "10*hidden") if stage3_only else lambda: None,
        ),
        stage3_max_live_parameters=r.get(
            "stage3_max_live_parameters",
            big,
            1_000_000_000,
            auto=_default_for_auto(r, "stage3_max_live_parameters", 1_000_000_000),
        ),
        stage3_max_reuse_distance=r.get(
            "stage3_max_reuse_distance",
            big,
            1_000_000_000,
            auto=_default_for_auto(r, "stage3_max_reuse_distance", 1_000_000_000),
        ),
        stage3_gather_16bit_weights_on_model_save=r.get(
            "stage3_gather_16bit_weights_on_model_save", Bool(), False, auto=lambda: None
        ),
        sub_group_size=r.get(
            "sub_group_size",
            Int(1),
            1_000_000_000,
            auto=_default_for_auto(r, "sub_group_size", 1_000_000_000),
        ),
    )
    _accept_deepspeed_extras(r)
    r.finish(unsupported=_UNSUPPORTED_ZERO)
    _check_offload_stage(r, cfg)
    _note_moot_settings(r, cfg)
    return cfg


def _note_moot_settings(r: SectionReader, cfg: ZeroConfig) -> None:
    """DeepSpeed tuning keys this engine's layout makes moot: a non-default value gets a note, so nobody
    tunes them expecting an effect."""
    moot = (
        ("allgather_bucket_size", cfg.allgather_bucket_size, 500_000_000, "gathers go per reduce bucket"),
        ("contiguous_gradients", cfg.contiguous_gradients, True, "gradients always live in one flat buffer"),
        ("sub_group_size", cfg.sub_group_size, 1_000_000_000, "each rank steps its whole shard at once"),
    )
    for key, value, default, why in moot:
        if value != default:
            r.ctx.note(f"{r.key_path(key)}: {value!r} has no effect ({why})")


def _map_legacy_offload(r: SectionReader, data: dict[str, Any]) -> None:
    """cpu_offload / cpu_offload_param / cpu_offload_use_pin_memory -> offload_optimizer / offload_param."""
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    pin = data.pop("cpu_offload_use_pin_memory", None)
    r.has("cpu_offload_use_pin_memory")
    if pin is not None:
        Bool()(r.key_path("cpu_offload_use_pin_memory"), pin)
    for old, new in legacy.items():
        r.has(old)
        if data.get(old, False) is None:  # DeepSpeed's default for these deprecated keys: not set
            del data[old]
        if old not in data:
            continue
        flag = Bool()(r.key_path(old), data.pop(old))
        if new in data:
            raise ConfigError(r.key_path(old), f'is the deprecated form of "{new}"; set only "{new}"')
        if flag:
            data[new] = {"device": "cpu", "pin_memory": bool(pin)}
        r.ctx.note(
            f'{r.key_path(old)}: read as "{new}": {{"device": "{"cpu" if flag else "none"}"}} (deprecated)'
        )
    if pin is not None and not any(old in r.data for old in legacy):
        r.ctx.note(f"{r.key_path('cpu_offload_use_pin_memory')}: ignored (no cpu_offload key to apply it to)")


_UNSUPPORTED_ZERO = {
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning",
    "zero_quantized_weights": "ZeRO++ quantized weights",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantized non-trainable weights",
    "zero_quantized_gradients": "ZeRO++ quantized gradients",
    "mics_shard_size": "MiCS sharding",
    "mics_hierarchical_params_gather": "MiCS hierarchical gather",
    "zenflow": "ZenFlow",
    "leaf_module": "ZeRO-3 leaf modules",
}


def _accept_deepspeed_extras(r: SectionReader) -> None:
    """DeepSpeed keys that change nothing here (performance hints) or have one value we implement."""
    r.default_only(
        "allgather_partitions", True, "allgather_partitions=false (all-reduce instead of all-gather)"
    )
    r.default_only("load_from_fp32_weights", True, "loading from 16-bit weights")
    r.default_only(
        "elastic_checkpoint", False, "DeepSpeed elastic checkpoints; dslaunch reshards on load anyway"
    )
    r.default_only("stage3_use_all_reduce_for_fetch_params", False, "all-reduce parameter fetch")
    r.default_only("zero_hpz_partition_size", 1, "ZeRO++ hierarchical partitioning")
    for key in (
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "mics_hierarchical_params_gather",
    ):
        r.default_only(key, False, _UNSUPPORTED_ZERO[key])
    r.default_only("mics_shard_size", -1, "MiCS sharding")
    hints = {
        "ignore_unused_parameters": True,
        "round_robin_gradients": False,
        "use_multi_rank_bucket_allreduce": True,
        "stage3_model_persistence_threshold": None,
        "stage3_module_granularity_threshold": 0,
        "stage3_allgather_sequential": False,
        "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False,
        "override_module_apply": True,
        "log_trace_cache_warnings": False,
        "compute_grad_norm": True,
        "parameter_alignment": False,
        "enable_sanity_checks": False,
        "legacy_stage1": False,
    }
    for key, default in hints.items():
        if r.data.get(key) == "auto":
            r.has(key)
            continue
        r.ignored(key, default, "a DeepSpeed tuning option without effect in dslaunch")
    # DeepSpeed 0.19: where Muon's momentum stays when NVMe takes the other optimizer states
    r.ignored(
        "save_muon_momentum_buffer_in_memory", False, "it applies to NVMe offload, which dslaunch lacks"
    )


def _check_offload_stage(r: SectionReader, cfg: ZeroConfig) -> None:
    if cfg.offload_optimizer.device != "none" and cfg.stage == 0:
        raise ConfigError(
            r.key_path("offload_optimizer"),
            "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0); set zero_optimization.stage",
        )
    if cfg.offload_param.enabled and cfg.stage != 3:
        raise ConfigError(
            r.key_path("offload_param"),
            f"parameter offload needs ZeRO stage 3 (stage is {cfg.stage}); stages 1-2 offload optimizer only",
        )
