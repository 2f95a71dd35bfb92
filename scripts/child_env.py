"""PYTHONPATH for a job that a script or test of this checkout starts."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_pythonpath() -> str:
    """This checkout first, then the caller's own PYTHONPATH: Megatron users often reach
    megatron-core or Transformer Engine through it, and a job that dropped it could not import them."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
