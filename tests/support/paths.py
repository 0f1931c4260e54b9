"""Where the repository and the tests' data live, for tests at any depth under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"  # the worker scripts tests launch (not the repository's scripts/)
