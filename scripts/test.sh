#!/usr/bin/env bash
# Set up and run the whole test suite (unit: pure, one process; executor: one process with torch
# and megatron-core; dist: real gloo processes, and jobs under a real Slurm on this machine; gpu:
# skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
source scripts/python_env.sh
export OMP_NUM_THREADS=1
# Best-effort: a one-node Slurm for tests/dist/test_slurm.py (installed with apt when missing and
# root). Where it cannot be installed or started, the suite runs and those tests skip with the
# reason. RESIHP_SLURM=0 leaves Slurm alone.
slurm_started=0
if [ "${RESIHP_SLURM:-1}" != 0 ]; then
    export RESIHP_SLURM_DIR=${RESIHP_SLURM_DIR:-/tmp/resihp-slurm}
    if timeout 600 bash scripts/slurm/local_cluster.sh install && timeout 120 bash scripts/slurm/local_cluster.sh start; then
        export SLURM_CONF=$RESIHP_SLURM_DIR/slurm.conf
        slurm_started=1
    else
        echo "test.sh: no local Slurm here (above); tests/dist/test_slurm.py will skip" >&2
    fi
fi
code=0
python -m pytest tests -q -p no:cacheprovider --durations=15 "$@" || code=$?
if [ $slurm_started = 1 ]; then bash scripts/slurm/local_cluster.sh stop || true; fi
exit $code
