#!/usr/bin/env bash
# GPU CI for one node: every check that needs a GPU, with whatever GPUs the node has.
#
#   bash scripts/gpu_ci.sh [LOG_DIR]      (default: $OUT if set, else gpu_ci_logs)
#
# 1 GPU:  tests/gpu (the multi-GPU tests skip, each naming the GPUs it needs), then the GPU
#         benchmarks of scripts/gpu_checks.sh (THD attention, detection's cost, live detection).
# >= 2:   the same, and tests/gpu's multi-GPU tests run: DP2 against the CPU job, a SIGKILL on NCCL
#         survived in place with exact parameters (4 GPUs), a 2x slow GPU re-planned in place,
#         TP2 x PP2 x DP2 (8 GPUs).
#
# Exit code: 0 when every test passed or was skipped with its reason and every benchmark step ended
# 0; 1 otherwise; 2 without a usable GPU. LOG_DIR gets gpu_tests.log, gpu_tests.xml (JUnit), the
# benchmarks' logs (scripts/gpu_checks.sh's layout) and summary.txt.
#
# Settings: GPU_CI_TESTS_S (default 1200) bounds the tests; BUDGET_S (480) the benchmarks;
# GPU_CI_BENCH=0 skips the benchmarks (a cluster run keeps its time for the multi-node jobs).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-gpu_ci_logs}}
num_gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$num_gpus" -lt 1 ]; then
    echo "error: scripts/gpu_ci.sh needs a CUDA GPU that python3's torch can use; on CPU run scripts/test.sh" >&2
    exit 2
fi
# Survivors of a dead peer must see their NCCL calls fail, not their process torn down
# (docs/launching.md, "NCCL settings"); the jobs the tests start inherit these.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-2}
export TORCH_NCCL_ENABLE_MONITORING=${TORCH_NCCL_ENABLE_MONITORING:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
source scripts/offline_site.sh
mkdir -p "$logs"
start=$(date +%s)
echo "== gpu_ci on $(hostname): $num_gpus GPU(s)" | tee "$logs/summary.txt"

timeout "${GPU_CI_TESTS_S:-1200}" python3 -m pytest -q -rs --tb=short -p no:cacheprovider -p no:warnings \
    --junitxml="$logs/gpu_tests.xml" tests/gpu > "$logs/gpu_tests.log" 2>&1
tests_code=$?
tail -25 "$logs/gpu_tests.log"
echo "== tests/gpu: exit $tests_code after $(( $(date +%s) - start )) s" | tee -a "$logs/summary.txt"

bench_code=0
if [ "${GPU_CI_BENCH:-1}" != 0 ]; then
    # The benchmarks only: gpu_checks.sh's own tests/gpu step is the one above.
    STEPS=${STEPS:-"thd_attention detection_overhead live_detection"} bash scripts/gpu_checks.sh "$logs" \
        > "$logs/gpu_checks.log" 2>&1
    tail -40 "$logs/gpu_checks.log"
    # gpu_checks.sh reports each step's exit code in its "== NAME: exit N" lines.
    if grep -E "^== [a-z_]+: exit [1-9]" "$logs/gpu_checks.log" >/dev/null; then bench_code=1; fi
    grep -E "^== [a-z_]+: exit " "$logs/gpu_checks.log" | tee -a "$logs/summary.txt"
fi

echo "== gpu_ci done in $(( $(date +%s) - start )) s" | tee -a "$logs/summary.txt"
[ "$tests_code" = 0 ] && [ "$bench_code" = 0 ]
