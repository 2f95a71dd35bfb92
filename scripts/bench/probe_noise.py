"""How far apart the live GEMM probe reads two healthy ranks, by how a round is taken: each rank's
fastest sample against ``pass_normalised_times``, and probes where the scheduler puts them against
probes on one core (``detection.on_probe_core``), all measured in this run.

    python scripts/bench/probe_noise.py [--ranks 4] [--rounds 150] [--json]

``--ranks`` CPU processes in one gloo group (more than the host's cores, as in CI), unpinned as
the launcher leaves them. Each round, ranks 1 and the last take turns, 5 passes of one sample
each, as a live probe round does (``LiveDetector._samples_in_passes``); the rounds alternate
between unpinned and one-core probes. Between rounds every rank computes for 0.2 s, as between
iterations. Reports, per way, the ratio of the two healthy ranks' readings: median, 5th and 95th
percentiles, and how many rounds read them ``probe_threshold`` (1.2) apart or more, which is
how many rounds would name a healthy rank slow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

THRESHOLD = 1.2
_GAP_S = 0.2  # compute between rounds, as an iteration would


def _rounds(rank: int, world: int, port: int, rounds: int, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.resihp import detection
    from megatron.resihp.schedules import RECORDER
    from resihp_ext.detection.validation import pass_normalised_times

    RECORDER.use_device("cpu")
    device, pair = torch.device("cpu"), (1, world - 1)
    ratios: dict[str, list[float]] = {k: [] for k in ("unpinned_fastest", "unpinned_normalised",
                                                      "one_core_fastest", "one_core_normalised")}
    for r in range(rounds):
        pinned = r % 2 == 1
        mine = detection.LiveDetector._samples_in_passes(
            pair, lambda s: detection.gemm_probe_s(device, samples=1, one_core=pinned) if s == rank else None)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine.get(rank, []))
        a, b = gathered[pair[0]], gathered[pair[1]]
        way = "one_core" if pinned else "unpinned"
        ratios[f"{way}_fastest"].append(min(b) / min(a))
        normalised = pass_normalised_times({0: a, 1: b})
        ratios[f"{way}_normalised"].append(normalised[1] / normalised[0])
        start, x = time.perf_counter(), torch.randn(256, 256)
        while time.perf_counter() - start < _GAP_S:
            x = torch.tanh(x @ x)
    if rank == 0:
        summary = {}
        for name, values in ratios.items():
            v = np.array(values)
            summary[name] = {"rounds": int(v.size), "median": round(float(np.median(v)), 3),
                             "p05": round(float(np.percentile(v, 5)), 3), "p95": round(float(np.percentile(v, 95)), 3),
                             "apart_by_threshold": int(np.sum((v >= THRESHOLD) | (v <= 1 / THRESHOLD)))}
        Path(out).write_text(json.dumps(summary))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="CPU processes (>= 2)")
    parser.add_argument("--rounds", type=int, default=150, help="probe rounds, half of them on one core (>= 2)")
    parser.add_argument("--port", type=int, default=29613)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be >= 2 (two healthy ranks are compared)")
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (rounds alternate between the two placements)")
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "summary.json")
        mp.spawn(_rounds, args=(args.ranks, args.port, args.rounds, out), nprocs=args.ranks)
        summary = json.loads(Path(out).read_text())
    result = {"ranks": args.ranks, "cpu_count": os.cpu_count(), "threshold": THRESHOLD, "ways": summary,
              "apart_over_unpinned_fastest": {
                  k: round(v["apart_by_threshold"] / max(summary["unpinned_fastest"]["apart_by_threshold"], 1), 3)
                  for k, v in summary.items()}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.ranks} ranks on {result['cpu_count']} CPUs, ranks 1 and {args.ranks - 1} probed in turn, "
          f"{args.rounds} rounds")
    for name, s in summary.items():
        print(f"  {name:<20} ratio median {s['median']:.3f}  p05 {s['p05']:.3f}  p95 {s['p95']:.3f}  "
              f"{s['apart_by_threshold']:3d} of {s['rounds']} rounds {THRESHOLD}x apart or more")
    print("  rounds apart, over unpinned fastest: "
          + ", ".join(f"{k} {v:.3f}" for k, v in result["apart_over_unpinned_fastest"].items()))


if __name__ == "__main__":
    main()
