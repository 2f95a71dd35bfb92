"""One shared rank fork server for the session's jobs (``scripts/shared_fork_server.py``).

The suite launches some 250 jobs through ``scripts/launch_local.py``; each would otherwise import
torch, megatron-core and Megatron's training package again in a fork server of its own, and torch in
the launcher for the store (a 1-iteration 8-rank job reached its first iteration 3.95 s after
launch through this server, 11.7 s through its own, on a 2-core host: ``docs/results.md``). Started
only when the session runs tests that launch jobs; launches read its socket from
``$RESIHP_FORK_SERVER``. A launch whose environment differs from the session's (a test's extra
variables) is declined by the server and forks a server of its own, as every launch did before.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from scripts.child_env import job_env

REPO = Path(__file__).resolve().parents[1]
# Suites whose tests start jobs through scripts/launch_local.py.
LAUNCHING = ("dist", "executor")
# Variables a launch may set apart from the session's: read only once a rank runs (pytest's name of
# the running test; the cache folder of megatron-core's dataset indexes; the attention backend, which
# megatron-core sets in the environment of a process that builds a GPT model, as tests here do; the
# folder torch.compile caches its code in, read as a rank compiles), never while the server imports.
RUN_TIME_ONLY = ("PYTEST_CURRENT_TEST", "XDG_CACHE_HOME", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
                 "TORCHINDUCTOR_CACHE_DIR")
START_TIMEOUT_S = 120


def _launches_jobs(session) -> bool:
    tests = REPO / "tests"
    return any(Path(item.path).is_relative_to(tests / suite) for item in session.items for suite in LAUNCHING)


@pytest.fixture(scope="session", autouse=True)
def shared_rank_fork_server(request):
    if "RESIHP_FORK_SERVER" in os.environ or not _launches_jobs(request.session):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="resihp-fork-") as folder:
        sock = os.path.join(folder, "server.sock")
        os.environ["RESIHP_FORK_SERVER"] = sock
        ignored = [arg for name in RUN_TIME_ONLY for arg in ("--ignore-env", name)]
        server = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "shared_fork_server.py"), sock, str(REPO / "pretrain_gpt_resilient.py"),
             *ignored, "--die-with-parent"], cwd=REPO, env=job_env(), stdout=subprocess.PIPE,
            stderr=open(os.path.join(folder, "server.err"), "w"), text=True)
        try:
            said, _, _ = select.select([server.stdout], [], [], START_TIMEOUT_S)
            ready = bool(said) and server.stdout.readline().strip() == "ready"
            if not ready:
                server.kill()
                del os.environ["RESIHP_FORK_SERVER"]
                warnings.warn(f"the shared rank fork server did not start within {START_TIMEOUT_S} s (exit "
                              f"{server.wait()}): {Path(folder, 'server.err').read_text()[-2000:]}; every launch "
                              f"forks its own")
            yield sock if ready else None
        finally:
            os.environ.pop("RESIHP_FORK_SERVER", None)
            server.terminate()
            server.wait(timeout=30)
