"""Every live replica kept after a failure, against Megatron's even split, on Megatron-LM's loop.

A TP1 x PP2 x DP4 job (8 gloo processes, one emulated device per rank with
``--cpu-device-time-scale``) whose global batch of 8 micro-batches does not split evenly over 3
replicas loses launch rank 7 (replica 3, stage 1) at ``--kill-at``. Measured in one invocation,
throughput (samples/s = global batch / median iteration ``elapsed_s``, from the second iteration
after the recovery):

* kept: the job as it runs, every live replica going on (3, with quotas such as 3, 3, 2);
* even split: what keeping to Megatron's even split leaves, 2 replicas of 4 micro-batches each (the
  broken replica's and a whole replica's ranks idle as spares), run as a TP1 x PP2 x DP2 job of the
  same model on the same emulated devices (4 processes); spares do no work, so this is the
  iteration the even split runs;
* healthy: the 8-process job without a failure, for scale.

Reported: kept / even split, and each as a fraction of healthy, all from this invocation.

    python scripts/bench/replica_counts.py [--json] [--iters 30] [--kill-at 6] [--device-time-scale 16]
        [--workdir DIR]
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

MICRO_BATCH = 2
GLOBAL_BATCH = 16  # 8 micro-batches: 2 per replica at DP 4; 3, 3, 2 on 3 replicas; 4 and 4 on 2
KILLED = 7


def _run(args, work: Path, name: str, nproc: int, extra: list[str], measure_from: int) -> dict:
    log = work / f"{name}.events.jsonl"
    log.unlink(missing_ok=True)
    flags = [*MODEL, "--tensor-model-parallel-size", "1", "--micro-batch-size", str(MICRO_BATCH),
             "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(args.iters),
             "--cpu-device-time-scale", str(args.device_time_scale), "--resihp-enable", "--resihp-event-log", str(log),
             *extra]
    # The project's launcher: torchrun's agent would stop the whole job at the first rank lost.
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={nproc}",
           str(REPO / "pretrain_gpt_resilient.py"), *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{name}: job failed ({proc.returncode}): {' '.join(flags)}\n{proc.stderr[-3000:]}")
    adapted = [a for a in events(log, "adapted") if "failed_ranks" in a]
    start = max([measure_from, *(a["iteration"] + 1 for a in adapted)])
    times = [e["elapsed_s"] for e in events(log, "iteration") if e["iteration"] > start]
    if len(times) < 5:
        raise SystemExit(f"{name}: {len(times)} iterations after {start}; raise --iters")
    median = statistics.median(times)
    return {"median_iteration_s": round(median, 4), "samples_per_s": round(GLOBAL_BATCH / median, 3),
            "from_iteration": start + 1, "measured_iterations": len(times),
            "adapted": [{k: a[k] for k in ("iteration", "data_parallel_size", "quotas", "failed_launch_ranks")}
                        for a in adapted]}


def measure(args, work: Path) -> dict:
    out = {"healthy": _run(args, work, "healthy", 8, [], measure_from=2)}
    out["kept"] = _run(args, work, "kept", 8, ["--resihp-inject", f"kill:rank={KILLED},at={args.kill_at}"],
                       measure_from=args.kill_at + 1)
    out["even_split"] = _run(args, work, "even_split", 4, [], measure_from=args.kill_at + 1)
    healthy = out["healthy"]["samples_per_s"]
    for name in ("kept", "even_split"):
        out[name]["fraction_of_healthy"] = round(out[name]["samples_per_s"] / healthy, 4)
    out["kept_over_even_split"] = round(out["kept"]["samples_per_s"] / out["even_split"]["samples_per_s"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=30, help="iterations per run")
    parser.add_argument("--kill-at", type=int, default=6, help="the iteration launch rank 7 is killed in")
    parser.add_argument("--device-time-scale", type=float, default=16.0,
                        help="--cpu-device-time-scale (one emulated device per rank)")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    args = parser.parse_args()
    if args.kill_at < 2 or args.kill_at + 8 > args.iters:
        parser.error(f"--kill-at must be >= 2 and leave 8 iterations before --iters ({args.iters}); got {args.kill_at}")
    if args.device_time_scale < 1:
        parser.error(f"--device-time-scale must be >= 1 (an emulated device per rank); got {args.device_time_scale:g}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="replica_counts_"))
    work.mkdir(parents=True, exist_ok=True)
    out = {"shape": "TP1 x PP2 x DP4 (8 processes, CPU), Megatron-LM's loop, global batch of 8 micro-batches",
           "cpu_count": os.cpu_count(), "cpu_device_time_scale": args.device_time_scale,
           "loadavg_start": os.getloadavg(), "workdir": str(work)}
    out.update(measure(args, work))
    out["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']}, {out['cpu_count']} CPUs, --cpu-device-time-scale {args.device_time_scale:g}; "
          f"launch rank {KILLED} killed at iteration {args.kill_at}")
    for name in ("healthy", "kept", "even_split"):
        run = out[name]
        share = f"  {run['fraction_of_healthy']:.3f} of healthy" if "fraction_of_healthy" in run else ""
        print(f"  {name:<10} {run['samples_per_s']:>8} samples/s (median {run['median_iteration_s']} s/it from it. "
              f"{run['from_iteration']}, n={run['measured_iterations']}){share}  adapted {run['adapted']}")
    print(f"  kept / even split = {out['kept_over_even_split']}")
    print(f"load average at start {out['loadavg_start']}, at end {out['loadavg_end']}")


if __name__ == "__main__":
    main()
