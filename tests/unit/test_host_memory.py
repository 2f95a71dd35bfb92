"""CPU ranks keep the memory they free: steady training steps touch no new pages."""

import ctypes.util
import platform
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
    from megatron.training.host_memory import keep_freed_memory
    assert keep_freed_memory()
elif sys.argv[1] == "cpu-rank":  # a CPU rank's own start-up
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_distributed
    initialize_distributed(parse_args(sys.argv[2:]))
layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
x = torch.randn(2, 256, 256)
faults = []
for step in range(32):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    layer(x).sum().backward()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
print(statistics.median(faults[6:]), statistics.mean(faults[6:]))
"""

_TINY_ARGS = ("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
              "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--vocab-size", "64",
              "--device", "cpu")

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or "libc.so" not in (ctypes.util.find_library("c") or ""),
    reason="glibc's mallopt and per-thread page-fault counts are Linux-only",
)


def _faults_per_step(variant: str, *args: str) -> tuple[float, float]:
    """Page faults per steady step (after 6 warm-up steps): their median and their mean."""
    done = subprocess.run([sys.executable, "-c", _STEPS, variant, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    median, mean = done.stdout.split()[-2:]
    return float(median), float(mean)


@pytest.fixture(scope="module")
def default_faults() -> float:
    # On the mean: under glibc's defaults steps fault in bursts (0 in one step, 1,000-3,500 in
    # another, depending on when the heap top is trimmed), and the median of some runs is 0.
    # Whether a run trims at all varies too (one in a full unit run gave under 50 per step), so
    # the reference is the most of up to three runs.
    faults = 0.0
    for _ in range(3):
        faults = max(faults, _faults_per_step("default")[1])
        if faults >= 50:
            return faults
    raise AssertionError(f"glibc's defaults gave at most {faults} faults per step in 3 runs; the comparison "
                         "needs them to fault")


def test_kept_memory_serves_steady_steps_without_page_faults(default_faults):
    median, mean = _faults_per_step("keep")
    assert median <= default_faults / 20 and mean <= default_faults / 5, (default_faults, median, mean)


def test_a_cpu_rank_keeps_freed_memory_from_start_up(default_faults):
    median, mean = _faults_per_step("cpu-rank", *_TINY_ARGS)
    assert median <= default_faults / 20 and mean <= default_faults / 5, (default_faults, median, mean)
