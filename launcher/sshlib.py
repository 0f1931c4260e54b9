"""paramiko, imported once for the whole launcher, without what a launch never uses.

Every launcher module takes paramiko from here (``from launcher.sshlib import paramiko``), so that this
module decides how it is imported. paramiko's ``paramiko.config`` imports the optional package ``invoke``
at import time, only to run ssh_config ``Match exec`` lines. Measured on the 2-core test machine:
importing paramiko costs about 0.30 s of CPU with invoke and 0.18 s without, on the head's critical path
before the first connection (CPU time of ``python -c 'import paramiko'``, 20 runs). So invoke is hidden
while paramiko is imported, and :func:`enable_match_exec` imports it for a config that has a
``Match exec`` line (``launcher.ssh.load_ssh_config`` calls it), where paramiko then runs it as before.
"""

from __future__ import annotations

import re
import sys

_hidden = "invoke" not in sys.modules
if _hidden:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # "import invoke" raises ImportError
try:
    import paramiko
    import paramiko.config
finally:
    if _hidden and sys.modules.get("invoke", 0) is None:
        del sys.modules["invoke"]

_MATCH_EXEC = re.compile(r"^\s*match\s.*\bexec\b", re.IGNORECASE | re.MULTILINE)

__all__ = ["enable_match_exec", "paramiko", "uses_match_exec"]


def uses_match_exec(config_text: str) -> bool:
    """Whether an ssh_config text has a ``Match ... exec`` line (which needs invoke)."""
    return _MATCH_EXEC.search(config_text) is not None


def enable_match_exec() -> None:
    """Give paramiko's config module the invoke it skipped at import (no-op when it has it)."""
    if getattr(paramiko.config, "invoke", True) is not None:
        return
    try:
        import invoke
    except ImportError as e:  # paramiko raises this one, the real reason, at the Match exec line
        paramiko.config.invoke_import_error = e
        return
    paramiko.config.invoke = invoke
