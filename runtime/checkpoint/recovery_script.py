"""`zero_to_fp32.py` in every checkpoint folder we save, as DeepSpeed puts one there: a user (or the Hugging
Face docs' recipe) runs `cd ckpt; python zero_to_fp32.py . pytorch_model.bin` on a machine that has torch
and nothing else.

The script is four of our modules one after another, `deepspeed_layout` (pure index math),
`portable_folders` (which checkpoint a folder path names), `portable` (reading dslaunch's and DeepSpeed's
folders) and `portable_cli` (DeepSpeed's command line and output files), which import only the standard
library and torch; the lines between their "recovery-script: begin imports" and "end imports" markers (how
they import each other as modules) are left out, and one `from __future__` line leads. So the script is
the code the suite tests, not a copy of it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from runtime.checkpoint.durable import write_text_durably

SCRIPT_NAME = "zero_to_fp32.py"
_PARTS = ("deepspeed_layout.py", "portable_folders.py", "portable.py", "portable_cli.py")
_BEGIN, _END = "# recovery-script: begin imports", "# recovery-script: end imports"
_PIPELINE_STAGE = re.compile(r"^pipe_stage_\d+_of_\d+(_chunks_\d+)?$")  # without tensor parallelism


def script_text() -> str:
    """The standalone script's source."""
    here = Path(__file__).resolve().parent
    lines = [
        "#!/usr/bin/env python",
        "# Written by dslaunch at every checkpoint save: the fp32 weights of this folder's checkpoint",
        "# (dslaunch's or DeepSpeed's format) as one state dict. Needs only torch. See --help.",
        "from __future__ import annotations",
    ]
    for part in _PARTS:
        skipping = False
        for line in (here / part).read_text(encoding="utf-8").splitlines():
            if line.startswith(_BEGIN):
                skipping = True
            elif line.startswith(_END):
                skipping = False
            elif not skipping and line != "from __future__ import annotations":
                lines.append(line)
    return "\n".join(lines) + "\n"


def write_recovery_script(root: str | os.PathLike[str]) -> Path:
    """Write `root`/zero_to_fp32.py (atomically, fsynced; executable); called once per save by the
    rank that writes `latest`. A pipeline stage's folder (`pipe_stage_SS_of_NN`) also puts one in the
    save_dir above it, where DeepSpeed's users look: there it merges the stages. (Tensor-parallel shards
    cannot be merged by it, so their save_dir holds only the rank folders.)"""
    root = Path(root)
    text = script_text()
    for folder in (root, root.parent) if _PIPELINE_STAGE.match(root.name) else (root,):
        path = folder / SCRIPT_NAME
        write_text_durably(path, text)
        path.chmod(0o755)
    return root / SCRIPT_NAME
