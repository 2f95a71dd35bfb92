"""Runs a job and sends a signal from outside to one rank's process once training got far enough.

Responsible for: what a fault test or bench does to strike a running job the way an operator or
the kernel would: launch, watch the job's event log until an ``iteration`` event reaches the
chosen iteration, find the rank's pid in its ``start`` event, wait a further delay, signal it, and
collect the job's end; and reading that event log. Used by ``tests/dist`` and ``scripts/bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from scripts.child_env import REPO, job_env


def events(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a job's ``--resihp-event-log`` (of one ``kind`` if given); none before it exists."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["event"] == kind]


def run_and_signal(cmd: list[str], log: Path, rank: int, sig: int, after_iteration: int, delay_s: float = 0.0,
                   timeout_s: float = 600) -> tuple[int, str, float | None]:
    """Run ``cmd`` (a launch that writes ``--resihp-event-log log``) and send ``sig`` to ``rank``'s
    process ``delay_s`` after iteration ``after_iteration`` is logged.

    Returns:
        (exit code, combined output, wall-clock time of the signal; None if the job ended first).
    """
    # The job's output goes to a file, not a pipe: a pipe nobody reads while this waits fills up
    # (Megatron-LM's loop prints every argument of every rank) and stalls the job.
    with tempfile.TemporaryFile("w+") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=sink, stderr=subprocess.STDOUT, text=True)
        sent_at = None
        try:
            deadline = time.monotonic() + timeout_s
            while not any(e["iteration"] >= after_iteration for e in events(log, "iteration")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            else:
                time.sleep(delay_s)
                pid = next(e["pid"] for e in events(log, "start") if e["rank"] == rank)
                sent_at = time.time()
                os.kill(pid, sig)
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sink.seek(0)
        output = sink.read()
    return proc.returncode, output, sent_at
