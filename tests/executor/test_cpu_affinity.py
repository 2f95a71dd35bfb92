"""CPU ranks get a core of their own when the host has one for each, and are left alone otherwise;
unpinned ranks probe on one shared core."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.resihp.cpu_affinity import core_for_rank
from megatron.resihp.detection import on_probe_core
from scripts.child_env import job_env

REPO = Path(__file__).resolve().parents[2]


def test_a_rank_per_core_pins_each_rank_to_its_own_core():
    assert [core_for_rank(r, 2, [0, 1], None) for r in range(2)] == [0, 1]
    assert [core_for_rank(r, 3, [2, 5, 7, 9], None) for r in range(3)] == [2, 5, 7]


def test_more_ranks_than_cores_are_left_to_the_scheduler_unless_told():
    assert core_for_rank(3, 8, [0, 1], None) is None
    assert core_for_rank(3, 8, [0, 1], "1") == 1
    assert core_for_rank(0, 1, [0, 1], "0") is None


def test_a_bad_setting_names_the_variable_and_its_values():
    with pytest.raises(ValueError, match="RESIHP_CPU_PIN must be 0 .* 1 .* or unset"):
        core_for_rank(0, 1, [0], "yes")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a host with two cores this process may use")
def test_a_real_process_is_pinned():
    code = "import os; from megatron.resihp.cpu_affinity import pin_this_rank; print(pin_this_rank(), " \
           "sorted(os.sched_getaffinity(0)))"
    cpus = sorted(os.sched_getaffinity(0))
    env = job_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, without=["RESIHP_CPU_PIN"])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split(None, 1) == [str(cpus[1]), f"[{cpus[1]}]\n"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a host with two cores this process may use")
def test_cpu_probes_run_on_the_first_core_and_the_thread_goes_back_after():
    cores = os.sched_getaffinity(0)
    with on_probe_core(torch.device("cpu")):
        assert os.sched_getaffinity(0) == {min(cores)}
    assert os.sched_getaffinity(0) == cores
    with on_probe_core(torch.device("cuda")):  # a device of its own: nothing moves
        assert os.sched_getaffinity(0) == cores
