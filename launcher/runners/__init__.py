"""Runners by name: ``--launcher NAME`` picks one. Imported lazily, so that ``dslaunch`` on one machine
never imports paramiko and a runner whose module is absent gives a clear error.

To add a runner: write ``launcher/runners/<mod>.py`` with a ``launcher.runners.base.Runner`` subclass
and map its name here to ``"module:Class"``.
"""

from __future__ import annotations

import importlib

from launcher.errors import LaunchError
from launcher.runners.base import Runner

RUNNERS: dict[str, str] = {
    "local": "launcher.runners.local:LocalRunner",
    "ssh": "launcher.runners.ssh:SSHRunner",
    "pdsh": "launcher.runners.pdsh:PDSHRunner",
    "openmpi": "launcher.runners.openmpi:OpenMPIRunner",
    "slurm": "launcher.runners.slurm:SlurmRunner",
}

#: the runner for jobs of more than one host (or one remote host) when --launcher is not given
DEFAULT_MULTI_NODE = "ssh"


def get_runner(name: str) -> type[Runner]:
    key = name.lower()
    if key not in RUNNERS:
        raise LaunchError(f"--launcher {name}: unknown launcher (choose from {', '.join(RUNNERS)})")
    module_name, _, class_name = RUNNERS[key].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise LaunchError(f"--launcher {key}: needs the Python module {exc.name!r}") from None
        raise LaunchError(f"--launcher {key}: not available in this installation") from None
    return getattr(module, class_name)
