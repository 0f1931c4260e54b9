# Sourced by demo.sh and test.sh: make .venv with the project installed.
# Usage: source scripts/setup_env.sh [extra]   (extra = "test" adds the test dependencies)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv"
if [ ! -x "$_venv/bin/python" ]; then
    echo "setup: creating $_venv"
    python3 -m venv "$_venv"
    # Reuse a torch that python3 already has (a CUDA build, say) rather than installing a second one:
    # its site-packages directory goes on the venv's path, after the venv's own packages.
    _torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" \
        2>/dev/null || true)
    if [ -n "$_torch_site" ]; then
        _site=$("$_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        echo "$_torch_site" > "$_site/_dslaunch_base_site.pth"
        echo "setup: using the torch that python3 already has, from $_torch_site"
    fi
fi
_py="$_venv/bin/python"
if ! "$_py" -c "import torch" >/dev/null 2>&1; then
    # A plain `torch` requirement resolves to a multi-GB CUDA build; this pin takes the CPU
    # build that these machines keep on disk. Real users get whatever torch>=2.4 they have.
    echo "setup: installing torch==2.13.0 (CPU build)"
    "$_py" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
_extra="${1:-}"
# The tests also need the Hugging Face clients and the `deepspeed` compat distribution (compat/).
_extras="$_extra"
[ "$_extra" = "test" ] && _extras="test,hf"
_stamp="$_venv/.dslaunch-installed${_extra:+-$_extra}"
if [ ! -f "$_stamp" ] || [ "$_root/pyproject.toml" -nt "$_stamp" ] || [ "$_root/compat/pyproject.toml" -nt "$_stamp" ]; then
    echo "setup: installing dslaunch${_extras:+[$_extras]} into $_venv"
    "$_py" -m pip install -q --disable-pip-version-check -e "$_root${_extras:+[$_extras]}"
    if [ "$_extra" = "test" ]; then
        echo "setup: installing the deepspeed compat distribution (-e ./compat) into $_venv"
        "$_py" -m pip install -q --disable-pip-version-check -e "$_root/compat"
    fi
    touch "$_stamp"
fi
export PATH="$_venv/bin:$PATH"
export PYTHON="$_py"
