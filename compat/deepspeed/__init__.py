"""DeepSpeed's import names, served by dslaunch (the ``deepspeed`` distribution in ``compat/``).

Names only: every behaviour lives in dslaunch's ``runtime`` (training) and ``launcher`` (processes)
packages, where ``import runtime`` users get it too. A DeepSpeed feature dslaunch lacks raises
``runtime.deepspeed_api.unsupported.UnsupportedFeature`` naming it and the nearest supported alternative.
"""

from __future__ import annotations

# dslaunch's runtime is checked first, before any import from it: a user who installed only this package
# must read what to install, not a bare ModuleNotFoundError from the first `from runtime... import`.
try:
    import runtime as _runtime
except ModuleNotFoundError as _missing:
    if _missing.name != "runtime":  # dslaunch is installed but lacks a dependency: that error names it
        raise
    raise ImportError(
        "this `deepspeed` is dslaunch's compatibility package and needs dslaunch's `runtime` package: "
        "install dslaunch too (pip install <dslaunch checkout> <dslaunch checkout>/compat)"
    ) from _missing

from deepspeed import accelerator, checkpointing, comm, ops, pipe, runtime, utils, zero
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.version import __version__, __version_major__, __version_minor__, __version_patch__
from runtime import add_config_arguments, initialize
from runtime.deepspeed_api.collectives import init_distributed
from runtime.deepspeed_api.unsupported import missing_names, unsupported_callable
from runtime.pipe import PipelineModule
from runtime.pipe.engine import PipelineEngine
from runtime.tensor_parallel import tp_model_init

__git_hash__ = None
__git_branch__ = None
dslaunch_version = _runtime.__version__

init_inference = unsupported_callable(
    "init_inference",
    "inference engine (deepspeed.init_inference)",
    "run the trained model with plain PyTorch (model.eval() under torch.no_grad()); ZeRO-3 weights can be "
    "consolidated with engine.save_16bit_model() or ds_consolidate first",
)


def is_compile_supported() -> bool:
    return False


__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedEngine",
    "PipelineEngine",
    "PipelineModule",
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "init_inference",
    "initialize",
    "is_compile_supported",
    "ops",
    "pipe",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]


__getattr__ = missing_names(
    "deepspeed",
    "see README.md, Coming from DeepSpeed, for what dslaunch supports",
)
