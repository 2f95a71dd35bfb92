"""What the copies of the distributed optimizer's parts cost per iteration, and what they buy.

Measured in one invocation on Megatron-LM's loop, TP2 x PP2 x DP2 on 8 CPU gloo processes,
``--use-distributed-optimizer``, fixed-length mock samples:

- per-iteration cost: median iteration time (``elapsed_s`` of the ``iteration`` events, from
  iteration 5 on) with ``--resihp-enable`` (each rank's part copied on the next rank of its
  position after every update) over the same job with ``--resihp-detect-only`` (heartbeats and
  detection, no copies), the two run alternately ``--repeats`` times; the ratio is of the medians
  over all runs of each;
- what they buy: rank 5 SIGKILLed at ``--kill-at`` with ``--resihp-enable``: time from the ``inject``
  event (written just before the kill) to the first iteration finished after the re-form, in place
  (before the copies, the same failure ended the job with exit 3 and a restart from the last
  checkpoint).

    python scripts/bench/optimizer_part_copies.py [--json] [--iters 30] [--repeats 2] [--kill-at 10]
        [--hidden-size 256] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402
from scripts.signal_rank import events  # noqa: E402

NPROC = 8


def model_args(hidden: int, iters: int) -> list[str]:
    return [
        "--device", "cpu", "--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "8",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--train-iters", str(iters), "--lr", "1e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "10",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--eval-iters", "0", "--eval-interval", "1000",
        "--use-distributed-optimizer",
    ]


def run(args: list[str], log: Path) -> list[dict]:
    log.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={NPROC}",
           str(REPO / "pretrain_gpt_resilient.py"), *args, "--resihp-event-log", str(log)]
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"job failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-3000:]}")
    return events(log)


def iteration_times(records: list[dict]) -> list[float]:
    return [e["elapsed_s"] for e in records if e["event"] == "iteration" and e["iteration"] >= 5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated")
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="part_copies_"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_args(args.hidden_size, args.iters)
    times = {"detect_only": [], "copies": []}
    per_run = {"detect_only": [], "copies": []}
    part_bytes = []
    for repeat in range(args.repeats):
        for name, flag in (("detect_only", "--resihp-detect-only"), ("copies", "--resihp-enable")):
            records = run([*model, flag], work / f"{name}{repeat}.events.jsonl")
            times[name] += iteration_times(records)
            per_run[name].append(round(statistics.median(iteration_times(records)), 4))
            if name == "copies":
                part_bytes = sorted({e["optimizer_part_bytes"] for e in records if e["event"] == "start"})
    medians = {name: statistics.median(values) for name, values in times.items()}
    started = time.time()
    killed = run([*model, "--resihp-enable", "--resihp-inject", f"kill:rank=5,at={args.kill_at}"],
                 work / "killed.events.jsonl")
    inject = next(e["time"] for e in killed if e["event"] == "inject")
    adapted = [e for e in killed if e["event"] == "adapted"]
    if not adapted:
        raise SystemExit(f"the killed run did not adapt in place: {[e for e in killed if e['event'] != 'iteration']}")
    after = [e for e in killed if e["event"] == "iteration" and e["time"] > adapted[0]["time"]]
    result = {
        "median_iteration_s": {k: round(v, 4) for k, v in medians.items()},
        "median_iteration_s_per_run": per_run,
        "part_bytes_per_rank": part_bytes,
        "iterations_measured": {k: len(v) for k, v in times.items()},
        "copies_over_detect_only": round(medians["copies"] / medians["detect_only"], 4),
        "kill_to_first_iteration_after_s": round(after[0]["time"] - inject, 3),
        "adapted_duration_s": round(adapted[0]["duration_s"], 3),
        "world_size_after": adapted[0]["world_size"],
        "killed_run_wall_s": round(time.time() - started, 1),
        "workdir": str(work),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"TP2 x PP2 x DP2, --use-distributed-optimizer, hidden {args.hidden_size}, {args.iters} iterations x "
          f"{args.repeats} runs each")
    print(f"  each rank's part (sent once per update): {', '.join(f'{b / 2**20:.2f}' for b in part_bytes)} MiB")
    print(f"  median iteration: detect-only {medians['detect_only'] * 1e3:.1f} ms, with part copies "
          f"{medians['copies'] * 1e3:.1f} ms: ratio {result['copies_over_detect_only']:.4f} (per run: detect-only "
          f"{per_run['detect_only']}, copies {per_run['copies']} s)")
    print(f"  rank 5 killed at iteration {args.kill_at}: in place (world {result['world_size_after']}), "
          f"{result['kill_to_first_iteration_after_s']:.3f} s from the kill to the next finished iteration "
          f"(re-form {result['adapted_duration_s']:.3f} s)")


if __name__ == "__main__":
    main()
