"""Launcher test worker: proves it started by creating the file named by MARKER."""

import os

open(os.environ["MARKER"], "w").close()
