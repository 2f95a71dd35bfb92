"""Detection benchmark: false alarms, detection latency and localisation, ours vs baselines.

Runs ResiHP's detector and the Greyhound-style and NVRx-style baselines over the same traces:
(a) synthetic 256-GPU traces (TP8 x PP4 x DP8) whose iteration time swings with the packed
document lengths, healthy and with injected fail-slows, and (b) live traces recorded by a training
run, passed with ``--trace FILE`` (repeatable). Reports, per detector, false alarms per 1,000
healthy iterations, detection latency (iterations from onset to alarm), localisation accuracy
(alarm names exactly the faulty rank(s)), and for ResiHP the micro-batch and iteration predictor
errors and the overhead of its decision logic. With ``--sensitivity``, also which slowdowns of one
rank each detector finds and how fast: steps of several sizes, ramps, and bursts. Prints only what
it measures.

    python scripts/bench/detection.py [--json] [--healthy-iters 1000] [--trace run.jsonl]...
                                      [--overhead-from detection_overhead.json]
                                      [--sensitivity [--sensitivity-iters 200]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.confirmation import PendingVerdicts
from resihp_ext.detection.peer_detectors import GreyhoundStyleDetector, NvrxStyleDetector
from resihp_ext.detection.detector import FailSlowDetector, Verdict
from resihp_ext.faults import Fault, FaultKind, parse_fault
from resihp_ext.detection.predictor import MicrobatchPredictor
from resihp_ext.detection.repeatability import same_work_spread
from resihp_ext.detection.traces import SyntheticSpec, load_trace, synthetic_probes, synthetic_trace
from resihp_ext.schedule import Interleaving

ONSET = 40
# TP8 x PP4 x DP8, rank = tp + 8 * (replica + 8 * stage).
FAULTS = (
    "slow:rank=37,factor=1.5,at=40",  # replica 4, stage 0
    "slow:rank=150,factor=1.5,at=40",  # replica 2, stage 2
    "slow:rank=255,factor=2.0,at=40",  # replica 7, stage 3
    "slow:rank=100,factor=1.3,at=40",  # replica 4, stage 1
    "link:src=9,dst=73,factor=4,at=40",  # replica 1, stage 0 -> 1, TP rank 1
    "link:src=140,dst=204,factor=3,at=40",  # replica 1, stage 2 -> 3, TP rank 4
    # A whole TP group (a node's power cap, say): replica 5, stage 1, all 8 ranks 1.4x.
    ";".join(f"slow:rank={r},factor=1.4,at=40" for r in range(104, 112)),
)
NAMES = ("resihp", "greyhound", "nvrx")
# Iterations a fault run needs after the onset: persistence (2; 3 where ranks share cores), then
# confirmation (2), with room.
AFTER_ONSET = 8


class _Tally:
    """Counts for one detector over all runs."""

    def __init__(self) -> None:
        self.healthy_iters = 0
        self.false_alarms = 0
        self.suspicions_healthy = 0
        self.latencies: list[int] = []
        self.faults = 0
        self.localised = 0

    def summary(self) -> dict:
        return {
            "false_alarms_per_1000": round(1000.0 * self.false_alarms / max(self.healthy_iters, 1), 3),
            "detection_latency_iters": statistics.median(self.latencies) if self.latencies else None,
            "detection_latency_max_iters": max(self.latencies) if self.latencies else None,
            "detected": f"{len(self.latencies)}/{self.faults}",
            "localisation_accuracy": round(self.localised / self.faults, 3) if self.faults else None,
            "healthy_iterations": self.healthy_iters,
        }


def _new_stats() -> dict:
    """What ``run_one`` adds to over one or more runs."""
    return {"decision_s": [], "iteration_s": [], "itp_err": [], "mtp": [], "mtp_flat": [], "itp_err_flat": [],
            "flat_suspicions": 0}


def _truth(faults: list[Fault]) -> frozenset[int]:
    """The ranks a verdict should name: the slow ranks, or a slow link's two ends."""
    return frozenset(r for f in faults for r in ((f.rank, f.dst) if f.kind is FaultKind.LINK else (f.rank,)))


def run_one(iterations, faults, spec, tallies, stats, probes_for, probe_baselines=None,
            interleaving: Interleaving = Interleaving()) -> None:
    """Feed one trace to all detectors and add to the tallies."""
    config = ResiHPConfig()
    ours = FailSlowDetector(config, MicrobatchPredictor(error_window=10**7), interleaving=interleaving)
    ours.set_probe_baselines(probe_baselines or {})
    # As live: a fail-slow verdict counts once a second probe round confirms it.
    pending = PendingVerdicts.from_config(config)
    # The same detector without speed levels, on the same timings: the predictors' baseline.
    flat = FailSlowDetector(ResiHPConfig(speed_level_halflife_iters=0), MicrobatchPredictor(error_window=10**7),
                            interleaving=interleaving)
    flat.set_probe_baselines(probe_baselines or {})
    flat_pending = PendingVerdicts.from_config(config)
    baselines = {"greyhound": GreyhoundStyleDetector(), "nvrx": NvrxStyleDetector()}
    onset = min((f.at_iteration for f in faults), default=None)
    # What the first verdict should name: the faults that begin first (several for a slow group).
    truth = _truth([f for f in faults if f.at_iteration == onset]) if faults else None
    first = {name: None for name in NAMES}
    for name in NAMES:
        tallies[name].faults += 1 if faults else 0
    for iteration, observations in iterations:
        healthy = onset is None or iteration < onset
        start = time.perf_counter()
        suspicion = ours.observe(iteration, observations)
        stats["decision_s"].append(time.perf_counter() - start)
        stats["iteration_s"].append(ours.last_report.observed_iteration_s)
        flat_suspicion = flat.observe(iteration, observations)
        stats["flat_suspicions"] += flat_suspicion is not None and healthy
        flat_pending.settle_iteration(flat, iteration, flat_suspicion, lambda s: probes_for(iteration, s))
        for det, errors in ((ours, stats["itp_err"]), (flat, stats["itp_err_flat"])):
            report = det.last_report
            if report.judged and report.predicted_iteration_s and healthy:
                errors.append(abs(report.predicted_iteration_s - report.observed_iteration_s)
                              / report.observed_iteration_s)
        alarms, noticed = {}, {}
        if suspicion is not None and healthy:
            tallies["resihp"].suspicions_healthy += 1
        settled = pending.settle_iteration(ours, iteration, suspicion, lambda s: probes_for(iteration, s))
        for _, outcome in settled:
            if isinstance(outcome, Verdict) and "resihp" not in alarms:
                alarms["resihp"] = frozenset(outcome.ranks)
                if not healthy:
                    stats.setdefault("verdicts", []).append(outcome)
                # Latency counts from the suspicion, as live runs report it; the verdict is
                # actionable confirm_after_iters later.
                noticed["resihp"] = outcome.evidence.get("suspicion_iteration", iteration)
        for name, det in baselines.items():
            alarm = det.observe(iteration, observations)
            if alarm is not None:
                alarms[name] = frozenset(alarm.ranks)
        for name in NAMES:
            if healthy:
                tallies[name].healthy_iters += 1
                tallies[name].false_alarms += name in alarms
            elif name in alarms and first[name] is None:
                first[name] = iteration
                tallies[name].latencies.append(max(noticed.get(name, iteration) - onset, 0))
                tallies[name].localised += alarms[name] == truth
    if ours.predictor.mape() is not None:
        stats["mtp"].append(ours.predictor.mape())
    if flat.predictor.mape() is not None:
        stats["mtp_flat"].append(flat.predictor.mape())


def synthetic(args, tallies, stats) -> None:
    spec = SyntheticSpec()
    for seed in range(args.healthy_runs):
        run_one(synthetic_trace(spec, args.healthy_iters, seed=1000 + seed), [], spec, tallies, stats,
                lambda it, s: synthetic_probes(spec, [], it, s.probe_ranks, s.probe_links))
    for i, text in enumerate(FAULTS):
        faults = [parse_fault(part) for part in text.split(";")]
        run_one(synthetic_trace(spec, args.fault_iters, faults, seed=i), faults, spec, tallies, stats,
                lambda it, s, faults=faults: synthetic_probes(spec, faults, it, s.probe_ranks, s.probe_links))


def _ramp(rank: int, top: float, at: int, over: int) -> list[Fault]:
    """A slowdown growing evenly to ``top`` over ``over`` iterations from ``at``: one step per iteration."""
    steps = [Fault(FaultKind.SLOW, rank, at + k, 1.0 + (top - 1.0) * (k + 1) / over, until_iteration=at + k + 1)
             for k in range(over - 1)]
    return steps + [Fault(FaultKind.SLOW, rank, at + over - 1, top)]


def sensitivity_cases(rank: int = 37) -> dict[str, list[Fault]]:
    """Which slowdowns, of one rank from iteration ONSET: steps of several sizes, ramps, bursts."""
    cases = {f"step {f:g}x": [Fault(FaultKind.SLOW, rank, ONSET, f)] for f in (1.1, 1.2, 1.25, 1.3, 1.5, 2.0)}
    cases.update({f"ramp to 1.5x over {n}": _ramp(rank, 1.5, ONSET, n) for n in (10, 30, 60)})
    cases.update({f"bursts 1.5x {on} on {off} off": [parse_fault(f"slow:rank={rank},factor=1.5,at={ONSET},on={on},off={off}")]
                  for on, off in ((1, 3), (2, 2), (3, 3), (3, 9), (5, 5))})
    return cases


def sensitivity(args) -> dict:
    """Each case of ``sensitivity_cases`` alone on the synthetic 256-GPU trace: when each detector
    first alarms after the onset (iterations; None: never), whether it named exactly the slow rank,
    and our verdict's factor. Alarms before the onset are false ones: per 1,000 iterations, over
    every case's iterations before its onset."""
    spec = SyntheticSpec()
    rows, before = {}, {n: [0, 0] for n in NAMES}  # false alarms, healthy iterations: all cases together
    for i, (name, faults) in enumerate(sensitivity_cases().items()):
        tallies = {n: _Tally() for n in NAMES}
        stats = _new_stats()
        run_one(synthetic_trace(spec, args.sensitivity_iters, faults, seed=100 + i), faults, spec, tallies, stats,
                lambda it, s, faults=faults: synthetic_probes(spec, faults, it, s.probe_ranks, s.probe_links))
        row = {}
        for n in NAMES:
            t = tallies[n]
            row[n] = {"latency_iters": t.latencies[0] if t.latencies else None, "localised": bool(t.localised)}
            before[n][0] += t.false_alarms
            before[n][1] += t.healthy_iters
        verdict = (stats.get("verdicts") or [None])[0]
        row["resihp"]["factor"] = None if verdict is None else round(verdict.factor, 3)
        row["resihp"]["in_bursts"] = bool(verdict is not None and verdict.intermittent)
        rows[name] = row
    return {"cases": rows, "false_alarms_per_1000_before_onset":
            {n: round(1000.0 * fa / max(healthy, 1), 2) for n, (fa, healthy) in before.items()}}


def _print_sensitivity(result: dict, iterations: int) -> None:
    rows = result["cases"]
    print(f"\n== sensitivity: one rank of 256 slowed from iteration {ONSET}, {iterations} iterations ==")
    print(f"{'case':<26} {'resihp':>22} {'greyhound':>16} {'nvrx':>16}")
    fmt = lambda r: "never" if r["latency_iters"] is None else (  # noqa: E731
        f"{r['latency_iters']} it{'' if r['localised'] else ' (wrong ranks)'}")
    for name, row in rows.items():
        ours = row["resihp"]
        text = fmt(ours) + ("" if ours["factor"] is None else f", {ours['factor']:.2f}x") + (
            " bursts" if ours["in_bursts"] else "")
        print(f"{name:<26} {text:>22} {fmt(row['greyhound']):>16} {fmt(row['nvrx']):>16}")
    print(f"false alarms per 1,000 iterations before the onset, {len(rows)} cases together: "
          + ", ".join(f"{n} {v:g}" for n, v in result["false_alarms_per_1000_before_onset"].items()))


def live(path: str, tallies, stats) -> list[str]:
    trace = load_trace(path)
    faults = list(trace.faults())
    notes = [f"{path}: {len(trace.iterations)} iterations, layout {trace.header.get('layout')}, "
             f"faults {[f.spec() for f in faults]}, {trace.skipped} malformed lines skipped"]
    spec = SyntheticSpec()

    def probes_for(iteration, suspicion):
        # Live runs record each probe round at the iteration it ran after, which is later than the
        # replay's (live, one iteration after the suspicion), and one step can run several rounds.
        # A suspicion's round is the first from its iteration on that probed all it names: the
        # next round in time can be another suspicion's (a 1.5x rank was missed that way).
        ranks, links = set(suspicion.probe_ranks), set(suspicion.probe_links)
        for i in sorted(i for i in trace.probes if i >= iteration):
            for probes in trace.probes[i]:
                if ranks <= set(probes.rank_s) and links <= set(probes.link_s):
                    return probes
        notes.append(f"{path}: no recorded probe round of ranks {sorted(ranks)} and links {sorted(links)} after "
                     f"iteration {iteration}; probe timings simulated from the header's faults")
        return synthetic_probes(spec, faults, iteration, suspicion.probe_ranks, suspicion.probe_links)

    run_one(sorted(trace.iterations.items()), faults, spec, tallies, stats, probes_for, trace.probe_baselines,
            trace.interleaving())
    # Before the first fault only: a slowed rank's ops are not the same work done as fast.
    onset = min((f.at_iteration for f in faults), default=None)
    stats["same_work"] = same_work_spread(sorted(trace.iterations.items()),
                                          last_iteration=None if onset is None else onset - 1)
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--healthy-iters", type=int, default=1000, help="iterations per healthy synthetic run")
    parser.add_argument("--healthy-runs", type=int, default=1, help="healthy synthetic runs (different seeds)")
    parser.add_argument("--fault-iters", type=int, default=80, help=f"iterations per fault run (onset {ONSET})")
    parser.add_argument("--trace", action="append", default=[], help="live trace JSONL (repeatable)")
    parser.add_argument("--overhead-from", help="JSON with detection's live cost ({'overhead_pct': x}, as "
                                                "live_detection.py writes it); else overhead_pct is the "
                                                "decision logic's share of the replayed iteration time")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also replay one rank slowed in steps of several sizes, in ramps and in bursts, and "
                             "print when each detector first alarms")
    parser.add_argument("--sensitivity-iters", type=int, default=200,
                        help=f"iterations per --sensitivity case (onset {ONSET})")
    args = parser.parse_args()
    if args.sensitivity and args.sensitivity_iters < ONSET + 60:
        parser.error(f"--sensitivity-iters must be at least {ONSET + 60}: the slowest ramp reaches its top 60 "
                     f"iterations after the onset at {ONSET}")
    if args.fault_iters < ONSET + AFTER_ONSET:
        parser.error(f"--fault-iters must be at least {ONSET + AFTER_ONSET}: the fault starts at {ONSET}, and a "
                     f"verdict needs a suspicion and a second probe round after it")

    results = {}
    notes = []
    sources = [("synthetic", None)] + [("live", p) for p in args.trace]
    if not args.trace:
        notes.append("no --trace given: live traces skipped")
    for kind, path in sources:
        tallies = {name: _Tally() for name in NAMES}
        stats = _new_stats()
        if kind == "synthetic":
            synthetic(args, tallies, stats)
        else:
            notes.extend(live(path, tallies, stats))
        block = {name: tallies[name].summary() for name in NAMES}
        decision_pct = 100.0 * statistics.mean(stats["decision_s"]) / statistics.mean(stats["iteration_s"])
        block["resihp"].update(
            suspicions_per_1000_healthy=round(1000.0 * tallies["resihp"].suspicions_healthy
                                              / max(tallies["resihp"].healthy_iters, 1), 3),
            mtp_mape=round(statistics.mean(stats["mtp"]), 3) if stats["mtp"] else None,
            # the same detector without speed levels (resihp_ext.detection.speed_level), on the same timings
            mtp_mape_without_levels=round(statistics.mean(stats["mtp_flat"]), 3) if stats["mtp_flat"] else None,
            suspicions_per_1000_healthy_without_levels=round(
                1000.0 * stats["flat_suspicions"] / max(tallies["resihp"].healthy_iters, 1), 3),
            itp_mape_without_levels=(round(100.0 * statistics.mean(stats["itp_err_flat"]), 3)
                                     if stats["itp_err_flat"] else None),
            # live traces: how far ops that did identical work spread around their median
            # (resihp_ext.detection.repeatability), the floor the micro-batch MAPE is read against
            same_work_mape=round(stats["same_work"].mape_pct, 3) if stats.get("same_work") else None,
            itp_mape=round(100.0 * statistics.mean(stats["itp_err"]), 3) if stats["itp_err"] else None,
            decision_ms_per_iter=round(1000.0 * statistics.mean(stats["decision_s"]), 3),
            decision_overhead_pct=round(decision_pct, 4),
            overhead_pct=round(decision_pct, 4),
        )
        results[kind if path is None else path] = block
    if args.overhead_from:
        # Measured live (live_detection.py): hooks, gathering every rank's timings and the decision
        # logic together, so it replaces the decision-only figure rather than adding to it.
        measured = json.loads(Path(args.overhead_from).read_text())
        for block in results.values():
            block["resihp"]["overhead_pct"] = measured["overhead_pct"]
            block["resihp"]["overhead_source"] = "live, detection on vs off per iteration"

    rows = sensitivity(args) if args.sensitivity else None
    if args.json:
        # Top level: the synthetic results per detector; live traces under "live".
        out = dict(results.pop("synthetic"))
        if results:
            out["live"] = results
        if rows is not None:
            out["sensitivity"] = rows
        out["notes"] = notes
        print(json.dumps(out))
        return
    for source, block in results.items():
        print(f"\n== {source} ==")
        print(f"{'detector':<10} {'FA/1000':>8} {'latency':>8} {'max':>5} {'detected':>9} {'localised':>9}")
        for name in NAMES:
            row = block[name]
            fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
            print(f"{name:<10} {row['false_alarms_per_1000']:>8.2f} {fmt(row['detection_latency_iters']):>8} "
                  f"{fmt(row['detection_latency_max_iters']):>5} {row['detected']:>9} "
                  f"{fmt(row['localisation_accuracy']):>9}")
        r = block["resihp"]
        floor = "" if r["same_work_mape"] is None else f" (identical work spreads {r['same_work_mape']}%)"
        print(f"resihp: suspicions/1000 healthy {r['suspicions_per_1000_healthy']}, mtp_mape {r['mtp_mape']}%{floor}, "
              f"itp_mape {r['itp_mape']}% (without speed levels: {r['mtp_mape_without_levels']}%, "
              f"{r['itp_mape_without_levels']}%, suspicions/1000 {r['suspicions_per_1000_healthy_without_levels']}), decision {r['decision_ms_per_iter']} ms/iter "
              f"({r['decision_overhead_pct']}% of iteration), overhead_pct {r['overhead_pct']}")
    if rows is not None:
        _print_sensitivity(rows, args.sensitivity_iters)
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
