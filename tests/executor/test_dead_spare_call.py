"""A recovery that calls a spare the spare's heartbeat beacon marked dead (SIGKILL) or stopped
(SIGSTOP) plans without it at once, instead of waiting out the call (up to twice the heartbeat
timeout), and such a standby's last report no longer makes it ready; a report counts only once the
standby is back from its latest call. Real processes, real signals, a real job store, the production
``call_spares`` and ``report_counts``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from megatron.resihp.standby import Readmission
from megatron.resihp.standby_keys import marked_gone, record_call, report_counts
from scripts.child_env import job_env

# A standby as ``stand_by`` sets it up: a beacon forked first, then pointed at its standby key. It
# answers no call (the live case is the dist tests'), so only its beacon can speak for it.
STANDBY = r'''
import sys, time
from megatron.resihp import heartbeat_beacon
from megatron.resihp.standby_keys import beat_as_standby
heartbeat_beacon.start_beacon(0.05, stopped_after_s=0.3)
beat_as_standby(int(sys.argv[1]))
print("ready", flush=True)
time.sleep(120)
'''

LAUNCH_RANK = 3
FRESH_REPORT = {"factor": 1.0, "seq": 9, "back_from": 0}
HEARTBEAT_TIMEOUT_S = 30.0  # the call would wait 60 s for an answer


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server


def _standby(store) -> subprocess.Popen:
    env = job_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)})
    proc = subprocess.Popen([sys.executable, "-c", STANDBY, str(LAUNCH_RANK)], env=env, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while not store.check([f"resihp/standby/beat/{LAUNCH_RANK}"]):  # its beacon's first beat
        assert time.monotonic() < deadline, "the standby's beacon never published"
        time.sleep(0.02)
    return proc


def _call(store) -> tuple[list[int], float]:
    host = SimpleNamespace(store=store, cfg=SimpleNamespace(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))
    started = time.monotonic()
    answered = Readmission(host).call_spares(1, [LAUNCH_RANK])
    return answered, time.monotonic() - started


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_spare_its_beacon_marked_gone_is_planned_without_at_once(store, sig):
    proc = _standby(store)
    try:
        assert not marked_gone(store, LAUNCH_RANK)  # alive and running: a call waits for its answer
        assert report_counts(store, LAUNCH_RANK, FRESH_REPORT)
        os.kill(proc.pid, sig)
        deadline = time.monotonic() + 10
        while not marked_gone(store, LAUNCH_RANK):
            assert time.monotonic() < deadline, "the beacon never marked the standby"
            time.sleep(0.02)
        assert not report_counts(store, LAUNCH_RANK, FRESH_REPORT)  # its last report makes it ready no more
        answered, took_s = _call(store)
        assert answered == []
        assert took_s < HEARTBEAT_TIMEOUT_S / 4, took_s  # not the 60 s wait for an answer
        assert not store.check([f"resihp/standby/call/{LAUNCH_RANK}"])  # the call is withdrawn
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        _wait_beacon_done(store)


def _wait_beacon_done(store) -> None:
    """The beacon's last act is its dead mark: after it, no process holds the store."""
    deadline = time.monotonic() + 5
    while not store.get(f"resihp/standby/beat/{LAUNCH_RANK}").endswith(b":dead") and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_report_counts_only_once_the_standby_is_back_from_its_latest_call(store):
    # The race a joiner killed in its rendezvous met: a report written between the check that planned
    # the call and the call itself is newer than the one the plan read, yet older than the call.
    assert report_counts(store, LAUNCH_RANK, {"factor": 1.0, "seq": 1})  # never called: any report
    record_call(store, LAUNCH_RANK, 5)
    assert not report_counts(store, LAUNCH_RANK, {"factor": 1.0, "seq": 2, "back_from": 0})
    assert not report_counts(store, LAUNCH_RANK, {"factor": 1.0, "seq": 3, "back_from": 4})
    assert report_counts(store, LAUNCH_RANK, {"factor": 1.0, "seq": 1, "back_from": 5})  # back, reporting afresh
    record_call(store, LAUNCH_RANK, 8)  # called again: its reports from before wait for the answer
    assert not report_counts(store, LAUNCH_RANK, {"factor": 1.0, "seq": 4, "back_from": 5})
