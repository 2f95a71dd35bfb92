"""Layer moves on Megatron-LM's loop: throughput when one stage is slow in every replica.

Measured in one invocation on the TP2 x PP2 x DP2 CPU job of ``adaptation.py`` (8 gloo processes,
fixed-length mock samples, one emulated device per rank with ``--cpu-device-time-scale``): the first
TP rank of ``--stage`` in every replica slowed ``--factor`` x from ``--slow-at`` (a stage of one
device type, or behind one slow switch, in every replica), and
throughput (samples/s = global batch / median iteration ``elapsed_s`` after the last re-plan) of

* a healthy run and the slowed run without adaptation (``--resihp-detect-only``);
* adapted with the stages kept: ``--ckpt-format torch --save`` (a save in that format numbers each
  stage's layers from 0, so the loop re-plans the micro-batch split only); moving micro-batches
  between replicas cannot help when every replica is slowed alike;
* adapted with layers free to move (no ``--save``): one split for every replica.

``--interleaved`` runs all four under Megatron-LM's interleaved schedule (two model chunks of one
layer per stage), where a moved layer crosses the border of two chunks.

Reported: each run's throughput as a fraction of healthy, and layers moved / split only and
layers moved / unadapted, all from this invocation. Each run is measured in steady state: from
the iteration after its last re-plan (the unadapted one from the slowdown's onset).

    python scripts/bench/layer_moves.py [--json] [--iters 40] [--factor 3] [--stage 0] [--slow-at 10]
        [--device-time-scale 16] [--interleaved] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench.adaptation import NPROC, PP, TP, _throughput_run  # noqa: E402


def stage_ranks(stage: int) -> list[int]:
    """The first TP rank of ``stage`` in every replica (Megatron's default order: TP, then DP, then PP)."""
    per_stage = NPROC // PP
    return list(range(stage * per_stage, (stage + 1) * per_stage, TP))


def measure(args, work: Path) -> dict:
    slowed = [arg for rank in stage_ranks(args.stage)
              for arg in ("--resihp-inject", f"slow:rank={rank},factor={args.factor},at={args.slow_at}")]
    keep_stages = ["--ckpt-format", "torch", "--save", str(work / "split_only_ckpt"), "--save-interval", "100000"]
    out = {"healthy": _throughput_run(args, work, "healthy", ["--resihp-detect-only"], onset=2),
           "unadapted": _throughput_run(args, work, "unadapted", ["--resihp-detect-only", *slowed], args.slow_at)}
    out["split_only"] = _throughput_run(args, work, "split_only", ["--resihp-enable", *keep_stages, *slowed],
                                        args.slow_at)
    out["layers_moved"] = _throughput_run(args, work, "layers_moved", ["--resihp-enable", *slowed], args.slow_at)
    healthy = out["healthy"]["samples_per_s"]
    for name in ("unadapted", "split_only", "layers_moved"):
        out[name]["fraction_of_healthy"] = round(out[name]["samples_per_s"] / healthy, 4)
    out["layers_moved_over_split_only"] = round(out["layers_moved"]["samples_per_s"] / out["split_only"]["samples_per_s"], 4)
    out["layers_moved_over_unadapted"] = round(out["layers_moved"]["samples_per_s"] / out["unadapted"]["samples_per_s"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=40, help="iterations per run")
    parser.add_argument("--factor", type=float, default=3.0, help="slowdown of the slowed ranks")
    parser.add_argument("--stage", type=int, default=0, help="the pipeline stage slowed in every replica")
    parser.add_argument("--slow-at", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=32, help="global batch (8 micro-batches per replica)")
    parser.add_argument("--device-time-scale", type=float, default=16.0,
                        help="--cpu-device-time-scale (one emulated device per rank; 0: the shared cores as they are)")
    parser.add_argument("--interleaved", action="store_true",
                        help="Megatron-LM's interleaved schedule, two model chunks per stage "
                             "(--num-layers-per-virtual-pipeline-stage 1)")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    args = parser.parse_args()
    if not 0 <= args.stage < PP:
        parser.error(f"--stage takes 0-{PP - 1}; got {args.stage}")
    if args.slow_at + 12 > args.iters:
        parser.error(f"--iters must leave at least 12 iterations after --slow-at ({args.slow_at}); got {args.iters}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="layer_moves_"))
    work.mkdir(parents=True, exist_ok=True)
    out = {"shape": f"TP{TP} x PP{PP} x DP{NPROC // (TP * PP)} ({NPROC} processes, CPU), Megatron-LM's loop"
                    + (", interleaved schedule, 2 chunks per stage" if args.interleaved else ""),
           "slowed_ranks": stage_ranks(args.stage), "factor": args.factor, "cpu_count": os.cpu_count(),
           "cpu_device_time_scale": args.device_time_scale, "loadavg_start": os.getloadavg(), "workdir": str(work)}
    out.update(measure(args, work))
    out["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['shape']}, {out['cpu_count']} CPUs, --cpu-device-time-scale {args.device_time_scale:g}; ranks "
          f"{out['slowed_ranks']} (stage {args.stage} of every replica) slowed {args.factor:g}x at iteration "
          f"{args.slow_at}")
    for name in ("healthy", "unadapted", "split_only", "layers_moved"):
        run = out[name]
        share = f"  {run['fraction_of_healthy']:.3f} of healthy" if "fraction_of_healthy" in run else ""
        print(f"  {name:<13} {run['samples_per_s']:>8} samples/s (median {run['median_iteration_s']} s/it from it. "
              f"{run['from_iteration']}, n={run['measured_iterations']}){share}  adapted {run['adapted']}")
    print(f"  layers moved / split only = {out['layers_moved_over_split_only']}, "
          f"layers moved / unadapted = {out['layers_moved_over_unadapted']}")
    print(f"load average at start {out['loadavg_start']}, at end {out['loadavg_end']}")


if __name__ == "__main__":
    main()
