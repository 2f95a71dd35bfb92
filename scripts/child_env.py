"""The environment of a job that a script or test of this checkout starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    """This checkout first, then the caller's own PYTHONPATH: Megatron users often reach
    megatron-core or Transformer Engine through it, and a job that dropped it could not import them."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def job_env(extra: Mapping[str, str] | None = None, without: Iterable[str] = ()) -> dict[str, str]:
    """The caller's environment with this checkout importable (``repo_pythonpath``), one OpenMP
    thread per process (a job's ranks share the host's cores) and unbuffered output (a killed rank's
    last lines still reach its log), then ``extra``; the variables named in ``without`` are dropped."""
    dropped = set(without)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update({"PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env
