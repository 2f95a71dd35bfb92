"""The printed command that resumes a job from its checkpoint starts it as it was started: through the
local launcher, or as a Slurm batch job on as many nodes."""

from __future__ import annotations

import shlex

import pytest

from megatron.resihp.fail_stop_recovery import resume_command

ARGV = ["pretrain_gpt_resilient.py", "--num-layers", "4", "--load", "old", "--resihp-inject", "kill:rank=1,at=3",
        "--resihp-inject=hang:rank=2,at=4", "--data-path", "my corpus", "--resihp-enable"]


def test_a_local_job_resumes_through_the_local_launcher_without_its_faults_or_old_load(monkeypatch):
    monkeypatch.setenv("RESIHP_LAUNCHER", "launch_local")
    command = resume_command(ARGV, 8, "/ckpt")
    assert shlex.split(command) == ["python", "scripts/launch_local.py", "--nproc-per-node", "8",
                                    "pretrain_gpt_resilient.py", "--num-layers", "4", "--data-path", "my corpus",
                                    "--resihp-enable", "--load", "/ckpt"]


@pytest.mark.parametrize("nodes, nproc, tasks", [("2", 8, "--ntasks-per-node=4"), ("3", 8, "--ntasks=8")])
def test_a_slurm_job_resumes_as_a_batch_job_of_its_batch_script(monkeypatch, nodes, nproc, tasks):
    monkeypatch.setenv("RESIHP_LAUNCHER", "slurm")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", nodes)
    command = shlex.split(resume_command(ARGV, nproc, None))
    assert command[:4] == ["sbatch", f"--nodes={nodes}", tasks, "scripts/slurm/pretrain_resilient.sbatch"]
    assert command[4:] == ["pretrain_gpt_resilient.py", "--num-layers", "4", "--data-path", "my corpus",
                           "--resihp-enable"]
