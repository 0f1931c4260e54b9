"""The old name of `runtime.activation_checkpointing`, kept because users and integrations import it.

DeepSpeed's own path is ``deepspeed.checkpointing``, and README taught ``runtime.checkpointing``; the
module was renamed so that activation checkpointing (recomputing a block in backward) is not confused with
`runtime.checkpoint` (saving training state). This module is not a copy: importing it gives the
`runtime.activation_checkpointing` module object itself, so ``configure()`` through one name and
``settings()`` through the other see the same module-level state.
"""

from __future__ import annotations

import sys

from runtime import activation_checkpointing

# The import system hands out whatever sys.modules holds for this name once this file has run, so
# `import runtime.checkpointing` and `from runtime import checkpointing` both return the renamed module.
sys.modules[__name__] = activation_checkpointing
