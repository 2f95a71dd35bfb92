"""scripts/launch_local.py with real processes: a gloo job runs, survivors outlive a SIGKILLed rank."""

from __future__ import annotations

import json
import os
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


def launch(tmp_path: Path, *args: str, timeout_s: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=tmp_path, env=env or job_env(),
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(params=["own", "shared"])
def server_env(request, shared_rank_fork_server) -> dict:
    """The launcher's environment: ranks forked from a fork server of the launch's own, or from the
    session's shared one (``tests/conftest.py``), which starts the job's store too."""
    if request.param == "own":
        return job_env(without=["RESIHP_FORK_SERVER"])
    if shared_rank_fork_server is None:
        pytest.skip("no shared fork server in this session (it did not start, or one was given from outside)")
    return job_env()


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_all_ranks_succeed(tmp_path, worker, server_env):
    proc = launch(tmp_path, "--nproc-per-node", "3", str(worker), str(tmp_path), "-1", env=server_env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done2"]
    assert "launch_local:" not in proc.stderr


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_run_to_completion(tmp_path, worker, victim, server_env):
    # Rank 0 is the interesting victim: under plain env:// it would have hosted the store.
    proc = launch(tmp_path, "--nproc-per-node", "3", str(worker), str(tmp_path), str(victim), env=server_env)
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


def test_a_rank_stopped_by_a_signal_after_every_other_ended_is_killed_and_the_launch_exits(tmp_path):
    # Rank 1 stops itself and no beacon is there to fence it (its beacon died before, as when the
    # others named it dead by its heartbeat's timeout): once rank 0 has finished, nothing can ever
    # continue rank 1, and the launch must not wait on it.
    script = tmp_path / "stop.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                      "time.sleep(0.5)\n")
    started = time.monotonic()
    proc = launch(tmp_path, "--nproc-per-node", "2", str(script), timeout_s=30)
    assert proc.returncode == 0, proc.stderr
    assert "launch_local: ranks [1] stopped by a signal 5 s ago and every other rank has ended" in proc.stderr
    assert "launch_local: rank 1 exited with signal SIGKILL" in proc.stderr
    assert time.monotonic() - started < 20


def test_ranks_outlive_their_fork_server_and_the_launcher_reports_their_ends(tmp_path):
    # The fork server only starts ranks: SIGKILLed while they run (an out-of-memory kill may pick
    # it), it must take no rank with it. Rank 1 then fails, and its code still reaches the launcher.
    script = tmp_path / "outlive.py"
    script.write_text("import os, sys, time\nr = os.environ['RANK']\n"
                      "open(f'{r}.parent', 'w').write(str(os.getppid()))\n"
                      "while not os.path.exists('go'):\n    time.sleep(0.05)\n"
                      "open(f'{r}.done', 'w').close()\nsys.exit(5 if r == '1' else 0)\n")
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", "2", str(script)], cwd=tmp_path,
                            env=job_env(without=["RESIHP_FORK_SERVER"]), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len([p for p in tmp_path.glob("*.parent") if p.read_text()]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        servers = {int(p.read_text()) for p in tmp_path.glob("*.parent")}
        assert len(servers) == 1 and proc.pid not in servers
        os.kill(servers.pop(), signal.SIGKILL)
        time.sleep(1.0)  # long enough for a rank taken down with the server to be gone
        (tmp_path / "go").touch()
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.glob("*.done")) == ["0.done", "1.done"], stderr
    assert "launch_local: the rank fork server died; ranks [0, 1] go on as this launcher's children" in stderr
    assert "launch_local: rank 1 exited with code 5" in stderr
    assert proc.returncode == 5, stderr


# "group": SIGTERM to the launcher's whole process group, as a scheduler or a shell's job control
# sends it; the ranks must still hear it once, and get their grace period.
@pytest.mark.parametrize("target", ["launcher", "group"])
def test_sigterm_is_forwarded(tmp_path, target, server_env):
    script = tmp_path / "wait.py"
    script.write_text("import os, signal, sys, time\n"
                      "def leave(*_):\n    time.sleep(0.5)  # a rank taking its time to save\n"
                      "    open(os.environ['RANK'] + '.term', 'a').write('x')\n    sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, leave)\n"
                      "open(os.environ['RANK'] + '.up', 'w').close()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", "2", str(script)],
                            cwd=tmp_path, env=server_env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.up"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert sorted(p.name for p in tmp_path.glob("*.term")) == ["0.term", "1.term"]
    assert [p.read_text() for p in sorted(tmp_path.glob("*.term"))] == ["x", "x"]  # once each


# Rank 0 checks what ``python -u SCRIPT ARGS`` would give it and leaves through an atexit handler;
# rank 1 dies of an uncaught exception.
AS_MAIN = r'''
import atexit, os, sys
import json
rank = int(os.environ["RANK"])
here = os.path.dirname(os.path.abspath(__file__))
seen = {"name": __name__, "argv": sys.argv[1:], "path0": sys.path[0] == here,
        "script": os.path.abspath(sys.argv[0]) == os.path.abspath(__file__)}
atexit.register(lambda: open(os.path.join(here, f"exit{rank}.json"), "w").write(json.dumps(seen)))
if rank == 1:
    raise ValueError("rank 1 fails on purpose")
'''


@pytest.mark.parametrize("preload", ["auto", "none", "json,os", "shared"])
def test_ranks_run_the_script_as_the_interpreter_would(tmp_path, preload, shared_rank_fork_server):
    script = tmp_path / "as_main.py"
    script.write_text(AS_MAIN)
    if preload == "shared" and shared_rank_fork_server is None:
        pytest.skip("no shared fork server in this session")
    env = job_env() if preload == "shared" else job_env(without=["RESIHP_FORK_SERVER"])
    flags = [] if preload == "shared" else ["--preload", preload]
    proc = launch(tmp_path, "--nproc-per-node", "2", *flags, str(script), "a", "--b", env=env)
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: rank 1 fails on purpose" in proc.stderr and "Traceback" in proc.stderr
    assert "launch_local: rank 1 exited with code 1" in proc.stderr
    for rank in (0, 1):  # atexit handlers ran, after the exception too
        seen = json.loads((tmp_path / f"exit{rank}.json").read_text())
        assert seen == {"name": "__main__", "argv": ["a", "--b"], "path0": True, "script": True}


def test_preload_reads_the_scripts_top_level_imports_and_warning_filters(tmp_path):
    sys.path.insert(0, str(LAUNCHER.parent))
    try:
        from rank_fork_server import script_preload
    finally:
        sys.path.remove(str(LAUNCHER.parent))
    script = tmp_path / "s.py"
    script.write_text("from __future__ import annotations\nimport os, json\nimport warnings\n"
                      "warnings.filterwarnings('ignore', message='noisy')\nwarnings.simplefilter(mode)\n"
                      "from collections import abc\nfrom . import sibling\n"
                      "def f():\n    import email\nif True:\n    import csv\n"
                      "if __name__ == '__main__':\n    import glob\n    from pathlib import Path\n    f()\n    import csv\n")
    preload = script_preload(str(script))
    assert preload.modules == ("os", "json", "warnings", "collections", "glob", "pathlib")
    assert preload.warning_filters == (("filterwarnings", ("ignore",), {"message": "noisy"}),)


def test_ranks_die_with_a_sigkilled_launcher(tmp_path, server_env):
    script = tmp_path / "wait.py"
    script.write_text("import os, time\nopen(f\"{os.getpid()}.up\", 'w').close()\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", "2", str(script)],
                            cwd=tmp_path, env=server_env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.up"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.1)
        pids = [int(p.name.split(".")[0]) for p in tmp_path.glob("*.up")]
        proc.kill()
        proc.wait(timeout=10)
        assert_all_end(pids, "the launcher")
    finally:
        proc.kill()


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be >= 1"),
    (["--nproc-per-node", "two", "x.py"], "--nproc-per-node"),
    (["x.py"], "--nproc-per-node"),
    (["--nproc-per-node", "2", "missing.py"], "is not a file"),
    (["--nproc-per-node", "2", "--master-port", "70000", "x.py"], "--master-port must be in 0..65535"),
    (["--nproc-per-node", "2", "bad.py"], "--preload auto could not read the imports"),
    (["--nproc-per-node", "2", "--preload", "none", "--fork-server", "s.sock", "x.py"],
     "--preload none starts the ranks from a bare interpreter, and --fork-server"),
])
def test_bad_cli_exits_2(tmp_path, args, message):
    (tmp_path / "x.py").write_text("")
    (tmp_path / "bad.py").write_text("def (:\n")
    proc = launch(tmp_path, *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_port_in_use_is_refused_naming_the_flag(tmp_path, server_env):
    import socket

    (tmp_path / "x.py").write_text("open('ran', 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launch(tmp_path, "--nproc-per-node", "2", "--master-port", str(port), "x.py", env=server_env)
    assert proc.returncode == 2, proc.stderr
    assert f"launch_local: error: --master-port {port} is in use" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "ran").exists()
