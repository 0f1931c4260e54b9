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
  `debug_log`, `sync_before_reduce`, `sync_after_reduce`, `keep_int_input_tensors`,
  `keep_all_input_tensors` tune DeepCompile's passes: accepted, with a note when set away from the default.
- `offload_activation`, `offload_opt_states` and `symmetric_memory` ask for things DeepCompile does inside
  the graph; each is refused by name with the nearest thing we have.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config.checks import Bool
from runtime.config.reader import SectionReader

# key -> (DeepSpeed's default, why it changes nothing here)
_NO_EFFECT = {
    "double_buffer": (True, "ZeRO-3 always prefetches the next gather unit while one computes"),
    "free_activation": (False, "autograd frees each activation after its last use"),
    "free_activation_threshold": (10 * 1024 * 1024, "autograd frees each activation after its last use"),
    "dump_graphs": (False, "a DeepCompile debugging switch; use TORCH_LOGS=graph_code"),
    "debug_log": (False, "a DeepCompile debugging switch; use TORCH_LOGS=graph_breaks,recompiles"),
    "sync_before_reduce": (False, "a DeepCompile pass option; our reductions run outside the graphs"),
    "sync_after_reduce": (False, "a DeepCompile pass option; our reductions run outside the graphs"),
    "keep_int_input_tensors": (True, "a DeepCompile pass option"),
    "keep_all_input_tensors": (False, "a DeepCompile pass option"),
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
    "symmetric_memory": ("DeepCompile's symmetric-memory collectives", "collectives use the process group"),
}

DEEPCOMPILE_NOTE = (
    "compile.deepcompile: true: engine.compile() compiles the model with torch.compile, each ZeRO-3 "
    "gather unit's forward on its own (gathers, releases and gradient reductions stay outside the "
    "graphs); DeepSpeed's DeepCompile graph passes are not used"
)


@dataclass(frozen=True)
class CompileConfig:
    deepcompile: bool = False  # accepted; engine.compile() always takes runtime.compile's path


def read_compile(r: SectionReader) -> CompileConfig:
    """The `compile` section (absent: all defaults)."""
    deepcompile = r.get("deepcompile", Bool(), False)
    for key, (default, why) in _NO_EFFECT.items():
        r.ignored(key, default, why)
    for key, (what, hint) in _REFUSED.items():
        r.default_only(key, False, f"{what}; {hint}")
    r.finish()
    if deepcompile:
        r.ctx.note(DEEPCOMPILE_NOTE)
    return CompileConfig(deepcompile=deepcompile)
