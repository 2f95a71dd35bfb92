"""Jobs started by the scripts and tests: the caller's environment, its PYTHONPATH behind this checkout."""

import os

from scripts.child_env import REPO, job_env, repo_pythonpath


def test_the_callers_pythonpath_follows_the_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/megatron-lm", "/opt/te"]))
    assert repo_pythonpath().split(os.pathsep) == [str(REPO), "/opt/megatron-lm", "/opt/te"]


def test_without_one_the_checkout_alone(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert repo_pythonpath() == str(REPO)
    monkeypatch.setenv("PYTHONPATH", "")
    assert repo_pythonpath() == str(REPO)


def test_a_jobs_environment_is_the_callers_with_extras_on_top_and_named_variables_dropped(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/te")
    monkeypatch.setenv("RESIHP_DISABLE_OP_HOOKS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    env = job_env({"OMP_NUM_THREADS": "2", "LOCAL_RANK": "1"}, without=["RESIHP_DISABLE_OP_HOOKS"])
    assert env["PYTHONPATH"] == os.pathsep.join([str(REPO), "/opt/te"])
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["PYTHONUNBUFFERED"] == "1"
    assert env["OMP_NUM_THREADS"] == "2" and env["LOCAL_RANK"] == "1"
    assert "RESIHP_DISABLE_OP_HOOKS" not in env
    assert job_env()["OMP_NUM_THREADS"] == "1"
    assert os.environ["RESIHP_DISABLE_OP_HOOKS"] == "1"  # the caller's own is left alone
