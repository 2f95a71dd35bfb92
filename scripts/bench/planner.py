"""Planner benchmark: planning time at 256..16384 GPUs and plan quality under failure scenarios.

Planning time is the wall time of ``plan_adaptation`` (median of several runs) against the goals
of 50 ms at 256 GPUs and 1 s at 16384. Plan quality is each policy's predicted throughput as a
fraction of the capacity bound (what the surviving hardware could do at best) at 256 GPUs. Prints
only what it measures; ``--json`` prints one JSON object instead.

    python scripts/bench/planner.py [--json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.compare import compare
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation

TP, PP = 8, 4
SCALES = (256, 1024, 4096, 16384)
MICROBATCHES_PER_REPLICA = 16


def model_for(num_gpus: int, microbatches_per_replica: int = MICROBATCHES_PER_REPLICA) -> ModelSpec:
    # a 13B-class GPT: 40 layers, hidden 5120, 40 heads, sequence 2048
    dp = num_gpus // (TP * PP)
    return ModelSpec(num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=20480,
                     vocab_size=50304, seq_length=2048, micro_batch_size=1,
                     global_batch_size=microbatches_per_replica * dp)


def timing_goal_s(num_gpus: int) -> float:
    return 0.05 if num_gpus <= 256 else 1.0


def scenarios() -> dict[str, Health]:
    # with TP=8, DP=8 the stage-p TP group of replica d is ranks 8*(d + 8p) .. +7: rank 9 is in
    # replica 1 stage 0, rank 140 in replica 1 stage 2, ranks 20-21 in replica 2 stage 0
    return {
        "fail-slow 1 device 0.5x": Health(speed={9: 0.5}),
        "slow link 0.25x (inside a TP group)": Health(slow_links={(9, 10): 0.25}),
        "2 dead devices": Health(dead=frozenset({9, 140})),
        "mixed (slow + dead + slow link)": Health(speed={9: 0.5}, dead=frozenset({140}),
                                                  slow_links={(20, 21): 0.25}),
    }


def bench_time(repeats: int) -> list[dict]:
    rows = []
    health = Health(speed={9: 0.5}, dead=frozenset({140}))
    for num_gpus in SCALES:
        layout = Layout.uniform(model_for(num_gpus), TP, PP, num_gpus // (TP * PP))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan_adaptation(layout, health)
            samples.append(time.perf_counter() - start)
        median = statistics.median(samples)
        rows.append({"num_gpus": num_gpus, "planning_time_s": median, "goal_s": timing_goal_s(num_gpus),
                     "ratio_to_goal": median / timing_goal_s(num_gpus)})
    return rows


def bench_quality(horizon_iters: int) -> list[dict]:
    rows = []
    layout = Layout.uniform(model_for(256, 64), TP, PP, 256 // (TP * PP))
    for name, health in scenarios().items():
        result = compare(layout, health, HardwareModel(), horizon_iters=horizon_iters)
        # What the live executor can run today: every stage of a replica at one TP degree.
        executable = plan_adaptation(layout, health, HardwareModel(), horizon_iters=horizon_iters,
                                     uniform_tp_per_replica=True)
        uniform = compare(layout, health, HardwareModel(), plan=executable, horizon_iters=horizon_iters)
        bound = result.capacity_bound
        rows.append({
            "scenario": name,
            "action": result.plan.action,
            "capacity_bound_samples_s": bound,
            "resihp": result.predicted_throughput / bound,
            "resihp-uniform-tp": uniform.predicted_throughput / bound,
            **{policy: value / bound for policy, value in result.baselines.items()},
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per scale (median reported)")
    parser.add_argument("--horizon-iters", type=int, default=500)
    args = parser.parse_args()
    timing = bench_time(args.repeats)
    quality = bench_quality(args.horizon_iters)
    if args.json:
        print(json.dumps({"planning_time": timing, "throughput_fraction_of_bound": quality}, indent=2))
        return
    print(f"planning time (TP={TP}, PP={PP}, one 0.5x device + one dead device, median of {args.repeats})")
    for row in timing:
        print(f"  {row['num_gpus']:>6} GPUs: {row['planning_time_s'] * 1e3:8.1f} ms"
              f"  goal {row['goal_s'] * 1e3:.0f} ms  ratio {row['ratio_to_goal']:.3f}")
    print(f"predicted throughput / capacity bound at 256 GPUs (horizon {args.horizon_iters} iterations)")
    policies = [k for k in quality[0] if k not in ("scenario", "action", "capacity_bound_samples_s")]
    print(f"  {'scenario':<38}" + "".join(f"{p:>20}" for p in policies))
    for row in quality:
        print(f"  {row['scenario']:<38}" + "".join(f"{row[p]:>20.3f}" for p in policies))


if __name__ == "__main__":
    main()
