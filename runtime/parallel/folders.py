"""Where model-parallel engines keep their checkpoints, as a data-parallel engine sees it.

A pipeline stage, a tensor-parallel rank or an mpu's model rank each keep their own ZeRO checkpoint in a
folder of the checkpoint root whose name carries the degree (`pipe_stage_SS_of_NN`, `tp_rank_RR_of_NN`,
`mp_rank_RR_of_NN`; the engines' `checkpoint_folder`), so the root itself has no `latest`. A plain
engine given such a root would only say that there is no `latest` file; `data_parallel_root` names the
degree the checkpoint was saved with instead, as the model-parallel engines do for a degree mismatch.
"""

from __future__ import annotations

import os

# folder prefix -> (what it was saved with, what this engine lacks, how to resume); {} is the degree
_FAMILIES = (
    (
        "tp_rank_",
        "tensor-parallel degree {}",
        "tensor parallelism",
        '"tensor_parallel": {{"autotp_size": {}}}',
    ),
    ("pipe_stage_", "{} pipeline stages", "pipeline", "a PipelineModule of num_stages={}"),
    ("mp_rank_", "model-parallel size {}", "model parallelism", "initialize(mpu=...) of model size {}"),
)


def data_parallel_root(root: str | os.PathLike) -> str:
    """`root`, for a data-parallel engine to load from; a root holding only model-parallel folders (no
    `latest` of its own) is refused, naming the degree it was saved with."""
    from runtime.checkpoint import CheckpointNotFound

    path = os.fspath(root)
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "latest")):
        return path
    for prefix, saved_with, lacks, resume in _FAMILIES:
        saved = sorted(name for name in os.listdir(path) if name.startswith(prefix))
        if saved:
            degree = saved[0].split("_of_")[1][:2].lstrip("0") or "?"
            more = ", ..." if len(saved) > 4 else ""
            raise CheckpointNotFound(
                f"{path} holds a checkpoint saved with {saved_with.format(degree)} "
                f"({', '.join(saved[:4])}{more}), but this engine has no {lacks}",
                hint=f"resume with {resume.format(degree)}, as it was saved",
            )
    return path


__all__ = ["data_parallel_root"]
