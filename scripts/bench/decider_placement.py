"""Where the decider judges: on rank 0 (the first pipeline stage) against the last stage.

Every iteration ends in the loss's all-reduce over the world, so all ranks start the next one
together; a last stage then waits for its first activations while each stage before it runs a
forward. Judging there delays nobody until it takes longer than that wait, where on rank 0 it
delays every stage behind it by all of its time (``megatron.resihp.detection.decider_rank``).

Measured live: a TP1 x PP4 CPU job of 4 processes whose ranks act as devices of their own
(``--cpu-device-time-scale``, so a rank that waits is idle, as a GPU's host is), judging after
every iteration (``--resihp-detect-only``). After every 4th iteration the judgement is made to
last ``--pads`` seconds (``RESIHP_JUDGING_PAD_S``), as judging a job of thousands of ranks does
(``decider_scaling.py``: 65 ms at 1,024 ranks, 302 ms at 4,096, on a 2-core host). Documents are
of one length, so every iteration does the same work. A padded judgement after iteration ``i``
lands in the periods of ``i`` and ``i + 1`` (the periods between the last rank's iteration
events: everything a rank does per iteration); ``i + 2`` and ``i + 3`` of the same run are the
same job without it, a few hundred milliseconds later, so the host's drift between runs stays
out. Per pad, runs with the decider on rank 0 (``RESIHP_DECIDER=first``) and on the last stage
(the default), in ``--rounds`` rounds, and a run without a pad for the estimate's zero. Prints,
per placement, the median extra time of a padded pair of iterations and what share of the pad the
last stage hides (against rank 0).

    python scripts/bench/decider_placement.py [--json] [--pads 0.05,0.15] [--rounds 2] [--iters 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import live_detection  # noqa: E402  (its job arguments and launcher; puts the checkout on sys.path)
from tables import print_table  # noqa: E402

from megatron.resihp.detection import PAD_PERIOD  # noqa: E402
from resihp_ext.detection.traces import load_trace  # noqa: E402

PP = 4
SCALE = "4"  # each rank a device 4x slower than a core: 4 ranks on 2 cores then idle most of the time
WARMUP_ITERS = 10


def periods(log: Path) -> dict[int, float]:
    """Per iteration, seconds since the last rank's previous iteration event: everything a rank
    does per iteration."""
    times = {e["iteration"]: e["time"] for e in live_detection.events(log, "iteration")}
    return {i: times[i] - times[i - 1] for i in times if i - 1 in times}


def padded_pair_extra(period: dict[int, float]) -> list[float]:
    """Per padded judgement after iteration ``i``: the periods of ``i`` and ``i + 1`` less those of
    ``i + 2`` and ``i + 3``."""
    return [period[i] + period[i + 1] - period[i + 2] - period[i + 3] for i in sorted(period)
            if i > WARMUP_ITERS and i % PAD_PERIOD == 0 and all(k in period for k in range(i, i + 4))]


def forward_s(trace: Path) -> float:
    """Median forward of the stages before the last: what the last stage waits for, per stage."""
    return statistics.median(end - start for iteration, observations in load_trace(str(trace)).iterations.items()
                             if iteration > WARMUP_ITERS for o in observations if o.stage < PP - 1
                             for kind, _, start, end in o.ops if kind == "F")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--pads", default="0.05,0.15", help="padded judging's length in seconds, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of runs (in alternating order)")
    parser.add_argument("--iters", type=int, default=60, help="iterations per run")
    parser.add_argument("--workdir", help="keep event logs and traces here (default: a temporary folder)")
    args = parser.parse_args()
    try:
        pads = [float(p) for p in args.pads.split(",")]
    except ValueError:
        parser.error(f"--pads takes comma-separated seconds, got {args.pads!r}")
    if any(not 0 < p < 5 for p in pads):
        parser.error(f"--pads: each must be in (0, 5) seconds, got {args.pads}")
    if args.rounds < 1 or args.iters < WARMUP_ITERS + 2 * PAD_PERIOD:
        parser.error(f"--rounds must be at least 1 and --iters at least {WARMUP_ITERS + 2 * PAD_PERIOD}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="decider_placement_"))
    work.mkdir(parents=True, exist_ok=True)
    # Documents of one length: every iteration does the same work, so neighbouring ones compare.
    job = live_detection.model_args(1, PP)
    lengths = job.index("--mock-doc-lengths")
    job[lengths + 1] = f"fixed:length={live_detection.MODELS['tiny'][2] // 2}"
    base = job + ["--cpu-device-time-scale", SCALE, "--train-iters", str(args.iters), "--resihp-detect-only"]
    # A run without a pad shows the estimate's own zero.
    runs = [(0.0, "last")] + [(pad, where) for pad in pads for where in ("first", "last")]
    extra: dict[tuple[float, str], list[float]] = {run: [] for run in runs}
    forwards, iteration_s = [], []
    for round_ in range(args.rounds):
        for pad, where in runs if round_ % 2 == 0 else reversed(runs):
            name = f"pad{pad:g}_{where}_{round_}"
            log, trace = work / f"{name}.events.jsonl", work / f"{name}.trace.jsonl"
            log.unlink(missing_ok=True)
            live_detection.launch(PP, [*base, "--resihp-event-log", str(log), "--resihp-trace", str(trace)],
                                  {"RESIHP_DECIDER": where, "RESIHP_JUDGING_PAD_S": str(pad)})
            period = periods(log)
            extra[(pad, where)] += padded_pair_extra(period)
            forwards.append(forward_s(trace))
            if pad == 0:
                iteration_s.append(statistics.median(p for i, p in period.items() if i > WARMUP_ITERS))
    none = statistics.median(iteration_s)
    rows = []
    for pad, where in runs:
        values = extra[(pad, where)]
        rows.append({"pad_s": pad, "decider": "rank 0" if where == "first" else "last stage",
                     "padded_judgements": len(values), "extra_s": round(statistics.median(values), 4),
                     "extra_pct_of_iteration": round(100 * statistics.median(values) / none, 2)})
    for row in rows:
        if row["pad_s"] and row["decider"] == "last stage":
            first = next(r for r in rows if r["pad_s"] == row["pad_s"] and r["decider"] == "rank 0")
            row["share_hidden"] = round(1 - row["extra_s"] / first["extra_s"], 3) if first["extra_s"] > 0 else None
    forward = statistics.median(forwards)
    out = {"iteration_s": round(none, 4), "forward_s_before_last_stage": round(forward, 4),
           "wait_of_last_stage_s": round((PP - 1) * forward, 4), "rows": rows, "workdir": str(work)}
    if args.json:
        print(json.dumps(out))
        return
    print(f"TP1 x PP4, 4 processes, devices emulated at {SCALE}x a core; iteration {out['iteration_s']} s; a forward "
          f"before the last stage {out['forward_s_before_last_stage']} s, so the last stage waits about "
          f"{out['wait_of_last_stage_s']} s for its first activations")
    print_table([("pad_s", "judging s", 10), ("decider", "decider", 11), ("padded_judgements", "judgements", 11),
                 ("extra_s", "extra s", 8), ("extra_pct_of_iteration", "% of iter.", 10),
                 ("share_hidden", "share hidden", 13)], rows)


if __name__ == "__main__":
    main()
