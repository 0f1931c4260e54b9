"""How the engine compiles its model: `engine.compile()` at ZeRO stages 0-3.

The design, per stage:

- ZeRO 0, 1, 2, and stage 3 on one rank without `offload_param` (nothing sharded, no module hooks): the
  whole model is compiled in place (`nn.Module.compile`), and each parameter-holding subtree below the
  module containers (each block, the embeddings, the head) has its `forward` compiled as well. Inside the
  whole model's graph dynamo inlines those; where the model's own forward cannot be traced (dynamo gives
  up on a frame whose loop breaks the graph, e.g. at a checkpointed block), they still run compiled
  instead of silently eager. The engine's gradient reductions are post-accumulate-grad hooks on the
  parameters: they run after autograd's AccumulateGrad, outside the compiled forward and backward graphs,
  so they neither break the graphs nor guard anything that changes between steps (the accumulation
  boundary is the engine's state, never read by the model).
- ZeRO 3 with sharded parameters: every module that gathers a unit (`runtime.zero.stage3_hooks`) carries
  a forward pre-hook (gather, prefetch) and a forward post-hook (release, hooks on the outputs for
  backward). Compiling the whole model would put those hooks (collectives, storage swaps, Python
  bookkeeping) inside dynamo's trace, which does not capture them (measured below: it gives up on the
  model's frame) and would guard on the scheduler's state, which changes. Instead the regions are the largest
  subtrees with no gather hook *below* their root: for a transformer, each block, and the head. Each
  region's `forward` is compiled (not its `__call__`), so the hooks stay in eager `_call_impl` around the
  compiled graph and run exactly as without compilation; the gathered parameters are graph inputs
  (dynamo's inlined built-in modules), so a new gather's storage is no recompile. The glue between
  regions (the model's own forward: embedding lookups, the loop over blocks) stays eager, except a
  Hugging Face model's loss function, compiled as a region of its own (`compile_loss`). What it costs:
  no fusion across a block boundary, and one compiled-graph call per block; every block of one class
  shares one compiled code object, so compile time is one block's, not the model's.
- Activation checkpointing: `runtime.activation_checkpointing.checkpoint` is a frame dynamo skips (not
  what it calls), so the graph ends cleanly before a checkpointed block and the block's own compiled
  forward runs, in the forward (without grad) and in the recomputation (with grad): two graphs per block
  class from the first step on, none added later. The glue around the blocks then runs eager.

Measured on CPU with backend "eager" (tests/runtime/engine/test_compile.py): the compiled engine's losses
equal the eager engine's at every stage, and after the first step dynamo compiles no graph and counts no
graph break.
Compiling the whole model at ZeRO 3 over two ranks instead (what `engine.compile()` did before) reported
no graph break either, but compiled one graph only, a block's: dynamo abandoned the model's own frame at
the hooks, so the embeddings, head and loss ran eager without a word.

Accelerate's regional compilation (`compile_regions_deepspeed`: `block.compile()` on each block of the
engine's module, for `--dynamo_use_regional_compilation`) comes to the same split without us: the compiled
function is the block's `_call_impl`, a torch.nn frame dynamo never traces, so the hooks run eager and
the block's `forward` is what compiles (tests/runtime/engine/test_compile.py, ZeRO-3 over two ranks).

A model that reaches `initialize` already compiled (`torch.compile(model)`, an `OptimizedModule`) is
unwrapped (`unwrap_compiled`) and compiled by this plan with its own dynamo context as the compiler, so
the backend and options the user chose stay, and the hooks stay outside the graphs.

Anything the module does that dynamo cannot trace still graph-breaks as in `torch.compile(model)`;
`compile_counts()` reports dynamo's counters so tests and benchmarks can check that a step adds none.
The entry point compiles whatever module the engine holds, so a caller that converts layers first (FP8)
compiles the converted model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "CompilePlan",
    "compile_counts",
    "compile_loss",
    "compile_model",
    "compiled_in_place",
    "plan_regions",
    "unwrap_compiled",
]

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]  # a function in, its compiled version out

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: recurse into them


@dataclass(frozen=True)
class CompilePlan:
    """Which modules were compiled: `regions` by qualified name ("" is the whole model)."""

    regions: tuple[str, ...]
    whole_model: bool
    loss: bool = False  # the per-region path compiled Hugging Face's `loss_function` too (`compile_loss`)

    def describe(self) -> str:
        if self.whole_model:
            return "the whole model, one region (no module hooks)"
        text = f"{len(self.regions)} regions, one per ZeRO-3 gather boundary (hooks outside the graphs)"
        return text + (", and the model's loss function" if self.loss else "")


def plan_regions(model: nn.Module, hooked: Collection[str]) -> tuple[str, ...]:
    """Pure: the largest subtrees of `model` with no hooked module strictly below their root, by name.

    `hooked` names the modules that carry gather hooks. A subtree's root may itself be hooked (its hooks
    stay around the compiled forward); a subtree with a hooked module inside is split into its children.
    Containers without a forward are always split, and subtrees without parameters are left eager (they
    are glue: dropout, activations)."""
    hooked = set(hooked)
    below: dict[str, bool] = {}  # module name -> a hooked module strictly inside it
    names = [name for name, _ in model.named_modules()]
    for name in names:
        prefix = f"{name}." if name else ""
        below[name] = any(other.startswith(prefix) and other != name for other in hooked)
    regions: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        if below[name] or isinstance(module, _CONTAINERS):
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            return
        if any(True for _ in module.parameters()):
            regions.append(name)

    visit("", model)
    return tuple(regions)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, Compiler | None]:
    """A model given to `initialize` already `torch.compile`d (an `OptimizedModule`): the module inside it,
    and the compiler it was compiled with, its dynamo context, which compiles any function with the same
    backend and options. The engine trains the module and compiles it its own way with that compiler
    (`compile_model`): run as it came, the `OptimizedModule` would trace ZeRO-3's gather hooks into its
    graph, which dynamo cannot do. Any other model: itself and None."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return model._orig_mod, model.dynamo_ctx
    return model, None


def compiled_in_place(model: nn.Module) -> bool:
    """Whether `model.compile()` (nn.Module's in-place compile) was called on the model: its `_call_impl`
    then runs compiled, and at ZeRO-3 dynamo meets the gather hooks of every block inside that frame,
    gives up on it and compiles only what lies below the hooks. Its compiler cannot be read back from the
    module, so the engine says so rather than recompiling it (`runtime.initialize`)."""
    return getattr(model, "_compiled_call_impl", None) is not None


def compile_model(
    model: nn.Module,
    hooked: Collection[str],
    compile_kwargs: Mapping[str, Any] | None = None,
    *,
    compiler: Compiler | None = None,
) -> CompilePlan:
    """Compile `model` in place for the engine: whole when nothing is hooked, else per region (above).
    `hooked`: the modules carrying ZeRO-3 gather hooks (empty at stages 0-2). `compiler`, when given,
    compiles each function instead of `torch.compile(fn, **compile_kwargs)` (a model that came compiled:
    `unwrap_compiled`); the whole model then has its `forward` compiled, the same graph as its
    `_call_impl`'s where no module hook runs."""
    kwargs = dict(compile_kwargs or {})
    compile_fn: Compiler = compiler or (lambda fn: torch.compile(fn, **kwargs))
    # Without hooks the blocks (and the other parameter-holding subtrees) are compiled on their own as well
    # as the whole model: inside the whole model's graph dynamo inlines them, and where the model's forward
    # cannot be traced (a checkpointed block: dynamo leaves a frame eager when its loop breaks the graph),
    # they still run compiled instead of silently eager.
    regions = plan_regions(model, hooked or block_names(model))
    modules = dict(model.named_modules())
    for name in regions:
        module = modules[name]
        # The forward only: `_call_impl`, which runs the gather/release hooks, stays eager around it.
        module.forward = compile_fn(module.forward)
    if hooked:
        return CompilePlan(regions=regions, whole_model=False, loss=compile_loss(model, compile_fn))
    if compiler is None:
        model.compile(**kwargs)  # in place: the engine's parameter hooks stay on the same objects
    else:
        model.forward = compile_fn(model.forward)
    return CompilePlan(regions=("", *regions), whole_model=True)


def compile_loss(model: nn.Module, compile_fn: Compiler) -> bool:
    """Compile a Hugging Face model's `loss_function` in place; whether it was. Its forward computes the
    loss from the logits in the glue that the per-region path leaves eager, where the causal-LM loss
    upcasts the logits to fp32 and keeps fp32 tensors of their size for backward: at a 3B Llama's 4 x
    2048 tokens and 128K vocabulary each is 3.9 GiB, the allocation the per-region engine ran out of
    memory on (BENCHMARKS.md, issue 33), where the whole-model graph fuses the upcast into the loss's
    kernels. The loss has no parameters, so no gather hooks: a region of its own. Models without the
    attribute, or transformers versions whose property cannot be set, keep theirs eager."""
    loss = getattr(model, "loss_function", None)
    if not callable(loss) or not isinstance(getattr(type(model), "loss_function", None), property):
        return False
    try:
        model.loss_function = compile_fn(loss)  # type: ignore[assignment]
    except AttributeError:  # a read-only property
        return False
    return True


def block_names(model: nn.Module) -> tuple[str, ...]:
    """Pure: the children of the model's module containers that hold parameters (transformer blocks)."""
    return tuple(
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if isinstance(module, (*_CONTAINERS, nn.Sequential))
        for child, sub in module.named_children()
        if any(True for _ in sub.parameters())
    )


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counters that say whether compiling cost anything per step: graphs
    compiled (each recompile is one more), graph breaks, operations captured into the graphs."""
    from torch._dynamo.utils import counters

    return {
        "graphs_compiled": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "calls_captured": int(counters["stats"]["calls_captured"]),
    }
