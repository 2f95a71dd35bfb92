"""What judging costs the deciding rank as the job grows: 64 to 4,096 ranks.

One rank judges every iteration of the whole job (``megatron.resihp.detection.LiveDetector``,
on ``decider_rank``): it unpickles every rank's observation, runs the fail-slow detector over all
of them and fits the planner's compute costs. What of it exceeds the decider's wait for its
first activations (it sits on the last pipeline stage; ``decider_placement.py``) adds to the
job's iteration. Here that work runs on synthetic healthy iterations of TP8 x PP4 x DP jobs
(``resihp_ext.detection.traces.SyntheticSpec``: packed documents, 8 micro-batches per iteration) at each
size, packed and pickled as ``object_messages`` sends them, and is timed per iteration after the
detector's warm-up. Reported per size: milliseconds per iteration, microseconds per rank, the share of the
synthetic iteration's time, and the per-rank cost over the smallest size's (1 when judging
scales linearly). The receives themselves (one per rank, over gloo) are not included.

    python scripts/bench/decider_scaling.py [--json] [--ranks 64,256,1024,4096] [--iters 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.detector import FailSlowDetector
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.detection.observation_wire import packed
from resihp_ext.detection.op_signals import op_tables
from resihp_ext.planner.calibration import fit_compute_costs
from resihp_ext.detection.traces import SyntheticSpec, synthetic_trace
from tables import print_table  # noqa: E402

TP, PP = 8, 4
WARMUP_ITERS = 10  # the detector judges from its 5th iteration; its fits settle over a few more


def _layout(spec: SyntheticSpec) -> Layout:
    model = ModelSpec(num_layers=4 * PP, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384,
                      vocab_size=32000, seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size)
    return Layout.uniform(model, TP, PP, spec.dp_degree)


def measure(ranks: int, iters: int, seed: int = 1) -> dict:
    """Rank 0's judging per iteration of a ``ranks``-rank job (TP8 x PP4 x ranks/32)."""
    spec = SyntheticSpec(tp_degree=TP, pp_degree=PP, dp_degree=ranks // (TP * PP))
    layout = _layout(spec)
    detector = FailSlowDetector(ResiHPConfig())
    per_iteration, iteration_s, suspicions = [], [], 0
    for iteration, observations in synthetic_trace(spec, WARMUP_ITERS + iters, seed=seed):
        # As live ranks send them: with each op's busy seconds (synthetic ones derive it from the ops).
        messages = [pickle.dumps(packed(dataclasses.replace(o, busy=o.op_busy())), protocol=pickle.HIGHEST_PROTOCOL)
                    for o in observations]
        start = time.perf_counter()
        gathered = [pickle.loads(m) for m in messages]
        tables = op_tables(gathered)  # as the live decider does: once, for both
        suspicion = detector.observe(iteration, gathered, tables)
        fit_compute_costs(iteration, gathered, layout, tables)
        elapsed = time.perf_counter() - start
        if iteration > WARMUP_ITERS:
            per_iteration.append(elapsed)
            iteration_s.append(statistics.median(o.iteration_s for o in observations))
            suspicions += suspicion is not None
    median_s = statistics.median(per_iteration)
    return {"ranks": ranks, "ms_per_iteration": round(1e3 * median_s, 2),
            "us_per_rank": round(1e6 * median_s / ranks, 2),
            "pct_of_iteration": round(100 * median_s / statistics.median(iteration_s), 3),
            "iteration_s": round(statistics.median(iteration_s), 3), "suspicions": suspicions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--ranks", default="64,256,1024,4096",
                        help="job sizes, comma-separated, each a multiple of 32 (TP8 x PP4)")
    parser.add_argument("--iters", type=int, default=30, help="iterations timed per size, after the warm-up")
    args = parser.parse_args()
    try:
        sizes = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks takes comma-separated integers, got {args.ranks!r}")
    if any(r <= 0 or r % (TP * PP) for r in sizes):
        parser.error(f"--ranks: every size must be a positive multiple of {TP * PP} (TP{TP} x PP{PP}), "
                     f"got {args.ranks}")
    if args.iters < 5:
        parser.error("--iters must be at least 5")
    rows = [measure(r, args.iters) for r in sizes]
    for row in rows:
        row["per_rank_over_smallest"] = round(row["us_per_rank"] / rows[0]["us_per_rank"], 3)
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    print_table([("ranks", "ranks", 6), ("ms_per_iteration", "ms/iteration", 13), ("us_per_rank", "us/rank", 8),
                 ("pct_of_iteration", "% of iteration", 15), ("per_rank_over_smallest", "per rank vs smallest", 21),
                 ("suspicions", "suspicions", 10)], rows)


if __name__ == "__main__":
    main()
