#!/usr/bin/env bash
# Installs everything a CPU machine needs into .venv (idempotent; fast when already installed).
# Needs Python 3.12 or 3.13 on PATH or under pyenv (or named by RESIHP_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
if [ ! -x "$RESIHP_VENV/bin/python" ]; then
    if ! python=$(find_python); then
        echo "error: megatron-core 0.19.2 needs Python 3.12 or 3.13, and none was found on PATH or under pyenv;" \
             "install one (e.g. 'pyenv install 3.12' or Debian's python3.13 with python3.13-venv)" \
             "or name it with RESIHP_PYTHON=/path/to/python3.12" >&2
        exit 2
    fi
    echo "setup: creating .venv with $python ($("$python" --version 2>&1))"
    "$python" -m venv "$RESIHP_VENV"
fi
python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
python -m pip install -q --disable-pip-version-check --no-deps -e .
