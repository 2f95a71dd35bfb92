"""scripts/launch_local.py with real processes: a gloo job runs, survivors outlive a SIGKILLed rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_local.py"

# Every rank joins a gloo world through env:// (the launcher's store), all-reduces, and, if it is
# the rank named by --die, SIGKILLs itself; the others sleep past the kill and then leave a file,
# which only a rank the launcher did not tear down can write.
WORKER = r'''
import os, signal, sys, time
import torch, torch.distributed as dist
out, die = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size(), t
if rank == die:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.5)
with open(os.path.join(out, f"done{rank}"), "w") as f:
    f.write(str(t.item()))
'''


def launch(tmp_path: Path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_all_ranks_succeed(tmp_path, worker):
    proc = launch(tmp_path, "--nproc-per-node", "3", str(worker), str(tmp_path), "-1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done2"]
    assert "launch_local:" not in proc.stderr


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_run_to_completion(tmp_path, worker, victim):
    # Rank 0 is the interesting victim: under plain env:// it would have hosted the store.
    proc = launch(tmp_path, "--nproc-per-node", "3", str(worker), str(tmp_path), str(victim))
    survivors = sorted(f"done{r}" for r in range(3) if r != victim)
    assert sorted(p.name for p in tmp_path.glob("done*")) == survivors, proc.stderr
    assert f"launch_local: rank {victim} exited with signal SIGKILL; 2 ranks still running" in proc.stderr
    assert proc.returncode == 0, proc.stderr


def test_failing_rank_sets_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nr = int(os.environ['RANK'])\n"
                      "time.sleep(0.5 * r)\nsys.exit(3 if r == 1 else 0)\n")
    proc = launch(tmp_path, "--nproc-per-node", "3", str(script))
    assert proc.returncode == 3, proc.stderr
    # Rank 0 has finished by then (it exits at once), rank 2 has not (it sleeps 1 s).
    assert "launch_local: rank 1 exited with code 3; 1 ranks still running" in proc.stderr


def test_sigterm_is_forwarded(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (open(os.environ['RANK'] + '.term', 'w').close(), sys.exit(0)))\n"
                      "open(os.environ['RANK'] + '.up', 'w').close()\ntime.sleep(60)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", "2", str(script)],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.up"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.glob("*.term")) == ["0.term", "1.term"]


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be >= 1"),
    (["--nproc-per-node", "two", "x.py"], "--nproc-per-node"),
    (["x.py"], "--nproc-per-node"),
    (["--nproc-per-node", "2", "missing.py"], "is not a file"),
    (["--nproc-per-node", "2", "--master-port", "70000", "x.py"], "--master-port must be in 0..65535"),
])
def test_bad_cli_exits_2(tmp_path, args, message):
    (tmp_path / "x.py").write_text("")
    proc = launch(tmp_path, *args)
    assert proc.returncode == 2
    assert message in proc.stderr
