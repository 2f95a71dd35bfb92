"""CPU ranks keep the memory they free: steady training steps touch no new pages."""

import ctypes.util
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each variant runs in a fresh process: glibc's settings last for the process's life.
_STEPS = """
import resource, statistics, sys
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
if sys.argv[1] == "keep":
    from megatron.resihp.host_memory import keep_freed_memory
    assert keep_freed_memory()
elif sys.argv[1] == "cpu-rank":  # what a CPU rank does before Megatron starts
    from megatron.resihp.gpt_pretrain import _run_as_a_device
    _run_as_a_device()
layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
x = torch.randn(2, 256, 256)
faults = []
for step in range(32):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    layer(x).sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
print(statistics.median(faults[6:]), statistics.mean(faults[6:]))
"""

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or "libc.so" not in (ctypes.util.find_library("c") or ""),
    reason="glibc's mallopt and per-thread page-fault counts are Linux-only",
)


def _faults_per_step(variant: str, *args: str) -> tuple[float, float]:
    """Page faults per steady step (after 6 warm-up steps), their median and their mean, each the
    median over three runs: both variants fault in bursts, so one run's mean varies several-fold
    (measured, 8 runs each: glibc's defaults 488-2,510 per step, one CI run 135; kept memory
    5-94, a CPU rank 0-118)."""
    runs = []
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _STEPS, variant, *args], cwd=REPO, capture_output=True,
                              text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr
        runs.append(tuple(float(x) for x in done.stdout.split()[-2:]))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


@pytest.fixture(scope="module")
def default_faults() -> float:
    # On the mean: under glibc's defaults steps fault in bursts (0 in one step, 1,000-3,500 in
    # another, depending on when the heap top is trimmed), and the median of some runs is 0.
    _, faults = _faults_per_step("default")
    assert faults >= 50, f"glibc's defaults gave {faults} faults per step; the comparison needs them to fault"
    return faults


def test_kept_memory_serves_steady_steps_without_page_faults(default_faults):
    median, mean = _faults_per_step("keep")
    assert median <= default_faults / 20 and mean <= default_faults / 4, (default_faults, median, mean)


def test_a_cpu_rank_keeps_freed_memory_from_start_up(default_faults):
    median, mean = _faults_per_step("cpu-rank")
    assert median <= default_faults / 20 and mean <= default_faults / 4, (default_faults, median, mean)
