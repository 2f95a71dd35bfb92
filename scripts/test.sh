#!/usr/bin/env bash
# Set up and run the whole test suite (unit: pure, one process; executor: one process with torch
# and megatron-core; dist: real gloo processes; gpu: skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
export OMP_NUM_THREADS=1
exec python -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
