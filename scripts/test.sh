#!/usr/bin/env bash
# Installs what the tests need (venv, project, sshd/pdsh/OpenMPI) and runs the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k hostfile
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_system_deps.sh
source scripts/setup_env.sh test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PYTHON" -m ruff check launcher runtime tests scripts compat
exec "$PYTHON" -m pytest "$@"
