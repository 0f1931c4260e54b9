"""The launcher's user-facing errors: each one is a single line that says what is wrong and where.

``cli.main`` prints ``dslaunch: error: <message>`` and exits with ``LaunchError.exit_code`` (2, like a
usage error) before anything is started. Nothing here imports more than the standard library.
"""

from __future__ import annotations


class LaunchError(Exception):
    """A problem with the command line, the hostfile or the environment, found before launching."""

    exit_code = 2


class HostfileError(LaunchError):
    """A hostfile problem, located: ``<file>:<line>: <message>: '<text>'``.

    ``line`` is 1-based; 0 means the problem concerns the whole file (e.g. it has no hosts). ``text`` is
    the offending line as written (or the offending flag value for filter errors).
    """

    def __init__(self, file: str, line: int, text: str, message: str) -> None:
        self.file = file
        self.line = line
        self.text = text
        self.message = message
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {message}: {text!r}" if text else f"{where}: {message}")
