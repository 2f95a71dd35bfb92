"""pretrain_resilient.sbatch refuses bad input before it starts anything: exit 2, one message naming
what to fix, no store started and no run folder left."""

import os
import subprocess

import pytest

from scripts.child_env import REPO

SBATCH = REPO / "scripts" / "slurm" / "pretrain_resilient.sbatch"


def _run(tmp_path, args, **env):
    return subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "RESIHP_REPO": str(REPO), **env})


@pytest.mark.parametrize("args, env, message", [
    ([], {}, "no training script; pass it and its flags after the sbatch file"),
    (["pretrain_gpt_resilient.py"], {"RESIHP_REPO": "/"}, "/ is not a ResiHP checkout"),
    (["pretrain_gpt_resilient.py"], {"RESIHP_FENCE_AFTER_DONE_S": "1.5"},
     "RESIHP_FENCE_AFTER_DONE_S=1.5 is not a whole number of seconds"),
])
def test_bad_input_is_refused_with_exit_2_and_nothing_started(tmp_path, args, env, message):
    proc = _run(tmp_path, args, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("pretrain_resilient.sbatch: error:") == 1 and message in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no store port file
