#!/usr/bin/env bash
# Installs everything a CPU machine needs (idempotent; fast when already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-cpu.txt
python -m pip install -q --no-deps -e .
