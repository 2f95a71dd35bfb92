#!/usr/bin/env bash
# The checks that need a GPU, in one go, each bounded in time so that one that hangs leaves time
# for the rest: tests/gpu, the THD attention benchmark, detection's cost in bf16 through TE's THD
# attention, then live detection's healthy and slowed runs with the budget left. Each writes its
# log to LOG_DIR.
#
# On a machine without megatron-core or Transformer Engine, put what tools/te_offline_bundle.py
# builds in .whl/ first (te_site.tar.xz and a megatron-core wheel): scripts/offline_site.sh
# unpacks them and puts them on PYTHONPATH.
#
# LOG_DIR ends up holding a handful of files: one log per step, versions.txt, and runs.tar.gz with
# the benchmarks' event logs and traces, so that a harness that returns few files gets them all.
#
# Usage: BUDGET_S=480 bash scripts/gpu_checks.sh [LOG_DIR]   (default: $OUT if set, else gpu_logs)
#        STEPS="detection_overhead" ... runs only the steps named (space-separated).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
    echo "error: scripts/gpu_checks.sh needs a CUDA GPU that python3's torch can use; on CPU run scripts/test.sh" >&2
    exit 2
fi
logs=${1:-${OUT:-gpu_logs}}
runs=$(mktemp -d)
mkdir -p "$logs"
start=$(date +%s)
budget=${BUDGET_S:-480}
left() { echo $(( budget - ($(date +%s) - start) )); }

source scripts/offline_site.sh
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 - <<'EOF' 2>&1 | tee "$logs/versions.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
for name in ("megatron.core", "transformer_engine"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, "not importable:", error)
EOF

selected() {  # selected NAME: whether STEPS (when set) names the step
    [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]
}

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S (less if the budget is short)
    local name=$1 limit=$2 remaining
    shift 2
    selected "$name" || return
    remaining=$(left)
    if [ "$remaining" -lt 30 ]; then
        echo "== $name skipped: $remaining s of the budget left"
        return
    fi
    [ "$limit" -gt "$remaining" ] && limit=$remaining
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" > "$logs/$name.log" 2>&1
    echo "== $name: exit $? after $(( $(date +%s) - start )) s"
    tail -30 "$logs/$name.log"
    tar czf "$logs/runs.tar.gz" -C "$runs" .
}

# The benchmarks keep their event logs and traces in $runs, packed into LOG_DIR after each step, so
# a run cut short by its limit still leaves what it measured.
step gpu_tests 240 python3 -m pytest -q -rs --tb=short -p no:warnings tests/gpu
# TE's THD attention against ours needs TE: a node without it skips the step, saying so, as
# tests/gpu skips its TE tests.
if python3 -c "import transformer_engine" 2> /dev/null; then
    step thd_attention 90 python3 scripts/bench/thd_attention.py --rounds 9
elif selected thd_attention; then
    echo "== thd_attention skipped: Transformer Engine is not importable (tools/te_offline_bundle.py builds it for an offline node)"
fi
# Three pairs of runs: on one H200 two pairs of the same job read 4.1% and -0.9%, each with an
# interval that excluded the other (docs/notes/benchmarks.md section 37), so the pooled interval counts
# how far the pairs disagree. 100 iterations a run: probe baseline rounds (after detections 1, 2,
# 4, ..., 32) leave a few detections out of each run's estimate.
step detection_overhead 300 python3 scripts/bench/live_detection.py --device cuda --shape tp1pp1dp1 \
    --model medium --bf16 --overhead-only --overhead-iters 100 --overhead-repeats 3 \
    --workdir "$runs/detection_overhead"
step live_detection 300 python3 scripts/bench/live_detection.py --device cuda --shape tp1pp1dp1 \
    --model medium --bf16 --healthy-iters 200 --slow-iters 40 --overhead-iters 40 --workdir "$runs/live_detection"
echo "== done in $(( $(date +%s) - start )) s"
