"""Jobs started by the scripts and tests keep the caller's PYTHONPATH behind this checkout."""

import os

from scripts.child_env import REPO, repo_pythonpath


def test_the_callers_pythonpath_follows_the_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/megatron-lm", "/opt/te"]))
    assert repo_pythonpath().split(os.pathsep) == [str(REPO), "/opt/megatron-lm", "/opt/te"]


def test_without_one_the_checkout_alone(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert repo_pythonpath() == str(REPO)
    monkeypatch.setenv("PYTHONPATH", "")
    assert repo_pythonpath() == str(REPO)
