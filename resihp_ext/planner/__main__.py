"""What-if command line for the re-planner: ``python -m resihp_ext.planner``.

Responsible for turning flags (a uniform Megatron layout plus injected health problems) into a
ResiHP plan and printing it beside every baseline's predicted throughput and the capacity bound,
as text or as one JSON object (``--json``). Bad input exits with code 2 and names the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.compare import compare
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m resihp_ext.planner", description=__doc__.splitlines()[0])
    for flag, default in (("--tp", 1), ("--pp", 1), ("--dp", 1)):
        p.add_argument(flag, type=int, default=default, help=f"{flag[2:].upper()} degree of the running layout")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--slow", action="append", default=[], metavar="RANK:SPEED",
                   help="rank runs at SPEED of healthy (0.5 = half speed); repeatable")
    p.add_argument("--dead", action="append", default=[], type=int, metavar="RANK", help="dead rank; repeatable")
    p.add_argument("--slow-link", action="append", default=[], metavar="SRC:DST:SPEED",
                   help="link bandwidth at SPEED of healthy; repeatable")
    p.add_argument("--horizon-iters", type=int, default=500, help="iterations an adaptation must pay off in")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _parse_health(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Health:
    speed, links = {}, {}
    for item in args.slow:
        try:
            rank, value = item.split(":")
            speed[int(rank)] = float(value)
        except ValueError:
            parser.error(f"--slow {item!r}: expected RANK:SPEED, e.g. --slow 3:0.5")
    for item in args.slow_link:
        try:
            src, dst, value = item.split(":")
            links[(int(src), int(dst))] = float(value)
        except ValueError:
            parser.error(f"--slow-link {item!r}: expected SRC:DST:SPEED, e.g. --slow-link 0:8:0.25")
    try:
        return Health(speed=speed, dead=frozenset(args.dead), slow_links=links)
    except ValueError as exc:
        parser.error(f"--slow/--dead/--slow-link: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        model = ModelSpec(args.num_layers, args.hidden_size, args.num_attention_heads,
                          args.ffn_hidden_size or 4 * args.hidden_size, args.vocab_size, args.seq_length,
                          args.micro_batch_size, args.global_batch_size)
        layout = Layout.uniform(model, args.tp, args.pp, args.dp)
    except ValueError as exc:
        parser.error(f"model/layout flags (--tp --pp --dp --num-layers ...): {exc}")
    health = _parse_health(parser, args)
    outside = sorted(r for r in set(health.affected_ranks) if not layout.contains(r))
    if outside:
        parser.error(f"--slow/--dead/--slow-link name ranks {outside} outside 0..{layout.world_size - 1}")
    if args.horizon_iters < 1:
        parser.error(f"--horizon-iters must be >= 1, got {args.horizon_iters}")
    hw = HardwareModel()
    start = time.perf_counter()
    plan = plan_adaptation(layout, health, hw, horizon_iters=args.horizon_iters)
    planning_time_s = time.perf_counter() - start
    result = compare(layout, health, hw, plan=plan, horizon_iters=args.horizon_iters)
    if args.json:
        out = {
            "plan": plan.to_dict(),
            "reason": plan.reason,
            "planning_time_s": planning_time_s,
            "capacity_bound": result.capacity_bound,
            "predicted_throughput": result.predicted_throughput,
            "baselines": result.baselines,
        }
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"action: {plan.action}  (planned in {planning_time_s * 1e3:.1f} ms)")
    print(f"reason: {plan.reason}")
    if plan.layout is not None:
        for r, rep in enumerate(plan.layout.replicas):
            stages = " | ".join(f"L{st.first_layer}-{st.end_layer - 1} TP{st.tp_degree} {list(st.ranks)}"
                                for st in rep.stages)
            print(f"  replica {r} quota {plan.quotas[r]}: {stages}")
    print(f"moves: {len(plan.moves)} ({plan.num_bytes_moved / 1e9:.2f} GB)")
    for m in plan.moves[:20]:
        what = "replicated tensors" if m.replicated else f"unit {m.unit}/{m.grid}"
        print(f"  {' '.join(map(str, m.item))} {what}: {m.src} -> {m.dst} ({m.num_bytes / 1e6:.1f} MB)")
    if len(plan.moves) > 20:
        print(f"  ... {len(plan.moves) - 20} more")
    bound = result.capacity_bound
    print(f"capacity bound: {bound:.2f} samples/s")
    print(f"{'policy':<20} {'samples/s':>10} {'of bound':>9}")
    rows = {"resihp": result.predicted_throughput, **result.baselines}
    for name, value in rows.items():
        print(f"{name:<20} {value:>10.2f} {value / bound:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
