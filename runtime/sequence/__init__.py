"""Long context: the parts of ALST (Arctic Long Sequence Training), on one GPU and across GPUs.

- ``tiles``: how many tiles a sequence is cut into (pure rules);
- ``tiled_mlp``: a per-token MLP over sequence tiles, recomputed tile by tile in backward
  (``tiled_mlp``, ``tile_mlp``, ``tile_llama_mlps`` for HF Llama-style models);
- ``lean_norm``: RMSNorm keeping its 16-bit input for backward, not fp32 copies (``lean_rms_norm``,
  ``lean_norm``, ``lean_llama_norms`` for HF Llama-style models);
- ``tiled_loss``: the LM head and cross-entropy over token tiles, never the full logits
  (``tiled_causal_lm_loss``, the generic ``tiled_loss``); ``hf_loss``: the same inside a HF causal LM's
  forward (``tile_causal_lm_loss``);
- ``sp_groups``, ``ulysses``, ``ulysses_data``: Ulysses sequence parallelism (the ("data", "sequence")
  groups, the all-to-all around attention, the batches cut along the sequence and the loss over them);
  imported by module, not re-exported here.
DeepSpeed's ``TiledMLP`` / ``TiledFusedLogitsLoss`` / ``UlyssesSPAttentionHF`` /
``UlyssesSPDataLoaderAdapter`` signatures over these are `runtime.deepspeed_api.alst`.

Activation checkpoints kept in host memory are ``activation_checkpointing.cpu_checkpointing``
(runtime.activation_checkpointing); the memory these parts save is counted by ``ds_estimate --longest-seq``.
"""

from runtime.sequence.hf_loss import tile_causal_lm_loss
from runtime.sequence.lean_norm import lean_llama_norms, lean_norm, lean_rms_norm
from runtime.sequence.tiled_loss import tiled_causal_lm_loss, tiled_loss
from runtime.sequence.tiled_mlp import TileCount, tile_llama_mlps, tile_mlp, tiled_mlp
from runtime.sequence.tiles import LOGITS_TILE_BYTES, loss_tiles, mlp_tiles

__all__ = [
    "LOGITS_TILE_BYTES",
    "TileCount",
    "lean_llama_norms",
    "lean_norm",
    "lean_rms_norm",
    "loss_tiles",
    "mlp_tiles",
    "tile_causal_lm_loss",
    "tile_llama_mlps",
    "tile_mlp",
    "tiled_causal_lm_loss",
    "tiled_loss",
    "tiled_mlp",
]
