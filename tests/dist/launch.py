"""Runs pretrain_gpt_resilient.py as a real multi-process job (gloo) for tests.

Jobs start through ``scripts/launch_local.py`` unless a test names ``launcher="torchrun"``: its
ranks fork from a server that has imported torch, megatron-core and Megatron's training package
once, which saves each 8-rank job about 17 s of start-up on a 2-core host. Tests of the launch users run as with Megatron name
torchrun.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from scripts.child_env import job_env

REPO = Path(__file__).resolve().parents[2]

# How far apart this host's cores ran one fixed GEMM, seconds apart, with nothing else running
# (fastest of 5 in one process: 2.46 and 4.24 ms; docs/notes/benchmarks.md section 33). A one-rank job
# compares its probe with its own baseline taken seconds before, so its factors carry this.
CORE_SPEED_SPREAD = 4.24 / 2.46

# A tiny GPT on Megatron-LM's flags (no evaluation, torch-format checkpoints when --save is given).
TINY_GPT = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
    "--global-batch-size", "16", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "512", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
    "--split", "99,1,0", "--save-interval", "1000", "--ckpt-format", "torch",
]


def tiny_gpt_on(device: str) -> list[str]:
    """``TINY_GPT`` on ``device``; on CUDA without apex, with no gradient accumulation fusion (its kernel is apex's)."""
    args = [a if a != "cpu" else device for a in TINY_GPT]
    if device == "cuda":
        from megatron.resihp.gpt_pretrain import has_apex_wgrad_fusion

        if not has_apex_wgrad_fusion():
            args.append("--no-gradient-accumulation-fusion")
    return args


def run_job(nproc: int, args: list[str], timeout_s: float = 300, launcher: str = "local",
            env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = job_env(env_extra)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    else:
        cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={nproc}"]
    cmd += [str(REPO / "pretrain_gpt_resilient.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def read_events(path: Path, event: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if event is None or r["event"] == event]


def _what(transfer: dict) -> tuple:
    return tuple(transfer["item"]), transfer["unit"], transfer["grid"], transfer["src"], transfer["dst"], \
        transfer["replicated"]


def moves_against_plans(path: Path) -> list[tuple[int, list, list]]:
    """For each change that moved state: (iteration, the moves its plan priced, the transfers its
    ranks reported sending), both sorted. A fail-slow or readmission plan lists its ``moves``; a
    fail-stop plan its ``executed`` transfers; a forced layout the transfers it handed over. The
    last plan of an iteration is the one that ran."""
    sent: dict[int, list] = defaultdict(list)
    for event in read_events(path, "moved"):
        sent[event["iteration"]] += [_what(t) for t in event["sent"]]
    priced: dict[int, list] = {}
    for event in read_events(path):
        if event["event"] == "forced_layout" or (event["event"] == "plan" and event.get("action") == "adapt"):
            moves = event["moves"] if "moves" in event else event.get("executed", {}).get("transfers", [])
            priced[event["iteration"]] = [_what(t) for t in moves if t["src"] != t["dst"]]
    return [(it, sorted(priced.get(it, [])), sorted(sent.get(it, []))) for it in sorted(set(priced) | set(sent))
            if priced.get(it) or sent.get(it)]


def assert_moved_as_planned(path: Path, at_least: int = 1) -> None:
    """At least ``at_least`` changes moved state, and each moved exactly what its plan priced."""
    pairs = moves_against_plans(path)
    assert len(pairs) >= at_least, f"{len(pairs)} changes moved state: {pairs}"
    for iteration, planned, moved in pairs:
        assert moved == planned, f"iteration {iteration}: planned {planned}\nmoved {moved}"


def running_quotas(path: Path) -> list[int] | None:
    """The micro-batch quotas the job last ran with after a change: the last re-plan's, or the
    quotas a rollback went back to (None: never changed)."""
    changes = read_events(path, "adapted") + read_events(path, "rolled_back")
    return max(changes, key=lambda e: (e["iteration"], e["time"]))["quotas"] if changes else None


def decisions(path: Path) -> str:
    """What a job judged and did (faults, suspicions, probes' outcomes, plans), one line each, for
    failure messages."""
    keep = ("iteration", "kind", "ranks", "factor", "reason", "quotas", "slow_rank_factors", "fault")
    return "\n" + "\n".join(
        f"{r['event']}: " + json.dumps({k: r[k] for k in keep if k in r})
        for r in read_events(path) if r["event"] not in ("iteration", "start", "finish", "detector_overhead"))


def iteration_losses(path: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_events(path, "iteration")}


def assert_same_losses(log: Path, reference: dict[int, float], iterations: int, rel: float = 1e-5) -> None:
    """The job logged a loss for each of iterations 1..``iterations`` (no more), each equal to the
    reference's within ``rel``."""
    ours = iteration_losses(log)
    assert sorted(ours) == list(range(1, iterations + 1)), f"iterations logged: {sorted(ours)}"
    expected = [reference[i] for i in range(1, iterations + 1)]
    got = [ours[i] for i in range(1, iterations + 1)]
    assert got == pytest.approx(expected, rel=rel), f"losses {got}\nreference {expected}"


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def main_copies(shards: dict) -> dict:
    """Per checkpoint shard (``{name: torch.load(...)}``), the bf16/fp16 optimizer's fp32 main
    copies and Adam moments, flattened in optimizer order."""
    import torch

    out = {}
    for shard, state in shards.items():
        optimizer = state["optimizer"]
        mains = [t for group in optimizer["fp32_from_fp16_params"] for t in group]
        moments = [s[k] for _, s in sorted(optimizer["optimizer"]["state"].items()) for k in ("exp_avg", "exp_avg_sq")]
        assert mains and all(t.dtype == torch.float32 for t in mains + moments), shard
        out[shard] = torch.cat([t.reshape(-1) for t in mains + moments])
    return out


def assert_all_end(pids, what: str, timeout_s: float = 10) -> None:
    """Every process in ``pids`` ends (or is left a zombie) within ``timeout_s``; else fail naming
    those that outlived ``what``."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"ranks {[p for p in pids if _alive(p)]} outlived {what}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
