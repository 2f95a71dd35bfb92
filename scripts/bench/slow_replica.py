"""A very slow replica dropped and taken back, against running on with it, on Megatron-LM's loop.

A PP2 x DP2 job (4 gloo processes) whose launch rank 3 (replica 1, stage 1) runs ``--factor`` times
slow from ``--slow-at`` to ``--slow-until``. Measured in one invocation, from the ``elapsed_s`` of
every iteration (the job's event log):

* adapted: ``--resihp-enable``, the job as it runs: the detector names the rank, the re-plan drops
  replica 1 (its ranks stand by and probe their devices), and once they report healthy the world
  grows back;
* not adapted: the same slowdown under ``--resihp-detect-only`` (named, nothing changed);
* healthy: no slowdown, for scale.

``--interleaved`` runs all three under the interleaved schedule (two model chunks per stage).

Reported: the median iteration while slowed, from the iteration after the adapted run's re-plan to
``--slow-until``, in both runs (the same iterations); the median after the readmission, against the
not-adapted run (the same four ranks, the same history) and the healthy one over those iterations;
and the whole job's training seconds (the sum of its iterations) adapted / not adapted.

    python scripts/bench/slow_replica.py [--json] [--iters 40] [--factor 16] [--slow-at 5]
        [--slow-until 22] [--interleaved] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.adaptation import MODEL  # noqa: E402
from scripts.child_env import job_env  # noqa: E402
from scripts.signal_rank import events  # noqa: E402

SLOWED = 3
GLOBAL_BATCH = 16  # 8 micro-batches of 2


def _run(args, work: Path, name: str, extra: list[str]) -> tuple[dict[int, float], Path]:
    """Seconds of every iteration of one job, and its event log."""
    log = work / f"{name}.events.jsonl"
    log.unlink(missing_ok=True)
    flags = [*MODEL, "--tensor-model-parallel-size", "1", "--global-batch-size", str(GLOBAL_BATCH),
             "--train-iters", str(args.iters), "--resihp-event-log", str(log), *extra,
             *(["--num-layers-per-virtual-pipeline-stage", "1"] if args.interleaved else [])]
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), "--nproc-per-node=4",
           str(REPO / "pretrain_gpt_resilient.py"), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{name}: job failed ({proc.returncode}): {' '.join(flags)}\n{proc.stderr[-3000:]}")
    seconds = {e["iteration"]: e["elapsed_s"] for e in events(log, "iteration")}
    if sorted(seconds) != list(range(1, args.iters + 1)):
        raise SystemExit(f"{name}: iterations logged {sorted(seconds)}, expected 1..{args.iters}")
    return seconds, log


def _median(seconds: dict[int, float], first: int, last: int) -> float | None:
    chosen = [s for i, s in seconds.items() if first <= i <= last]
    return round(statistics.median(chosen), 4) if chosen else None


def measure(args, work: Path) -> dict:
    slow = ["--resihp-inject", f"slow:rank={SLOWED},factor={args.factor:g},at={args.slow_at},until={args.slow_until}"]
    healthy, _ = _run(args, work, "healthy", ["--resihp-enable"])
    adapted, log = _run(args, work, "adapted", ["--resihp-enable", "--resihp-standby-probe-interval-s", "0.3", *slow])
    not_adapted, _ = _run(args, work, "not_adapted", ["--resihp-detect-only", *slow])
    changes = events(log, "adapted")
    dropped = next((a for a in changes if a["world_size"] == 2), None)
    grown = next((a for a in changes if a.get("joined_launch_ranks")), None)
    if dropped is None:
        raise SystemExit(f"adapted: no replica was dropped ({[p['reason'] for p in events(log, 'plan')]}); "
                         f"raise --factor")
    out = {"dropped_at": dropped["iteration"], "readmitted_at": grown["iteration"] if grown else None,
           "plans": [p["reason"] for p in events(log, "plan") if p.get("action") == "adapt"]}
    first, last = dropped["iteration"] + 1, args.slow_until
    out["slowed"] = {"iterations": [first, last], "adapted_s": _median(adapted, first, last),
                     "not_adapted_s": _median(not_adapted, first, last)}
    out["slowed"]["not_adapted_over_adapted"] = round(out["slowed"]["not_adapted_s"] / out["slowed"]["adapted_s"], 3)
    if grown is not None:
        after = grown["iteration"] + 2  # the iteration after the joiners' first
        back = {"iterations": [after, args.iters], "adapted_s": _median(adapted, after, args.iters),
                "not_adapted_s": _median(not_adapted, after, args.iters), "healthy_s": _median(healthy, after, args.iters)}
        back["adapted_over_not_adapted"] = round(back["adapted_s"] / back["not_adapted_s"], 3)
        back["adapted_over_healthy"] = round(back["adapted_s"] / back["healthy_s"], 3)
        out["after_readmission"] = back
    out["total_s"] = {name: round(sum(s.values()), 2) for name, s in
                      (("healthy", healthy), ("adapted", adapted), ("not_adapted", not_adapted))}
    out["total_s"]["adapted_over_not_adapted"] = round(out["total_s"]["adapted"] / out["total_s"]["not_adapted"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=40, help="iterations per run")
    parser.add_argument("--factor", type=float, default=16.0, help="how many times slower launch rank 3 runs")
    parser.add_argument("--slow-at", type=int, default=5, help="the first slowed iteration")
    parser.add_argument("--slow-until", type=int, default=22, help="the last slowed iteration")
    parser.add_argument("--interleaved", action="store_true",
                        help="the interleaved schedule (--num-layers-per-virtual-pipeline-stage 1: two chunks per stage)")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    args = parser.parse_args()
    if not 2 <= args.slow_at < args.slow_until <= args.iters - 10:
        parser.error(f"need 2 <= --slow-at < --slow-until <= --iters - 10 (time to detect, drop and take back); "
                     f"got {args.slow_at}, {args.slow_until}, {args.iters}")
    if args.factor <= 1:
        parser.error(f"--factor must be > 1; got {args.factor:g}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="slow_replica_"))
    work.mkdir(parents=True, exist_ok=True)
    schedule = "the interleaved schedule (2 chunks per stage)" if args.interleaved else "1F1B"
    out = {"shape": f"TP1 x PP2 x DP2 (4 processes, CPU), Megatron-LM's loop, {schedule}, global batch of 8 micro-batches",
           "cpu_count": os.cpu_count(), "factor": args.factor, "slowed": [args.slow_at, args.slow_until],
           "loadavg_start": os.getloadavg(), "workdir": str(work)}
    out.update(measure(args, work))
    out["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']}, {out['cpu_count']} CPUs; launch rank {SLOWED} {args.factor:g}x slow in iterations "
          f"{args.slow_at}..{args.slow_until}")
    print(f"  replica 1 dropped at iteration {out['dropped_at']}, taken back at {out['readmitted_at']}")
    slowed = out["slowed"]
    print(f"  slowed, iterations {slowed['iterations'][0]}..{slowed['iterations'][1]}: adapted {slowed['adapted_s']} "
          f"s/it, not adapted {slowed['not_adapted_s']} s/it; not adapted / adapted = "
          f"{slowed['not_adapted_over_adapted']}")
    if "after_readmission" in out:
        back = out["after_readmission"]
        print(f"  after the readmission, iterations {back['iterations'][0]}..{back['iterations'][1]}: adapted "
              f"{back['adapted_s']} s/it, not adapted {back['not_adapted_s']} s/it, healthy {back['healthy_s']} s/it; "
              f"adapted / not adapted = {back['adapted_over_not_adapted']}, adapted / healthy = "
              f"{back['adapted_over_healthy']}")
    total = out["total_s"]
    print(f"  training seconds: healthy {total['healthy']}, adapted {total['adapted']}, not adapted "
          f"{total['not_adapted']}; adapted / not adapted = {total['adapted_over_not_adapted']}")
    print(f"load average at start {out['loadavg_start']}, at end {out['loadavg_end']}")


if __name__ == "__main__":
    main()
