"""The node agent's spec: how it reaches the agent and how the agent picks its node. Pure parsing.

Input: a spec (JSON)
--------------------
The spec arrives in one of three ways:

* the first line of stdin (default; the local and SSH runners use this);
* ``--spec-b64 DATA``: ``encode_spec_arg(spec)``, i.e. urlsafe base64 of zlib-compressed JSON, for
  tools that do not carry stdin (pdsh, mpirun, srun);
* ``--spec-file PATH``: a JSON file (e.g. on a shared file system).

A spec is either a *node spec* or a *job spec* ``{"version": 1, "nodes": [node spec, ...]}`` from which
the agent picks its node with ``--node-index N`` (pdsh substitutes ``%n``), ``--node-index-env VAR``
(e.g. ``OMPI_COMM_WORLD_RANK`` or ``SLURM_NODEID`` with one agent per node) or ``--node-host NAME``.

Node spec (``version`` 1)::

    {"version": 1, "job_id": str, "node_rank": int, "host": str,
     "env": {K: V},            # set for every worker, over the agent's inherited environment
     "env_defaults": {K: V},   # set only where the resulting environment lacks K
     "omp_threads_auto": bool, # OMP_NUM_THREADS = usable CPUs // workers on this node, if unset
     "cwd": str | null,        # default working directory of the workers
     "log_dir": str | null,    # <log_dir>/rank_<R>.log: raw worker output, then any error-file traceback
     "grace_period": float,    # seconds between SIGTERM and SIGKILL when stopping
     "lifeline": ["stdin", "parent"],   # "the launcher is gone" (see launcher.agent)
     "workers": [{"rank": int, "local_rank": int, "argv": [str, ...],
                  "env": {K: V}, "cwd": str | null}, ...]}

``load_spec(argv)`` returns the agent's node spec (and any stdin bytes read past its line) or raises
``SpecError`` with one line. Imports only light stdlib modules: the agent imports this on every node.
"""

from __future__ import annotations

import base64
import json
import os
import zlib

PROTOCOL_VERSION = 1


class SpecError(Exception):
    pass


def encode_spec_arg(spec: dict) -> str:
    """The ``--spec-b64`` form of a spec: urlsafe base64 of zlib-compressed compact JSON."""
    raw = json.dumps(spec, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(zlib.compress(raw, 6)).decode("ascii")


def decode_spec_arg(data: str) -> dict:
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(data.encode("ascii"))))


def _read_stdin_line() -> tuple[bytes, bytes]:
    buf = b""
    while b"\n" not in buf:
        chunk = os.read(0, 65536)
        if not chunk:
            if buf.strip():
                return buf, b""
            raise SpecError("no spec on stdin (expected one JSON line)")
        buf += chunk
    line, rest = buf.split(b"\n", 1)
    return line, rest


def _select_node(spec: dict, args: dict[str, str]) -> dict:
    if "nodes" not in spec:
        return spec
    nodes = spec["nodes"]
    if "--node-host" in args:
        for node in nodes:
            if node.get("host") == args["--node-host"]:
                return node
        raise SpecError(f"no node with host {args['--node-host']!r} in the job spec")
    if "--node-index-env" in args:
        var = args["--node-index-env"]
        if var not in os.environ:
            raise SpecError(f"--node-index-env {var}: the variable is not set")
        index_text = os.environ[var]
    elif "--node-index" in args:
        index_text = args["--node-index"]
    else:
        raise SpecError("a job spec needs --node-index, --node-index-env or --node-host")
    try:
        index = int(index_text)
    except ValueError:
        raise SpecError(f"node index {index_text!r} is not an integer") from None
    if not 0 <= index < len(nodes):
        raise SpecError(f"node index {index} is outside 0..{len(nodes) - 1}")
    return nodes[index]


def _check_spec(spec: object) -> dict:
    if not isinstance(spec, dict):
        raise SpecError("the spec is not a JSON object")
    if spec.get("version") != PROTOCOL_VERSION:
        raise SpecError(f"spec version {spec.get('version')!r}, this agent speaks {PROTOCOL_VERSION}")
    workers = spec.get("workers")
    if not isinstance(workers, list):
        raise SpecError("the spec has no 'workers' list")
    for w in workers:
        if not isinstance(w, dict) or not isinstance(w.get("argv"), list) or not w["argv"]:
            raise SpecError(f"bad worker entry {w!r}: needs a non-empty 'argv' list")
        if not isinstance(w.get("rank"), int):
            raise SpecError(f"bad worker entry {w!r}: needs an integer 'rank'")
    return spec


_OPTIONS = ("--spec-b64", "--spec-file", "--node-index", "--node-index-env", "--node-host")


def load_spec(argv: list[str]) -> tuple[dict, bytes]:
    """The node spec named by the agent's arguments, and the stdin bytes read past it."""
    args: dict[str, str] = {}
    leftover = b""
    try:
        i = 0
        while i < len(argv):
            opt, eq, value = argv[i].partition("=")
            if opt not in _OPTIONS:
                raise SpecError(f"unknown argument {argv[i]!r}")
            if not eq:
                i += 1
                if i == len(argv):
                    raise SpecError(f"{opt} needs a value")
                value = argv[i]
            args[opt] = value
            i += 1
        if "--spec-b64" in args:
            raw = decode_spec_arg(args["--spec-b64"])
        elif "--spec-file" in args:
            with open(args["--spec-file"], "rb") as f:
                raw = json.loads(f.read())
        else:
            line, leftover = _read_stdin_line()
            raw = json.loads(line)
        return _check_spec(_select_node(raw, args)), leftover
    except SpecError:
        raise
    except (ValueError, OSError, zlib.error) as exc:
        raise SpecError(str(exc)) from None
