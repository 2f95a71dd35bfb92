"""A Slurm task's rank environment: Slurm's step variables in, the local launcher's variables out."""

import subprocess
import sys

import pytest

from scripts.child_env import REPO, job_env
from scripts.slurm.slurm_rank import rank_env, rank_vars, tasks_per_node  # rank_vars: launch_local's

STEP = {"SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "MASTER_ADDR": "node-a", "MASTER_PORT": "29511",
        "PATH": "/usr/bin"}


def test_compressed_task_counts_expand_in_node_order():
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("4(x2),3") == [4, 4, 3]
    assert tasks_per_node("2,1(x3)") == [2, 1, 1, 1]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_per_node("4x2")


def test_a_task_on_the_second_node_gets_its_global_and_local_place():
    env = rank_env({**STEP, "SLURM_PROCID": "4", "SLURM_NODEID": "1", "SLURM_LOCALID": "1"})
    assert (env["RANK"], env["WORLD_SIZE"]) == ("4", "7")
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "3", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node-a", "29511")
    assert env["RESIHP_LAUNCHER"] == "slurm" and env["PATH"] == "/usr/bin"
    # Every variable a local worker reads is there, so the rank takes the same start-up path.
    assert set(rank_vars(4, 7, "node-a", 29511)) <= set(env)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_the_last_node_holds_fewer_tasks():
    env = rank_env({**STEP, "SLURM_PROCID": "6", "SLURM_NODEID": "2", "SLURM_LOCALID": "0"})
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("6", "0", "1")


def test_missing_store_address_names_the_variables_and_the_fix():
    step = {k: v for k, v in STEP.items() if k != "MASTER_PORT"}
    with pytest.raises(ValueError, match="MASTER_PORT not set: start this under srun"):
        rank_env({**step, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"})


def test_a_task_outside_the_layout_is_refused():
    with pytest.raises(ValueError, match="outside the step's layout"):
        rank_env({**STEP, "SLURM_PROCID": "2", "SLURM_NODEID": "0", "SLURM_LOCALID": "3"})


def test_outside_srun_it_exits_2_with_the_reason():
    env = job_env(without=[k for k in STEP if k != "PATH"] + ["SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID"])
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "slurm" / "slurm_rank.py"), "pretrain_gpt_resilient.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "slurm_rank: error: SLURM_PROCID" in proc.stderr and "start this under srun" in proc.stderr
