"""scripts/shared_fork_server.py with real processes: launches take the launcher's working
directory, environment and output; a launch under another environment, or with no server there,
is handled as the launcher says; the server's end ends its launches' ranks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.child_env import job_env
from tests.dist.launch import assert_all_end

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_local.py"

# Each rank says where it runs, what it was told, and whether it reached its peers through the store.
REPORT = r'''
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
# One write per line: the two ranks share the pipes, and print() writes the end of line apart.
sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()} in {os.getcwd()} with {os.environ.get('ASKED')} "
                 f"args {sys.argv[1:]}\n")
sys.stderr.write(f"rank {dist.get_rank()} says so on stderr\n")
'''


def launch(cwd: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def shared(shared_rank_fork_server) -> str:
    if shared_rank_fork_server is None:
        pytest.skip("no shared fork server in this session (it did not start, or one was given from outside)")
    return shared_rank_fork_server


def test_a_launch_runs_where_and_as_its_launcher_says(tmp_path, shared):
    (tmp_path / "report.py").write_text(REPORT)
    # The variable is named as run-time only, so the server takes this launch (tests/conftest.py).
    env = job_env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    proc = launch(tmp_path, "--nproc-per-node", "2", "report.py", "a", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "launch_local:" not in proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"rank {r} of 2 in {tmp_path} with None args ['a']" for r in (0, 1)]
    assert sorted(line for line in proc.stderr.splitlines() if "says so" in line) == \
        ["rank 0 says so on stderr", "rank 1 says so on stderr"]


def test_a_launch_under_another_environment_forks_a_server_of_its_own(tmp_path, shared):
    (tmp_path / "report.py").write_text(REPORT)
    proc = launch(tmp_path, "--nproc-per-node", "2", "report.py", env=job_env({"ASKED": "yes"}))
    assert proc.returncode == 0, proc.stderr
    assert ("launch_local: the fork server imported its modules under another environment (differing: ASKED); "
            "this launch forks a server of its own") in proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"rank {r} of 2 in {tmp_path} with yes args []" for r in (0, 1)]


def test_no_server_at_the_socket_exits_2_naming_the_flag(tmp_path):
    (tmp_path / "x.py").write_text("open('ran', 'w').close()\n")
    missing = tmp_path / "none.sock"
    proc = launch(tmp_path, "--nproc-per-node", "2", "--fork-server", str(missing), "x.py", env=job_env())
    assert proc.returncode == 2
    assert f"launch_local: error: --fork-server {missing}: no fork server answers there" in proc.stderr
    assert not (tmp_path / "ran").exists()


def test_the_servers_end_ends_its_launches(tmp_path):
    # A server of this test's own, with the modules of a small script: ended mid-launch.
    sock = tmp_path / "own.sock"
    (tmp_path / "wait.py").write_text("import os, time\nopen(f'{os.getpid()}.up', 'w').close()\ntime.sleep(60)\n")
    env = job_env(without=["RESIHP_FORK_SERVER"])
    server = subprocess.Popen([sys.executable, str(REPO / "scripts" / "shared_fork_server.py"), str(sock),
                               str(tmp_path / "wait.py"), "--die-with-parent"], env=env, stdout=subprocess.PIPE,
                              text=True)
    launcher = None
    try:
        assert server.stdout.readline().strip() == "ready"
        launcher = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", "2", "--fork-server", str(sock),
                                     "wait.py"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.up"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = [int(p.name.split(".")[0]) for p in tmp_path.glob("*.up")]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0
        assert not sock.exists()
        assert launcher.wait(timeout=20) == 1
        assert "the rank fork server ended with ranks [0, 1] unreported" in launcher.stderr.read()
        assert_all_end(pids, "the server")
    finally:
        server.kill()
        if launcher is not None:
            launcher.kill()


def test_a_socket_path_in_use_is_refused(tmp_path):
    (tmp_path / "taken.sock").write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "shared_fork_server.py"), str(tmp_path / "taken.sock"),
                           str(REPO / "pretrain_gpt_resilient.py")], env=job_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "taken.sock exists; remove it or pass another path" in proc.stderr
