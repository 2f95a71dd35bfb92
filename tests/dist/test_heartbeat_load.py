"""Heartbeats on a host that runs short of CPU: busy processes started by the test load the
2-core host while a job trains; no live rank may be named dead or hung, and a rank SIGKILLed
during the load is still named dead. And one monitor on a real store, polled by hand on the
test's clock: a late host is waited out, a silent rank still named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from megatron.resihp.heartbeat import HeartbeatMonitor
from scripts.child_env import job_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_local.py"
WORLD = 4
# Busy loops beside the job, half of them at a higher priority than its ranks: the job's
# processes (ranks and beacons) then get a small share of the CPU in bursts.
HOGS = [0] * 4 + [-10] * 4
LOAD_S = 8.0

# Each rank forks its beacon, joins a gloo world and "trains": a little CPU work and an
# all-reduce per step, beat() after each, for LOAD_S seconds (the ranks agree on the last step).
# In "kill" mode there are no collectives (a dead peer would break them), and each rank stops
# once it has named a rank dead, or after LOAD_S.
WORKER = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from megatron.resihp import heartbeat_beacon
from megatron.resihp.heartbeat import HeartbeatMonitor
out, mode, load_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
beacon = heartbeat_beacon.start_beacon(0.2, stopped_after_s=1.5)
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
seen = {"dead": [], "hung": []}
record = lambda kind: lambda ranks, now: seen[kind].append({"ranks": sorted(ranks), "at": now})
mon = HeartbeatMonitor.from_env(on_dead=record("dead"), on_hang=record("hung"), hang_timeout_s=4.0,
                                failure_grace_s=2.0, beacon=beacon).start()
with open(os.path.join(out, f"ready{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
a, flag, step, end = torch.randn(64, 64), torch.zeros(1), 0, time.time() + load_s
while True:
    for _ in range(10):
        a = torch.tanh(a @ a)
    step += 1
    mon.beat(step)
    if mode == "kill":
        if seen["dead"] or time.time() > end:
            break
        continue
    flag.fill_(float(time.time() > end))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
time.sleep(0.5)  # a late report would show up now
mon.stop()
with open(os.path.join(out, f"result{rank}.json"), "w") as f:
    json.dump({**seen, "steps": step}, f)
'''


def _run_loaded(tmp_path: Path, mode: str, kill: int | None = None):
    """Run the worker in ``mode`` beside the busy processes; SIGKILL rank ``kill`` 3 s into the
    load. Returns (exit code, output, per-rank results, kill time)."""
    (tmp_path / "worker.py").write_text(WORKER)
    proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", str(WORLD), "worker.py",
                             str(tmp_path), mode, str(LOAD_S)], cwd=tmp_path, env=job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hogs, killed_at = [], None
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready*.json"))) < WORLD:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "ranks did not start their monitors"
            time.sleep(0.05)
        hogs = [subprocess.Popen(["nice", "-n", str(n), sys.executable, "-c", "while True: pass"]) for n in HOGS]
        loaded_at = time.monotonic()
        if kill is not None:
            time.sleep(3.0)
            pid = json.loads((tmp_path / f"ready{kill}.json").read_text())["pid"]
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
        # The ranks train under load until LOAD_S after they were ready; the load then goes, so
        # that the job's exit does not crawl.
        time.sleep(max(0.0, loaded_at + LOAD_S - time.monotonic()))
        for hog in hogs:
            hog.kill()
        output = proc.communicate(timeout=120)[0]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        proc.kill()
    results = {int(p.stem[6:]): json.loads(p.read_text()) for p in tmp_path.glob("result*.json")}
    return proc.returncode, output, results, killed_at


def test_loaded_host_names_no_live_rank_dead_or_hung(tmp_path):
    code, output, res, _ = _run_loaded(tmp_path, "train")
    assert code == 0, output
    assert sorted(res) == list(range(WORLD)), output
    for rank, r in res.items():
        assert r["dead"] == [] and r["hung"] == [], (rank, r, output)
        assert r["steps"] > 0, (rank, r)


def test_rank_killed_on_a_loaded_host_is_still_named_dead(tmp_path):
    code, output, res, killed_at = _run_loaded(tmp_path, "kill", kill=2)
    assert sorted(res) == [r for r in range(WORLD) if r != 2], output
    for rank, r in res.items():
        assert [e["ranks"] for e in r["dead"]] == [[2]], (rank, r, output)
        # Its beacon marks it dead as it dies; a generous bound for a host this loaded.
        assert 0 < r["dead"][0]["at"] - killed_at < 10.0, (rank, r["dead"], killed_at)
        assert r["hung"] == [], (rank, r)
    assert "[2]: process exited" in output, output


def test_monitor_waits_out_a_late_host_and_still_names_a_silent_rank():
    """A HeartbeatMonitor on a real store, its polls driven by hand on a clock of the test's."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    now = [100.0]
    named = []
    mon = HeartbeatMonitor(store, 0, 3, clock=lambda: now[0],
                           on_dead=lambda ranks, at: named.append((sorted(ranks), at)))
    mon._started_at = now[0]

    def beat(t, ranks):
        for r in ranks:
            store.set(f"{mon.prefix}{r}", f"{t:.6f}:1")

    def poll_at(t):
        now[0] = t
        mon._poll()

    for i in range(6):  # one second on time
        beat(100.0 + 0.2 * i, (0, 1, 2))
        poll_at(100.0 + 0.2 * i)
    # The host stalls: rank 0's and rank 1's beacons get to run 2.3 s late, rank 2's not yet. Its
    # beat is 2.5 s old, past the 1.5 s timeout (the rule before named it dead here), but within
    # what the host has shown it delays.
    beat(103.5, (0, 1))
    poll_at(103.5)
    assert named == []
    beat(103.7, (0, 1, 2))
    poll_at(103.7)
    # Then rank 2 goes silent for good while the others beat on time. The host showed itself up to
    # 2.5 s late (rank 2's own late beat), so rank 2 is named once its beat is older than
    # 1.5 + 2.5 s: at the first poll after 107.7.
    t = 103.7
    while t < 107.7:
        t = round(t + 0.2, 6)
        beat(t, (0, 1))
        poll_at(t)
    assert named == []
    t = round(t + 0.2, 6)
    beat(t, (0, 1))
    poll_at(t)
    assert named == [([2], pytest.approx(107.9))]
