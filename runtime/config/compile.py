"""DeepSpeed's `compile` section, read strictly, and what each key means here.

Owns `CompileConfig`. DeepSpeed's section configures DeepCompile, its graph passes that move ZeRO-3's
collectives into the compiled graph. dslaunch compiles differently (`runtime.compile`: each ZeRO-3 gather
unit's forward is compiled, the gathers and releases stay hooks around it), so:

- `deepcompile: true` is accepted: `engine.compile()` takes our compiled path at every ZeRO stage, and a
  one-line note (logged once on rank 0 with the config's other notes) says what it means here. As in
  DeepSpeed, nothing is compiled until `engine.compile()` (Accelerate calls it for
  `TrainingArguments(torch_compile=True)`).
- `double_buffer` (prefetching the next unit while this one computes) is what stage 3's prefetch always
  does, `free_activation` / `free_activation_threshold` free what autograd frees anyway, `dump_graphs`,
  `debug_log`, `sync_before_reduce`, `sync_after_reduce`, `sync_before_allgather`,
  `sync_after_allgather`, `keep_int_input_tensors`, `keep_all_input_tensors` and
  `offload_activation_pin_memory` tune DeepCompile's passes: accepted, with a note when set away from the
  default.
- `passes` (0.19's list of DeepCompile passes): "z1" and "z3", its ZeRO passes, are accepted with a note
  (the configured ZeRO stage compiles as above); "autosp" and "autotp", which make sequence and tensor
  parallelism graph passes, are refused with the settings that give those here.
- `offload_activation`, `offload_opt_states`, `offload_parameters`, `symmetric_memory` and
  `autoep_non_moe` ask for things DeepCompile does inside the graph or that dslaunch lacks (AutoEP); each
  is refused by name with the nearest thing we have.

The keys are DeepSpeed 0.19.8's `deepspeed/compile/config.py` (and `dump_graphs` of earlier releases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.config.checks import Bool, Choice
from runtime.config.reader import ConfigError, SectionReader, describe

# key -> (DeepSpeed's default, why it changes nothing here)
_NO_EFFECT = {
    "double_buffer": (True, "ZeRO-3 always prefetches the next gather unit while one computes"),
    "free_activation": (False, "autograd frees each activation after its last use"),
    "free_activation_threshold": (10 * 1024 * 1024, "autograd frees each activation after its last use"),
    "dump_graphs": (False, "a DeepCompile debugging switch; use TORCH_LOGS=graph_code"),
    "debug_log": (False, "a DeepCompile debugging switch; use TORCH_LOGS=graph_breaks,recompiles"),
    "sync_before_reduce": (False, "a DeepCompile pass option; our reductions run outside the graphs"),
    "sync_after_reduce": (False, "a DeepCompile pass option; our reductions run outside the graphs"),
    "sync_before_allgather": (False, "a DeepCompile pass option; our gathers run outside the graphs"),
    "sync_after_allgather": (False, "a DeepCompile pass option; our gathers run outside the graphs"),
    "keep_int_input_tensors": (True, "a DeepCompile pass option"),
    "keep_all_input_tensors": (False, "a DeepCompile pass option"),
    "offload_activation_pin_memory": (True, "it applies to DeepCompile's activation offload"),
}

# key -> (what it asks for, the nearest thing dslaunch has)
_REFUSED = {
    "offload_activation": (
        "DeepCompile's activation offload",
        "set activation_checkpointing.cpu_checkpointing: true (with checkpointed blocks) instead",
    ),
    "offload_opt_states": (
        "DeepCompile's optimizer-state offload",
        'set zero_optimization.offload_optimizer: {"device": "cpu"} instead',
    ),
    "offload_parameters": (
        "DeepCompile's parameter offload",
        'set zero_optimization.offload_param: {"device": "cpu"} (ZeRO-3) instead',
    ),
    "symmetric_memory": ("DeepCompile's symmetric-memory collectives", "collectives use the process group"),
    "autoep_non_moe": (
        "compiling around AutoEP's expert layers",
        "dslaunch has no AutoEP (expert parallelism); engine.compile() compiles the whole model",
    ),
}

# DeepCompile's passes: its ZeRO passes stand for our compiled ZeRO path; the others -> the nearest setting
PASSES = ("z1", "z3", "autosp", "autotp")
_PASS_REFUSED = {
    "autosp": (
        "DeepCompile's AutoSP pass (sequence parallelism made by the compiler)",
        "Ulysses sequence parallelism is deepspeed.runtime.sequence_parallel.ulysses_sp (README)",
    ),
    "autotp": (
        "DeepCompile's AutoTP pass (tensor parallelism made by the compiler)",
        'set "tensor_parallel": {"autotp_size": N} instead',
    ),
}

DEEPCOMPILE_NOTE = (
    "compile.deepcompile: true: engine.compile() compiles the model with torch.compile, each ZeRO-3 "
    "gather unit's forward on its own (gathers, releases and gradient reductions stay outside the "
    "graphs); DeepSpeed's DeepCompile graph passes are not used"
)


@dataclass(frozen=True)
class CompileConfig:
    deepcompile: bool = False  # accepted; engine.compile() always takes runtime.compile's path
    passes: tuple[str, ...] | None = None  # DeepCompile's ZeRO passes, if named: read, nothing changes


@dataclass(frozen=True)
class PassList:
    """`passes`: null, or a list of DeepCompile pass names (PASSES); the refused ones raise by name."""

    def __call__(self, path: str, value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(
                path, f"expected a list of pass names ({', '.join(PASSES)}), got {describe(value)}"
            )
        names = tuple(str(Choice(PASSES)(f"{path}[{i}]", item)) for i, item in enumerate(value))
        for i, name in enumerate(names):
            if name in _PASS_REFUSED:
                what, hint = _PASS_REFUSED[name]
                raise ConfigError(
                    f"{path}[{i}]", f"a DeepSpeed option dslaunch does not support: {what}", hint=hint
                )
        return names


def read_compile(r: SectionReader) -> CompileConfig:
    """The `compile` section (absent: all defaults)."""
    deepcompile = r.get("deepcompile", Bool(), False)
    passes = r.get("passes", PassList(), None)
    for key, (default, why) in _NO_EFFECT.items():
        r.ignored(key, default, why)
    for key, (what, hint) in _REFUSED.items():
        r.default_only(key, False, f"{what}; {hint}")
    r.finish()
    if passes:
        r.ctx.note(
            f"compile.passes: {list(passes)}: DeepCompile's ZeRO passes; engine.compile() compiles at the "
            "configured zero_optimization.stage (runtime/compile.py)"
        )
    if deepcompile:
        r.ctx.note(DEEPCOMPILE_NOTE)
    return CompileConfig(deepcompile=deepcompile, passes=passes)
