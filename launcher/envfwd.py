"""Which of the launcher's environment variables reach workers on other hosts, and from where.

A worker on the head node inherits the launcher's environment; a worker on another host starts from that
host's login environment. This module decides what to carry over so that a job behaves the same on every
node. The result goes into the node spec that the agent receives as JSON, so values travel intact (spaces,
quotes, ``$``, newlines) and do not depend on sshd's ``AcceptEnv``.

Sources, later wins:

1. the launcher's environment, for names matching :data:`FORWARD_PREFIXES` / :data:`FORWARD_NAMES`, minus
   :data:`NEVER_FORWARD` (per-host values: device lists, install paths);
2. the env files, any variable, ``K=V`` lines: in the home directory, then in the working directory, and
   in each DeepSpeed's ``.deepspeed_env`` (the name ``DS_ENV_FILE`` gives, as DeepSpeed reads it) before
   our ``.dslaunch_env``;
3. ``--env K=V`` on the command line (held by the plan as ``JobConfig.user_env``, applied per worker).

The plan's own variables (RANK, MASTER_ADDR, ...) always win. In ``.dslaunch_env`` setting one is an error;
in ``.deepspeed_env`` it is skipped, as DeepSpeed's launcher overrides it: ``accelerate launch`` writes its
whole environment into that file before starting ``deepspeed`` on several machines.

Why these prefixes: DeepSpeed forwards NCCL*, PYTHON*, UCX*, MLFLOW*, MV2* only, so users lost
``CUDA_DEVICE_MAX_CONNECTIONS`` (Megatron needs the same value on every rank), ``TORCH_DISTRIBUTED_DEBUG``,
``GLOO_SOCKET_IFNAME``, ``FI_*`` (libfabric/EFA), ``HF_*`` and ``WANDB_*`` settings, and had to find out
about ``.deepspeed_env``. ``PATH`` and ``LD_LIBRARY_PATH`` stay per host: the remote side runs the same
absolute interpreter, and its library paths are its own business (put them in ``.dslaunch_env`` to force).

Env file format: one ``K=V`` per line, optional ``export`` in front; blank lines and lines starting with
``#`` are ignored; a value in single or double quotes is unquoted with shell rules (so it may contain ``#``
and leading spaces); an unquoted value ends at `` #`` (a comment). Errors name the file and line.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from launcher.errors import LaunchError
from launcher.plan import PLAN_ENV_KEYS

ENV_FILE_NAME = ".dslaunch_env"
# DeepSpeed's env file; DeepSpeed lets DS_ENV_FILE rename it.
DEEPSPEED_ENV_FILE_NAME = ".deepspeed_env"


def deepspeed_env_file_name(environ: Mapping[str, str] = os.environ) -> str:
    """The name of DeepSpeed's env file: ``$DS_ENV_FILE``, else ``.deepspeed_env``."""
    return environ.get("DS_ENV_FILE") or DEEPSPEED_ENV_FILE_NAME


FORWARD_PREFIXES: tuple[str, ...] = (
    "NCCL_", "UCX_", "FI_", "GLOO_", "MV2_",  # communication libraries
    "TORCH_", "TORCHINDUCTOR_", "TRITON_", "CUDA_", "PYTHON",  # runtime behaviour
    "MLFLOW", "WANDB_", "HF_",  # experiment tracking, model hub
    "DSLAUNCH_OFFLOAD_",  # the runtime's offload settings (runtime/offload)
)  # fmt: skip
FORWARD_NAMES: frozenset[str] = frozenset({"OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR"})
# Matched by a prefix above but different on every host: the plan or the host itself sets them.
NEVER_FORWARD: frozenset[str] = frozenset(
    {"CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "TORCHELASTIC_RUN_ID"}
)

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class EnvFileError(LaunchError):
    """A bad line in an env file: ``<file>:<line>: <reason>: '<text>'``."""

    def __init__(self, file: Path, line: int, text: str, reason: str) -> None:
        self.file, self.line, self.text, self.reason = file, line, text, reason
        super().__init__(f"{file}:{line}: {reason}: {text!r}")


@dataclass(frozen=True)
class ForwardedEnv:
    """Variables for remote workers, and where each came from (for the start-up summary)."""

    values: Mapping[str, str]
    sources: Mapping[str, str]  # name -> "environment" or "<file>:<line>"

    def describe(self) -> str:
        """Names (never values: they may be secrets) grouped by source, one line per source."""
        if not self.values:
            return "no variables forwarded to remote hosts"
        by_source: dict[str, list[str]] = {}
        for name in sorted(self.values):
            src = self.sources[name]
            by_source.setdefault("environment" if src == "environment" else src.rsplit(":", 1)[0], []).append(
                name
            )
        return "; ".join(f"from {src}: {' '.join(names)}" for src, names in by_source.items())


def is_forwarded(name: str) -> bool:
    """Whether a variable of the launcher's environment goes to remote workers by default."""
    if name in NEVER_FORWARD or name in PLAN_ENV_KEYS:
        return False
    return name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)


def _parse_value(raw: str) -> str:
    raw = raw.strip()
    if raw[:1] in ("'", '"'):
        parts = shlex.split(raw, comments=True)  # raises ValueError on an unclosed quote
        if len(parts) != 1:
            raise ValueError("a quoted value must be one word (quote the whole value)")
        return parts[0]
    return re.split(r"\s+#", raw, maxsplit=1)[0].rstrip()


def parse_env_file(path: Path, *, skip_plan_keys: bool = False) -> dict[str, tuple[str, int]]:
    """Read an env file: name -> (value, line number). Raises :class:`EnvFileError` on a bad line.
    A variable the plan sets is an error, or left out with `skip_plan_keys` (DeepSpeed's file)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise EnvFileError(path, 0, "", f"not a text file ({e})") from e
    except OSError as e:
        raise EnvFileError(path, 0, "", f"cannot read: {e.strerror}") from e
    out: dict[str, tuple[str, int]] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("export "):
            s = s[len("export ") :].lstrip()
        key, eq, raw = s.partition("=")
        key = key.strip()
        if not eq:
            raise EnvFileError(path, n, line, "expected NAME=VALUE")
        if not _KEY.match(key):
            raise EnvFileError(path, n, line, f"{key!r} is not a valid variable name")
        if key in PLAN_ENV_KEYS:
            if skip_plan_keys:
                continue
            raise EnvFileError(path, n, line, f"{key} is set by dslaunch for every worker")
        try:
            out[key] = (_parse_value(raw), n)
        except ValueError as e:
            raise EnvFileError(path, n, line, str(e)) from None
    return out


def env_files(cwd: Path, home: Path, deepspeed_name: str = DEEPSPEED_ENV_FILE_NAME) -> list[Path]:
    """The env files that exist, in the order they apply: home first, working directory last, and in
    each DeepSpeed's file (named `deepspeed_name`) before ours."""
    found: list[Path] = []
    for d in (home, cwd):
        for name in (deepspeed_name, ENV_FILE_NAME):
            p = d / name
            if p.is_file() and all(not p.samefile(q) for q in found):
                found.append(p)
    return found


def is_deepspeed_file(path: Path) -> bool:
    """Whether `path` is DeepSpeed's env file (its variables that the plan sets are skipped, not refused)."""
    return path.name != ENV_FILE_NAME


def collect(environ: Mapping[str, str], cwd: Path, home: Path) -> ForwardedEnv:
    """The variables remote workers get on top of the plan's (see the module docstring for the order)."""
    values = {k: v for k, v in environ.items() if is_forwarded(k)}
    sources = dict.fromkeys(values, "environment")
    for path in env_files(cwd, home, deepspeed_env_file_name(environ)):
        for key, (value, line) in parse_env_file(path, skip_plan_keys=is_deepspeed_file(path)).items():
            values[key], sources[key] = value, f"{path}:{line}"
    return ForwardedEnv(MappingProxyType(values), MappingProxyType(sources))


def collect_from_process(cwd: Path | None = None) -> ForwardedEnv:
    """:func:`collect` for this process: its environment, working directory and home."""
    return collect(os.environ, cwd or Path.cwd(), Path.home())
