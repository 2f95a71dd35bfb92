"""HeartbeatMonitor over real processes under scripts/launch_local.py: a SIGKILLed rank is named
dead by every survivor within 2 s (within one poll with a beacon); a rank that stops making
progress is named hung; a rank whose training thread holds the GIL is not called dead when its
beacon publishes, and a rank stuck that way is fenced by its beacon once evicted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.resihp.hang_rules import judge_progress
from scripts.child_env import job_env

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "scripts" / "launch_local.py"
WORLD = 4

# Each rank joins a gloo world (so heartbeats share the store with a live process group), starts
# a monitor on its own store client, "trains" by calling beat() every 50 ms, and records what its
# callbacks saw. In "hang" mode rank 1 stops calling beat() after a while but stays alive; in
# "gil" and "fence" modes it holds the GIL in C (libc usleep/pause called through ctypes.PyDLL,
# which keeps the GIL), for 2.5 s or for good, as a long C call in a training thread does.
WORKER = r'''
import ctypes, json, os, sys, time
import torch, torch.distributed as dist
from megatron.resihp import heartbeat_beacon
from megatron.resihp.heartbeat import HeartbeatMonitor
out, mode, use_beacon = sys.argv[1], sys.argv[2], sys.argv[3] == "beacon"
beacon = heartbeat_beacon.start_beacon(0.2) if use_beacon else None
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
seen = {"dead": [], "hung": [], "evicted": []}
record = lambda kind: lambda ranks, now: seen[kind].append({"ranks": sorted(ranks), "at": now})
mon = HeartbeatMonitor.from_env(on_dead=record("dead"), on_hang=record("hung"),
                                hang_timeout_s=4.0 if mode == "gil" else 2.0, failure_grace_s=2.0, beacon=beacon,
                                on_evicted=lambda: seen["evicted"].append(time.time())).start()
with open(os.path.join(out, f"ready{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
step, stopped_at, deadline = 0, None, time.time() + 20
def done():
    if mode == "stall":  # watch for a while after the death: no one may be named hung
        return bool(seen["hung"]) or (seen["dead"] and time.time() > seen["dead"][0]["at"] + 6.0)
    if mode == "evict" and rank == 1:
        return bool(seen["evicted"])
    if mode == "gil":  # watch until well after rank 1 held the GIL
        return stopped_at is not None and time.time() > stopped_at + 5.0
    if mode == "fence" and rank != 1:
        return bool(seen["hung"]) and time.time() > seen["hung"][0]["at"] + 2.0
    return bool(seen["dead"] or seen["hung"])
while time.time() < deadline and not done():
    if mode in ("gil", "fence") and step == 30:
        stopped_at = time.time()
        step += 1
        if rank == 1:
            libc = ctypes.PyDLL(None)
            libc.usleep(2_500_000) if mode == "gil" else libc.pause()
    elif mode in ("hang", "evict") and rank == 1 and step >= 30:
        stopped_at = stopped_at or time.time()
        if mode == "hang" and time.time() > stopped_at + 4.0:  # the others have judged it by now
            break
    elif mode == "stall" and mon.dead_ranks:
        # Rank 1 sits in a collective with the dead rank for 3 s (longer than the hang timeout)
        # before its recovery starts; the others get there at once.
        stopped_at = stopped_at or time.time()
        if rank != 1 or time.time() > stopped_at + 3.0:
            mon.mark_recovering()
    else:
        step += 1
        mon.beat(step)
    time.sleep(0.05)
if mode in ("evict", "fence") and rank == 0 and seen["hung"]:
    mon.evict(seen["hung"][0]["ranks"])
time.sleep(0.5)  # let a late second report show up if the monitor would make one
mon.stop()
with open(os.path.join(out, f"result{rank}.json"), "w") as f:
    json.dump({**seen, "stopped_at": stopped_at, "dead_ranks": sorted(mon.dead_ranks),
               "hung_ranks": sorted(mon.hung_ranks)}, f)
'''


def start(tmp_path: Path, mode: str, beacon: bool = False) -> subprocess.Popen:
    (tmp_path / "worker.py").write_text(WORKER)
    env = job_env()
    return subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc-per-node", str(WORLD), "worker.py",
                             str(tmp_path), mode, "beacon" if beacon else "thread"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(proc: subprocess.Popen, tmp_path: Path) -> dict[int, int]:
    deadline = time.monotonic() + 40
    while len(list(tmp_path.glob("ready*.json"))) < WORLD:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "ranks did not start their monitors"
        time.sleep(0.05)
    time.sleep(0.05)  # the last file may be mid-write
    return {r: json.loads((tmp_path / f"ready{r}.json").read_text())["pid"] for r in range(WORLD)}


def results(proc: subprocess.Popen, tmp_path: Path) -> tuple[int, str, dict[int, dict]]:
    output = proc.communicate(timeout=40)[0]
    return proc.returncode, output, {int(p.stem[6:]): json.loads(p.read_text()) for p in tmp_path.glob("result*.json")}


def run_worker(tmp_path: Path, mode: str, kill: int | None = None,
               beacon: bool = False) -> tuple[int, str, dict[int, dict], float | None]:
    """Run the worker in ``mode``; SIGKILL rank ``kill`` once heartbeats flow. Returns
    (exit code, output, per-rank results, kill time)."""
    proc = start(tmp_path, mode, beacon)
    killed_at = None
    try:
        pids = wait_ready(proc, tmp_path)
        if kill is not None:
            time.sleep(1.0)  # heartbeats flowing, no one judged yet
            killed_at = time.time()
            os.kill(pids[kill], signal.SIGKILL)
        code, output, res = results(proc, tmp_path)
    finally:
        proc.kill()
    return code, output, res, killed_at


@pytest.mark.parametrize("beacon", [False, True], ids=["thread", "beacon"])
def test_sigkilled_rank_is_named_dead_by_every_survivor_within_2s(tmp_path, beacon):
    code, output, res, killed_at = run_worker(tmp_path, "kill", kill=2, beacon=beacon)
    assert sorted(res) == [0, 1, 3], output
    latencies = []
    for rank, r in res.items():
        assert [e["ranks"] for e in r["dead"]] == [[2]], (rank, r)  # once, naming rank 2 only
        assert r["hung"] == [] and r["hung_ranks"] == [], (rank, r)
        latencies.append(r["dead"][0]["at"] - killed_at)
    print(f"detection latency per survivor: {[round(x, 3) for x in latencies]}")
    assert all(0 < x < 2.0 for x in latencies), latencies
    if beacon:
        # The beacon writes the dead mark as its rank dies: no need to wait out the 1.5 s timeout.
        assert all(x < 1.0 for x in latencies), latencies
        assert "[2]: process exited" in output, output
    assert "launch_local: rank 2 exited with signal SIGKILL; 3 ranks still running" in output
    assert code == 0, output


def test_rank_without_progress_is_named_hung(tmp_path):
    code, output, res, _ = run_worker(tmp_path, "hang")
    assert code == 0, output
    assert sorted(res) == [0, 1, 2, 3], output
    stopped_at = res[1]["stopped_at"]
    assert stopped_at is not None
    for rank in (0, 2, 3):
        r = res[rank]
        assert [e["ranks"] for e in r["hung"]] == [[1]], (rank, r)
        assert r["dead"] == [], (rank, r)  # its heartbeat thread kept beating
        latency = r["hung"][0]["at"] - stopped_at
        print(f"rank {rank} named rank 1 hung {latency:.3f} s after its last beat()")
        # hang_timeout_s=2.0, plus one beat interval to publish and one poll to notice.
        assert 2.0 < latency < 3.0, (rank, latency)


def test_survivor_blocked_after_a_death_is_not_named_hung(tmp_path):
    code, output, res, _ = run_worker(tmp_path, "stall", kill=2)
    assert sorted(res) == [0, 1, 3], output
    for rank, r in res.items():
        assert [e["ranks"] for e in r["dead"]] == [[2]], (rank, r)
        # Rank 1 made no progress for 3 s (hang timeout 2 s) but only because the death held it.
        assert r["hung"] == [], (rank, r)


def test_evicted_rank_is_told(tmp_path):
    code, output, res, _ = run_worker(tmp_path, "evict")
    assert code == 0, output
    assert [e["ranks"] for e in res[0]["hung"]] == [[1]], res[0]
    assert len(res[1]["evicted"]) == 1, res[1]
    assert all(res[r]["evicted"] == [] for r in (0, 2, 3)), res


def test_judge_progress_names_only_ranks_left_behind():
    now = 100.0
    moving = {0: (50, 99.9), 1: (50, 99.8), 2: (41, 90.0)}
    assert judge_progress(now, moving, 5.0) == frozenset({2})
    # Everyone stalled at the same point (eval, checkpoint, a blocked collective): nobody named.
    assert judge_progress(now, {0: (50, 90.0), 1: (50, 91.0)}, 5.0) == frozenset()
    # Everyone stalled, one behind: the laggard is what the others wait for.
    assert judge_progress(now, {0: (50, 90.0), 1: (49, 91.0)}, 5.0) == frozenset({1})
    assert judge_progress(now, {0: (50, 96.0), 1: (49, 96.0)}, 5.0) == frozenset()


def test_judge_progress_counts_recovering_ranks_as_ahead():
    now = 100.0
    # Everyone stalled at 50, but ranks 0 and 1 reached their recovery code: rank 2 is left.
    stalled = {0: (50, 80.0), 1: (50, 80.0), 2: (50, 80.0)}
    assert judge_progress(now, stalled, 5.0, recovering=frozenset({0, 1})) == frozenset({2})
    # A recovering rank is never named, however long it has been still.
    assert judge_progress(now, stalled, 5.0, recovering=frozenset({0, 1, 2})) == frozenset()


def test_judge_progress_waits_out_collectives_blocked_on_a_dead_rank():
    # A rank died at t=100; survivors block in collectives until they time out (grace 5 s).
    progress = {0: (4, 99.0), 1: (4, 99.0), 2: (4, 99.5)}
    recovering = frozenset({0})
    assert judge_progress(104.0, progress, 3.0, recovering, failure_seen_at=100.0, failure_grace_s=5.0) == frozenset()
    assert judge_progress(107.9, progress, 3.0, recovering, failure_seen_at=100.0, failure_grace_s=5.0) == frozenset()
    # The grace is bounded: still stalled 3 s after it ran out is a hang.
    assert judge_progress(108.1, progress, 3.0, recovering, failure_seen_at=100.0,
                          failure_grace_s=5.0) == frozenset({1, 2})
    # Without the grace, the same survivors would have been named while still blocked.
    assert judge_progress(104.0, progress, 3.0, recovering) == frozenset({1, 2})


def test_judge_progress_never_names_a_compiling_rank_nor_those_waiting_on_it():
    now = 100.0
    # Rank 2 has compiled since its last progress at t=80; rank 0 reached its recovery.
    progress = {0: (50, 80.0), 1: (50, 80.0), 2: (50, 80.0)}
    assert judge_progress(now, progress, 5.0, recovering=frozenset({0}), compiling=frozenset({2})) == frozenset({1})
    # Rank 1 waits on the compiling rank with nobody recovering: a compile is no move to be left behind by.
    assert judge_progress(now, progress, 5.0, compiling=frozenset({2})) == frozenset()
    # A compiling rank ahead still names one stalled behind it.
    assert judge_progress(now, {**progress, 2: (51, 80.0)}, 5.0, compiling=frozenset({2})) == frozenset({0, 1})
    # Without the compile, rank 2 is named with rank 1.
    assert judge_progress(now, progress, 5.0, recovering=frozenset({0})) == frozenset({1, 2})


@pytest.mark.parametrize("beacon", [False, True], ids=["thread", "beacon"])
def test_rank_holding_the_gil_is_not_called_dead_when_its_beacon_publishes(tmp_path, beacon):
    code, output, res, _ = run_worker(tmp_path, "gil", beacon=beacon)
    assert code == 0, output
    assert sorted(res) == [0, 1, 2, 3], output
    named = {rank: [e["ranks"] for e in r["dead"]] for rank, r in res.items() if rank != 1}
    if beacon:
        assert named == {0: [], 2: [], 3: []}, output
        assert all(res[r]["hung"] == [] for r in res), res  # 2.5 s stall, hang timeout 4 s
    else:
        # The control: a heartbeat thread cannot beat while the training thread holds the GIL.
        assert named == {0: [[1]], 2: [[1]], 3: [[1]]}, output


def test_rank_stuck_holding_the_gil_is_named_hung_and_fenced_by_its_beacon(tmp_path):
    code, output, res, _ = run_worker(tmp_path, "fence", beacon=True)
    assert sorted(res) == [0, 2, 3], output  # rank 1 never got to write a result
    for rank in (0, 2, 3):
        hung = res[rank]["hung"]
        assert [e["ranks"] for e in hung] == [[1]], (rank, res[rank])
        # Named dead, if at all, only once the beacon has fenced it: never while it was stuck.
        assert all(e["at"] > hung[0]["at"] for e in res[rank]["dead"]), (rank, res[rank])
    assert "beacon fences pid" in output, output
    assert "launch_local: rank 1 exited with signal SIGKILL" in output, output
    assert code == 0, output
