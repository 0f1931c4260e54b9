"""A stage's share of a plain state dict, and (re-exported) a pipeline checkpoint as one state dict.

`load_stage_state_dict` gives a `PipelineModule` built at any pipeline degree (and chunks per stage) the
entries its stage holds, so a run continues at another degree, chunking or world size (weights only;
optimizer state restarts). Reading a pipeline checkpoint's root (`pipeline_stage_dirs`,
`get_fp32_state_dict_from_pipeline_checkpoint`) is the checkpoint package's
(`runtime.checkpoint.pipeline_root`), named here too.
"""

from __future__ import annotations

import torch

from runtime.checkpoint.pipeline_root import get_fp32_state_dict_from_pipeline_checkpoint, pipeline_stage_dirs
from runtime.pipe.config import PipelineError
from runtime.pipe.module import PipelineModule


def load_stage_state_dict(module: PipelineModule, state_dict: dict[str, torch.Tensor]) -> None:
    """Load the entries of `state_dict` this stage holds into `module` (before building the engine)."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise PipelineError(
            f"stage {module.stage_id}: the state dict lacks {missing}",
            hint="build the PipelineModule with the same layers as the model the state dict was saved from",
        )
    module.load_state_dict({key: state_dict[key] for key in own})


__all__ = [
    "get_fp32_state_dict_from_pipeline_checkpoint",
    "load_stage_state_dict",
    "pipeline_stage_dirs",
]
