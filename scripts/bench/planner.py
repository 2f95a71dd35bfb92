"""Planner benchmark: planning time at 256..16384 GPUs and plan quality under failure scenarios.

Planning time is the wall time of ``plan_adaptation`` (median of several runs) against the goals
of 50 ms at 256 GPUs and 1 s at 16384. Plan quality is each policy's predicted throughput as a
fraction of the capacity bound (what the surviving hardware could do at best) at 256 GPUs.
Fail-stop survivor plans, at every scale: random dead GPUs, the in-place plan the executor runs
(whole replicas, replicas rebuilt from intact stage groups, and smaller-TP replicas from groups
that lost ranks) against the same plan at full TP only, keeping whole replicas
only and against a checkpoint-restart on the healthy nodes, each as predicted throughput over the
capacity bound. Prints only what it measures; ``--json`` prints one JSON object instead.

    python scripts/bench/planner.py [--json] [--repeats 5] [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.compare import compare
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.cost import capacity_bound_s, equal_quotas, iteration_s
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.restart import restart_layout
from resihp_ext.planner.survivors import plan_survivors, surviving_layout

TP, PP = 8, 4
SCALES = (256, 1024, 4096, 16384)
DEAD_COUNTS = (2, 8)
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


def _fraction_of_bound(layout: Layout | None, bound_s: float, hw: HardwareModel, quotas: tuple[int, ...] = ()) -> float:
    if layout is None:
        return 0.0
    quotas = quotas or equal_quotas(layout.num_replicas, layout.model.num_microbatches)
    return bound_s / iteration_s(layout, quotas, Health(), hw)


def bench_survivors(trials: int, seed: int = 0) -> list[dict]:
    """Fail-stop of ``k`` random GPUs at each scale, averaged over ``trials`` draws."""
    rng, hw, rows = random.Random(seed), HardwareModel(), []
    for num_gpus in SCALES:
        layout = Layout.uniform(model_for(num_gpus), TP, PP, num_gpus // (TP * PP))
        for num_dead in DEAD_COUNTS:
            names = ("whole_replicas_only", "resihp_full_tp", "resihp", "checkpoint_restart")
            sums, replicas = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
            for _ in range(trials):
                dead = frozenset(rng.sample(range(num_gpus), num_dead))
                bound = capacity_bound_s(layout, Health(dead=dead), hw, layout.model.num_microbatches)
                plan = plan_survivors(layout, dead, hw=hw)
                whole = layout.with_replicas(layout.replicas[i] for i in plan.kept_replicas) if plan.kept_replicas else None
                ours = surviving_layout(layout, plan) if plan.action == "adapt" else None
                # The same plan without its smaller-TP replicas: whole and rebuilt groups at TP only.
                full = [r for r in (whole.replicas if whole else ()) + plan.rebuilt_replicas
                        if r.stages[0].tp_degree == TP]
                full_tp = layout.with_replicas(full) if full else None
                restart = restart_layout(layout, Health(dead=dead))
                for name, candidate, quotas in (("whole_replicas_only", whole, ()), ("resihp_full_tp", full_tp, ()),
                                                ("resihp", ours, plan.quotas), ("checkpoint_restart", restart, ())):
                    sums[name] += _fraction_of_bound(candidate, bound, hw, quotas)
                    replicas[name] += candidate.num_replicas if candidate is not None else 0
            row = {"num_gpus": num_gpus, "num_dead": num_dead, "trials": trials,
                   **{f"{k}_fraction_of_bound": v / trials for k, v in sums.items()},
                   **{f"{k}_mean_replicas": v / trials for k, v in replicas.items()}}
            row["resihp_over_whole_only"] = row["resihp_fraction_of_bound"] / row["whole_replicas_only_fraction_of_bound"]
            row["resihp_over_full_tp"] = row["resihp_fraction_of_bound"] / row["resihp_full_tp_fraction_of_bound"]
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per scale (median reported)")
    parser.add_argument("--horizon-iters", type=int, default=500)
    parser.add_argument("--trials", type=int, default=20, help="random draws of dead GPUs per survivor scenario")
    args = parser.parse_args()
    timing = bench_time(args.repeats)
    quality = bench_quality(args.horizon_iters)
    survivors = bench_survivors(args.trials)
    if args.json:
        print(json.dumps({"planning_time": timing, "throughput_fraction_of_bound": quality,
                          "fail_stop_survivors": survivors}, indent=2))
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
    print(f"fail-stop: throughput / capacity bound after random dead GPUs (TP={TP}, PP={PP}, mean of {args.trials} "
          "draws; mean replicas in brackets; checkpoint-restart excludes the restart itself)")
    print(f"  {'GPUs':>6} {'dead':>5} {'whole replicas only':>24} {'ResiHP, full TP only':>24} {'ResiHP':>24}"
          f" {'checkpoint-restart':>24} {'ResiHP / whole only':>20} {'ResiHP / full TP':>17}")
    for row in survivors:
        cells = "".join(f"{row[k + '_fraction_of_bound']:>15.3f} ({row[k + '_mean_replicas']:>6.1f})"
                        for k in ("whole_replicas_only", "resihp_full_tp", "resihp", "checkpoint_restart"))
        print(f"  {row['num_gpus']:>6} {row['num_dead']:>5} {cells} {row['resihp_over_whole_only']:>20.3f}"
              f" {row['resihp_over_full_tp']:>17.3f}")


if __name__ == "__main__":
    main()
