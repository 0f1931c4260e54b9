#!/usr/bin/env bash
# Installs what the tests need (venv, project, sshd/pdsh/OpenMPI) and runs the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k hostfile
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_system_deps.sh
source scripts/setup_env.sh test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PYTHON" -m ruff check launcher runtime tests scripts compat
# The type checker beside the linter: settings in pyproject.toml [tool.mypy] (issue 31).
"$PYTHON" -m mypy launcher runtime compat
# Two pytest workers, one test file each (the suite is mostly waiting on worker processes; about 10
# minutes instead of 13 on the 2-core CI machine); DSLAUNCH_TEST_WORKERS=0 runs it in one process.
WORKERS="${DSLAUNCH_TEST_WORKERS:-2}"
if [ "$WORKERS" = "0" ]; then
    exec "$PYTHON" -m pytest "$@"
fi
exec "$PYTHON" -m pytest -n "$WORKERS" --dist loadfile "$@"
