"""Training throughput (tokens/s) for a few TP/PP/DP shapes in CPU mode on Megatron-LM's loop, and
the cost of the op-timing hooks as a ratio with/without them, both measured in this run.

    python scripts/bench/throughput.py [--iters 12] [--repeats 3] [--json]

Each shape runs as a real multi-process job with ``--resihp-event-log`` (the resilience layer in
Megatron's loop, detection off); tokens/s is taken from the ``iteration`` events' ``elapsed_s``
over the iterations after the first two (warm-up). Hook overhead: the TP2 x PP2 x DP2 job with the
op-timing hooks on every iteration against the same job with them on none
(``RESIHP_ALTERNATE_DETECTION`` with a period longer than the run), run alternately so machine
noise hits both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402

SHAPES = [(1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2)]  # (TP, PP, DP)
MODEL = ("--device cpu --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1000 --eval-iters 0 "
         "--eval-interval 1000").split()
WARMUP = 2


def run(tp: int, pp: int, dp: int, iters: int, hooks: bool) -> float:
    """Median seconds per iteration after warm-up."""
    # Both runs go through the same per-iteration switch, so they differ in the hooks alone: on
    # every iteration (period 1), or on none (phase 0 of a period longer than the run).
    switch = "1:0" if hooks else f"{iters + 1}:0"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ev.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * pp * dp}",
               str(REPO / "pretrain_gpt_resilient.py"), *MODEL, "--tensor-model-parallel-size", str(tp),
               "--pipeline-model-parallel-size", str(pp), "--train-iters", str(iters), "--resihp-event-log", str(log)]
        proc = subprocess.run(cmd, cwd=REPO, env=job_env({"RESIHP_ALTERNATE_DETECTION": switch}),
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"shape TP{tp} PP{pp} DP{dp} failed:\n{proc.stderr[-2000:]}")
        times = {json.loads(line)["iteration"]: json.loads(line)["elapsed_s"] for line in log.read_text().splitlines()
                 if json.loads(line)["event"] == "iteration"}
        return statistics.median(t for i, t in times.items() if i > WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help=f"iterations per job (the first {WARMUP} are warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="hooked/unhooked pairs for the overhead ratio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.iters <= WARMUP:
        parser.error(f"--iters must be more than the {WARMUP} warm-up iterations; got {args.iters}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}")
    tokens_per_iter = 16 * 64
    results = {"shapes": {}, "hook_overhead": {}}
    for tp, pp, dp in SHAPES:
        s = run(tp, pp, dp, args.iters, hooks=True)
        results["shapes"][f"TP{tp}xPP{pp}xDP{dp}"] = {"s_per_iter": s, "tokens_per_s": tokens_per_iter / s}
    with_hooks, without = [], []
    for _ in range(args.repeats):
        with_hooks.append(run(2, 2, 2, args.iters, hooks=True))
        without.append(run(2, 2, 2, args.iters, hooks=False))
    on, off = statistics.median(with_hooks), statistics.median(without)
    results["hook_overhead"] = {"shape": "TP2xPP2xDP2", "s_per_iter_hooks_on": on, "s_per_iter_hooks_off": off,
                                "ratio_on_over_off": on / off, "overhead_pct": 100 * (on / off - 1)}
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'shape':<14} {'ms/iter':>9} {'tokens/s':>10}")
    for name, r in results["shapes"].items():
        print(f"{name:<14} {r['s_per_iter'] * 1000:9.1f} {r['tokens_per_s']:10.1f}")
    h = results["hook_overhead"]
    print(f"op-timing hooks, TP2xPP2xDP2: {h['s_per_iter_hooks_on'] * 1000:.1f} ms on vs "
          f"{h['s_per_iter_hooks_off'] * 1000:.1f} ms off -> ratio {h['ratio_on_over_off']:.3f} "
          f"({h['overhead_pct']:+.1f}%)")


if __name__ == "__main__":
    main()
