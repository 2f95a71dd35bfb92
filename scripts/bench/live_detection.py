"""Live detection benchmark: real CPU training runs, their op timings, and every detector on them.

Runs pretrain_gpt_resilient.py on Megatron-LM's loop on CPU (gloo, packed variable-length documents
with per-document attention) and measures, in one invocation:

(a) a healthy run of ``--healthy-iters`` iterations with ``--resihp-detect-only --resihp-trace``;
(b) the same job with ``slow:rank=3,factor=1.5,at=10`` injected;
(c) what detection costs: two runs of ``--overhead-iters`` with ``RESIHP_ALTERNATE_DETECTION``
    ``4:0`` and ``4:2``, in which the op hooks and the per-iteration detection (sending timings to
    the decider, its judging) run on every 4th iteration only, half a period apart. Each detection's
    iteration and the next (which pays for the judging) are thus timed with detection in
    one run and clean in the other, and neighbouring pairs take out the host's drift
    (``paired_overhead``); detection steps that ran probe rounds are reported apart, per round;
    ``--overhead-repeats R`` runs R such pairs and pools them (``pooled_overhead``);
(d) this host's timing floor: one fixed op (GEMMs, the size of a micro-batch's compute) timed by
    the same busy clock in this process alone, and the MAPE of predicting each run by the median.
    No cost model can predict a micro-batch better than the clock repeats a fixed op, so the
    predictor's MAPE is printed beside it;
(e) the same floor inside the run: how far ops that did identical work (same stage, op kind and
    micro-batch features) spread around their median (``resihp_ext.detection.repeatability``).

Both traces then go through ``scripts/bench/detection.py --trace`` (ours vs the Greyhound-style and
NVRx-style baselines on the same live timings; that script simulates probe timings from the
trace header because live traces hold no probe rows, so its "false alarms" for ours count
suspicions whose simulated probes blamed a rank). Our own live suspicions, clearances and verdicts
(with real probes) are counted from the event logs. Prints only what it measured.

    python scripts/bench/live_detection.py [--json] [--healthy-iters 200] [--shape tp2pp2dp2]
    python scripts/bench/live_detection.py --shape tp1pp2dp1 --model medium  # a rank per core
    python scripts/bench/live_detection.py --device cuda --shape tp1pp1dp1    # one GPU
    python scripts/bench/live_detection.py --device cuda --shape tp1pp1dp1 --bf16  # TE THD attention

With one rank, the slowdown goes to rank 0; with no other rank to probe beside it, its probes are
compared with its own from the first iterations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import scipy.stats

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402

# tp1pp1dp1 is for one GPU: the micro-batch predictor's error on a device whose op times repeat.
SHAPES = {"tp2pp2dp2": (2, 2, 2), "tp1pp2dp2": (1, 2, 2), "tp1pp2dp1": (1, 2, 1), "tp1pp1dp1": (1, 1, 1)}
# (hidden size, attention heads, sequence length). "tiny" is the tests' model, whose ops last a few
# ms, so that the interpreter's and the host's jitter are a large part of each; "medium" ops last
# tens of ms on CPU. On a GPU both are bound by kernel launches; "large" has GEMMs of ~100 GFLOP
# per layer (on an H100 its ops were still host-bound: docs/notes/benchmarks.md section 31).
MODELS = {"tiny": (64, 4, 64), "medium": (256, 8, 256), "large": (1024, 16, 2048)}
SLOW_RANK, FACTOR, ONSET = 3, 1.5, 10
MICRO_BATCH, GLOBAL_BATCH = 2, 16


def model_args(tp: int, pp: int, device: str = "cpu", model: str = "tiny") -> list[str]:
    hidden, heads, seq = MODELS[model]
    return [
        "--device", device, "--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(GLOBAL_BATCH), "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "512", "--log-interval", "10", "--eval-iters", "0", "--eval-interval", "1000",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--mock-doc-lengths", "lognormal:median=48,sigma=1.0,min=8,max=1024",
        "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
        *without_apex(device),
    ]


def without_apex(device: str) -> list[str]:
    """What a CUDA job needs where apex is not installed: no gradient accumulation fusion (apex's kernel)."""
    if device != "cuda":
        return []
    from megatron.resihp.gpt_pretrain import has_apex_wgrad_fusion

    return [] if has_apex_wgrad_fusion() else ["--no-gradient-accumulation-fusion"]


def launch(nproc: int, args: list[str], env_extra: dict | None = None, timeout_s: float = 1200) -> float:
    env = job_env(env_extra, without=["RESIHP_DISABLE_OP_HOOKS"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "pretrain_gpt_resilient.py"), *args]
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        raise SystemExit(f"job failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-3000:]}")
    return time.time() - start


def timer_floor(samples: int = 200, size: int = 256, repeats: int = 20) -> dict:
    """Spread of the busy clock on a fixed op: MAPE of the median as predictor, and the CV."""
    import torch

    torch.manual_seed(0)
    a, b = torch.randn(size, size), torch.randn(size, size)
    times = []
    for _ in range(samples + 10):
        start = time.thread_time()
        for _ in range(repeats):
            a = torch.tanh(a @ b)
        times.append(time.thread_time() - start)
    times = times[10:]  # warm-up
    median = statistics.median(times)
    return {"op_ms": round(1e3 * median, 3), "mape_pct": round(100 * statistics.mean(abs(t - median) / t for t in times), 2),
            "cv_pct": round(100 * statistics.pstdev(times) / statistics.mean(times), 2), "samples": samples}


def events(path: Path, kind: str | None = None) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["event"] == kind]


def _mean_ci(samples: list[float]) -> tuple[float, float]:
    """Mean of log ratios and the half width of its 95% interval."""
    return statistics.mean(samples), 1.96 * statistics.stdev(samples) / math.sqrt(len(samples))


def _pct(log_ratio: float) -> float:
    return round(100 * math.expm1(log_ratio), 3)


# The two runs that time detection's cost: each detects on every 4th iteration, half a period apart.
ALTERNATE_PHASES = ("4:0", "4:2")


def paired_overhead(logs: list[Path], skip: int, elapsed_includes_detection: bool = False) -> dict:
    """Detection's cost from the two runs of ``ALTERNATE_PHASES`` (``RESIHP_ALTERNATE_DETECTION``).

    ``elapsed_includes_detection``: whether the iteration events' ``elapsed_s`` covers the
    detection step as well as the training step, as Megatron-LM's loop times them (its
    ``train_step`` ends in the detection step); else ``elapsed_s`` is the training step alone and
    ``step_s`` less ``elapsed_s`` times the detection step apart.

    Detecting after iteration ``i`` costs time in ``i`` (the detection step) and in ``i + 1``: the
    decider judges after its step, so it may start ``i + 1`` late, and the ranks that wait for it in the
    pipeline and the gradient all-reduce pay for that in their ``i + 1``. So the unit is the pair
    ``(i, i + 1)``: when one run detects after ``i``, the other detects after ``i - 2`` and
    ``i + 2``, and its pair ``(i, i + 1)`` is clean while its neighbouring pairs are not (and the
    other way round). Two estimates, per detecting iteration after ``skip``:

    - across runs: the pair's time with detection over its time without (the same data both times;
      the two times were taken minutes apart, so the host's drift between runs is in every ratio);
    - within runs (``overhead_pct``): in each run, the pair's log time less the mean of its two
      neighbouring pairs' (which ran the other way), and half the difference of that between the
      runs. The neighbours remove the host's drift, the other run removes what the data costs.

    Both are the pair's extra time; as a share of one iteration that is twice it, and that is
    what detection costs a job that detects after every iteration, which is what they report.
    (With every other iteration detecting, as this estimate once was, the cost carried into the
    next iteration landed on the baseline and was subtracted: it read -0.79%, interval -1.32% to
    -0.26%, on 470 iterations of 8 ranks over 2 cores, while rank 0 judged for 0.52% of an
    iteration in CPU.)

    Detection steps that ran probe rounds (``probe_rounds`` of the iteration event) are left out
    of these: a one-stage-group job's own probe baselines take a round after its 1st, 2nd, 4th,
    ..., 32nd detection and never again, and a round costs tens of iterations' judging, so in a
    short run they would be most of the estimate of a cost that stops. They are reported apart:
    how many rounds each run took (``probe_rounds``) and what one cost (``probe_round_ms``: such a
    detection step's time less the median probe-free one's, per round; where ``elapsed_s``
    includes the detection step, such an iteration's time less the median probe-free detecting
    iteration's). ``overhead_pct_with_probes`` is the within-runs estimate over every detection,
    probes included.

    ``judging_pct`` and ``decider_cpu_pct`` are the decider's judging per detecting iteration, in
    wall and in CPU seconds (``decision_s`` and ``decision_cpu_s`` of the ``detector_overhead``
    events), over the median clean iteration.

    Where the cost lies: ``detecting_iteration_pct`` and ``next_iteration_pct`` are the same
    within-runs estimate made of one iteration (``elapsed_s``) instead of the pair, for the
    iteration that detects (its ops ran hooked) and the one after. Where ``elapsed_s`` includes
    the detection step they add up to about ``overhead_pct``; else ``after_step_pct`` (the
    detection step, ``step_s`` less ``elapsed_s``) makes up the rest, and is None where it is not
    timed apart. Where the events carry them (``cpu_s``, ``gc_s``, ``gc_full``), ``host_busy_pct``
    is the median share of an iteration the process spent on CPU (near 100: the host, not the
    device, sets the pace), ``gc_ms_per_iteration`` the collector's mean pause per iteration and
    ``gc_full`` its full collections, over both runs.
    """
    times, detecting, elapsed, probed = [{}, {}], [{}, {}], [{}, {}], [{}, {}]
    decision_s, decision_cpu_s, decided = 0.0, 0.0, 0
    for run, log in enumerate(logs):
        for e in events(log, "iteration"):
            times[run][e["iteration"]] = e["step_s"]
            elapsed[run][e["iteration"]] = e["elapsed_s"]
            detecting[run][e["iteration"]] = e["detecting"]
            probed[run][e["iteration"]] = e.get("probe_rounds", 0)
            decided += e["detecting"]
        for e in events(log, "detector_overhead"):
            decision_s += e.get("decision_s", 0.0)
            decision_cpu_s += e.get("decision_cpu_s", 0.0)

    def pair(run: int, i: int) -> float:
        return math.log(times[run][i] + times[run][i + 1])

    def step_against_neighbours(run: int, i: int) -> float:
        return math.log(elapsed[run][i]) - (math.log(elapsed[run][i - 2]) + math.log(elapsed[run][i + 2])) / 2

    cross, within, within_all, clean, on, after_step = [], [], [], [], [], []
    in_detecting, in_next = [], []  # per iteration: half the difference between the runs
    probe_steps: list[tuple[float, int]] = []  # (seconds of a step that probed, probe rounds it ran)
    for x in (0, 1):
        y = 1 - x
        for i in sorted(times[x]):
            span = range(i - 2, i + 4)
            if i <= skip or not detecting[x][i] or not all(k in times[x] and k in times[y] for k in span):
                continue
            if detecting[y][i] or detecting[y][i + 1] or detecting[x][i + 1] or not detecting[y][i - 2]:
                raise SystemExit(f"{logs[x]} and {logs[y]} are not runs of RESIHP_ALTERNATE_DETECTION "
                                 f"{ALTERNATE_PHASES[0]} and {ALTERNATE_PHASES[1]}")
            dx = pair(x, i) - (pair(x, i - 2) + pair(x, i + 2)) / 2
            dy = pair(y, i) - (pair(y, i - 2) + pair(y, i + 2)) / 2
            within_all.append(dx - dy)  # twice the half difference: per iteration, not per pair
            # The detection step: the whole iteration where elapsed_s includes it, else timed apart.
            step_s = times[x][i] if elapsed_includes_detection else times[x][i] - elapsed[x][i]
            if probed[x][i]:
                probe_steps.append((step_s, probed[x][i]))
            if probed[x][i] or probed[y][i - 2] or probed[y][i + 2]:
                continue
            cross.append(2 * (pair(x, i) - pair(y, i)))
            within.append(dx - dy)
            in_detecting.append((step_against_neighbours(x, i) - step_against_neighbours(y, i)) / 2)
            in_next.append((step_against_neighbours(x, i + 1) - step_against_neighbours(y, i + 1)) / 2)
            clean += [times[y][i], times[y][i + 1]]
            on.append(times[x][i])
            after_step.append(step_s)
    if len(within) < 4:
        raise SystemExit(f"only {len(within)} detecting iterations without probe rounds timed both ways; "
                         f"raise --overhead-iters")
    cross_mean, cross_half = _mean_ci(cross)
    within_mean, within_half = _mean_ci(within)
    median_off = statistics.median(clean)
    quiet_step_s = statistics.median(after_step)
    probe_round_ms = (round(1e3 * statistics.mean((s - quiet_step_s) / n for s, n in probe_steps), 3)
                      if probe_steps else None)
    return {"detections_paired": len(within), "overhead_pct": _pct(within_mean),
            "ci95_pct": [_pct(within_mean - within_half), _pct(within_mean + within_half)],
            "overhead_pct_with_probes": _pct(statistics.mean(within_all)),
            "probe_rounds": [sum(probed[run].values()) for run in (0, 1)], "probe_round_ms": probe_round_ms,
            "decider_cpu_pct": round(100 * decision_cpu_s / max(decided, 1) / median_off, 3),
            "cross_run_pct": _pct(cross_mean), "cross_run_ci95_pct": [_pct(cross_mean - cross_half),
                                                                      _pct(cross_mean + cross_half)],
            "after_step_pct": (None if elapsed_includes_detection
                               else round(100 * statistics.mean(after_step) / statistics.mean(clean), 3)),
            "judging_pct": round(100 * decision_s / max(decided, 1) / median_off, 3),
            "median_step_s_on": round(statistics.median(on), 4),
            "median_step_s_off": round(median_off, 4),
            "detecting_iteration_pct": _pct(statistics.mean(in_detecting)),
            "next_iteration_pct": _pct(statistics.mean(in_next)), **host_time(logs)}


def host_time(logs: list[Path]) -> dict:
    """The host's share of the alternate-detection runs' iterations and the collector's pauses,
    where the iteration events carry ``cpu_s``, ``gc_s`` and ``gc_full``; else nothing."""
    rows = [e for log in logs for e in events(log, "iteration") if "cpu_s" in e]
    if not rows:
        return {}
    return {"host_busy_pct": round(100 * statistics.median(e["cpu_s"] / e["step_s"] for e in rows), 1),
            "gc_ms_per_iteration": round(1e3 * statistics.mean(e["gc_s"] for e in rows), 3),
            "gc_full": sum(e["gc_full"] for e in rows)}


def pooled_overhead(pairs: list[dict]) -> dict:
    """Detection's cost over several pairs of alternate-detection runs (``paired_overhead`` of
    each), and an interval that counts how far the pairs disagree.

    One pair's interval counts only the spread of its detections. Between pairs, taken minutes
    apart, the host and the device change as well: on one H200, two pairs of the same job read
    4.14% (1.49% to 6.86%) and -0.93% (-3.45% to 1.66%) (``docs/notes/benchmarks.md`` section 37). The
    pooled estimate weighs each pair by its detections; its interval is the wider of the pooled
    within-pair one and a t-interval over the pairs' estimates (with 2 pairs, one degree of freedom,
    so it is wide unless they agree).
    """
    logs = [math.log1p(p["overhead_pct"] / 100) for p in pairs]
    halves = [(math.log1p(p["ci95_pct"][1] / 100) - math.log1p(p["ci95_pct"][0] / 100)) / 2 for p in pairs]
    weights = [p["detections_paired"] for p in pairs]
    total = sum(weights)
    mean = sum(w * x for w, x in zip(weights, logs)) / total
    within = math.sqrt(sum((w * h) ** 2 for w, h in zip(weights, halves))) / total
    between = 0.0
    if len(pairs) > 1:
        between = float(scipy.stats.t.ppf(0.975, len(pairs) - 1)) * statistics.stdev(logs) / math.sqrt(len(pairs))
    half = max(within, between)
    return {"pairs": len(pairs), "detections_paired": total, "overhead_pct": _pct(mean),
            "ci95_pct": [_pct(mean - half), _pct(mean + half)], "pair_overhead_pct": [p["overhead_pct"] for p in pairs],
            "between_pairs_half_pct": round(100 * between, 3), "within_pairs_half_pct": round(100 * within, 3)}


def hook_cost_s(device: str = "cpu", calls: int = 20000) -> float:
    """Seconds the op-timing hook adds to one op: the recorder around a no-op, reading its timings
    after the iteration included (on CUDA, its two events), less the bare call (the fastest of 5
    rounds of each)."""
    from megatron.resihp.schedules import OpRecorder
    from resihp_ext.schedule import OpKind

    recorder = OpRecorder()
    recorder.use_device(device)

    def noop() -> None:
        pass

    def hooked() -> float:
        recorder.start_iteration()
        start = time.perf_counter()
        for _ in range(calls):
            recorder.timed(OpKind.FORWARD, noop)
        recorder.active = False
        recorder.collect()
        return (time.perf_counter() - start) / calls

    def bare() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            noop()
        return (time.perf_counter() - start) / calls

    return max(min(hooked() for _ in range(5)) - min(bare() for _ in range(5)), 0.0)


def median_iteration_s(log: Path, skip: int) -> float:
    return statistics.median(e["elapsed_s"] for e in events(log, "iteration") if e["iteration"] > skip)


def event_counts(log: Path, onset: int | None, slow_rank: int = SLOW_RANK) -> dict:
    sus, clr, ver = events(log, "suspicion"), events(log, "cleared"), events(log, "verdict")
    judged_before = [e for e in events(log, "iteration") if onset is None or e["iteration"] < onset]
    out = {
        "iterations": len(events(log, "iteration")),
        "suspicions": len(sus), "cleared": len(clr), "verdicts": len(ver),
        "healthy_iterations": len(judged_before),
        "suspicions_healthy": sum(1 for s in sus if onset is None or s["iteration"] < onset),
        "verdicts_healthy": sum(1 for v in ver if onset is None or v["evidence"]["suspicion_iteration"] < onset),
        "verdict_list": [{"iteration": v["iteration"], "suspicion_iteration": v["evidence"].get("suspicion_iteration"),
                          "kind": v["kind"], "ranks": v["ranks"], "factor": v["factor"]} for v in ver],
        "suspicion_ratios": [round(s["ratio"], 3) for s in sus],
    }
    n = max(out["healthy_iterations"], 1)
    out["suspicions_per_1000_healthy"] = round(1000.0 * out["suspicions_healthy"] / n, 2)
    out["verdicts_per_1000_healthy"] = round(1000.0 * out["verdicts_healthy"] / n, 2)
    if onset is not None:
        right = [v for v in ver if v["kind"] == "compute" and v["ranks"] == [slow_rank]
                 and v["evidence"].get("suspicion_iteration", -1) >= onset]
        if right:
            v = right[0]
            out["detected"] = {"suspicion_iteration": v["evidence"]["suspicion_iteration"],
                               "latency_iters": v["evidence"]["suspicion_iteration"] - onset,
                               "factor": v["factor"], "first_verdict_is_it": ver[0] is v}
        else:
            out["detected"] = None
    decision = events(log, "detector_overhead")
    if decision:
        out["decision_s_total"] = round(decision[0]["decision_s"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tp2pp2dp2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank (NCCL); with one GPU, use --shape tp1pp1dp1")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--bf16", action="store_true",
                        help="train in bf16; on CUDA with Transformer Engine, packed documents then go through "
                             "TE's THD attention")
    parser.add_argument("--healthy-iters", type=int, default=200)
    parser.add_argument("--slow-iters", type=int, default=40)
    parser.add_argument("--overhead-iters", type=int, default=120,
                        help="iterations of each of the two runs that time detection's cost")
    parser.add_argument("--overhead-repeats", type=int, default=1,
                        help="pairs of alternate-detection runs; with 2 or more the cost is pooled over them and "
                             "its interval counts how far they disagree")
    parser.add_argument("--workdir", help="keep logs and traces here (default: a temporary folder)")
    parser.add_argument("--overhead-only", action="store_true", help="only the measurement of detection's cost")
    args = parser.parse_args()
    if args.overhead_repeats < 1:
        parser.error(f"--overhead-repeats must be at least 1 (one pair of alternate-detection runs), "
                     f"got {args.overhead_repeats}")
    tp, pp, dp = SHAPES[args.shape]
    nproc = tp * pp * dp
    work = Path(args.workdir or tempfile.mkdtemp(prefix="live_detection_"))
    work.mkdir(parents=True, exist_ok=True)
    base = model_args(tp, pp, args.device, args.model) + (["--bf16"] if args.bf16 else [])
    slow_rank = min(SLOW_RANK, nproc - 1)
    hidden, heads, seq = MODELS[args.model]
    out: dict = {"shape": f"TP{tp} x PP{pp} x DP{dp} ({nproc} processes), {args.model} model (hidden {hidden}, "
                          f"{heads} heads, sequence {seq}){', bf16' if args.bf16 else ''}",
                 "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(), "workdir": str(work),
                 "timer_floor": timer_floor()}

    runs = {"healthy": (args.healthy_iters, []),
            "slow": (args.slow_iters, ["--resihp-inject", f"slow:rank={slow_rank},factor={FACTOR},at={ONSET}"])}
    for name, (iters, extra) in ({} if args.overhead_only else runs).items():
        log, trace = work / f"{name}.events.jsonl", work / f"{name}.trace.jsonl"
        log.unlink(missing_ok=True)
        wall = launch(nproc, [*base, "--train-iters", str(iters), "--resihp-detect-only",
                              "--resihp-event-log", str(log), "--resihp-trace", str(trace), *extra])
        out[name] = {"wall_s": round(wall, 1), "median_iteration_s": round(median_iteration_s(log, 3), 4),
                     **event_counts(log, ONSET if extra else None, slow_rank), "loadavg_after": os.getloadavg()}

    # Detection's cost: each detecting iteration and the next timed with detection in one run and
    # clean in the other (``paired_overhead``); the first iterations fit the predictor and, on one
    # stage group, measure probe baselines.
    pairs = []
    for repeat in range(args.overhead_repeats):
        logs = []
        for phase in ALTERNATE_PHASES:
            log = work / f"overhead_{phase.replace(':', '_')}{f'_{repeat}' if repeat else ''}.events.jsonl"
            log.unlink(missing_ok=True)
            launch(nproc, [*base, "--train-iters", str(args.overhead_iters), "--resihp-detect-only",
                           "--resihp-event-log", str(log)], {"RESIHP_ALTERNATE_DETECTION": phase})
            logs.append(log)
        pairs.append(paired_overhead(logs, skip=10, elapsed_includes_detection=True))
    paired = pairs[0]
    if len(pairs) > 1:  # the pairs' figures apart, the pooled estimate in their place
        paired = {**paired, "pair_results": pairs, **pooled_overhead(pairs)}
    # Direct account: the decider's judging, plus the hooks' cost per op times the ops a rank runs
    # per iteration (a forward and a backward per micro-batch of its replica).
    ops_per_iteration = 2 * (GLOBAL_BATCH // MICRO_BATCH) // dp
    hooks_pct = 100 * hook_cost_s(args.device) * ops_per_iteration / paired["median_step_s_off"]
    paired.update(hooks_pct=round(hooks_pct, 4), direct_pct=round(paired["judging_pct"] + hooks_pct, 3))
    out["detection_overhead"] = {**paired, "loadavg_after": os.getloadavg()}
    (work / "detection_overhead.json").write_text(json.dumps(out["detection_overhead"]))

    if args.overhead_only:
        out["loadavg_end"] = os.getloadavg()
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
        return
    det = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "detection.py"), "--json",
                          "--healthy-iters", "20", "--fault-iters", "48",
                          "--overhead-from", str(work / "detection_overhead.json"),
                          "--trace", str(work / "healthy.trace.jsonl"), "--trace", str(work / "slow.trace.jsonl")],
                         cwd=REPO, capture_output=True, text=True, env=job_env())
    if det.returncode:
        raise SystemExit(f"detection.py failed:\n{det.stderr[-3000:]}")
    live = json.loads(det.stdout)["live"]
    out["replay"] = {name: live[str(work / f"{name}.trace.jsonl")] for name in ("healthy", "slow")}
    out["loadavg_end"] = os.getloadavg()

    if args.json:
        print(json.dumps(out))
        return
    print(f"shape {out['shape']}, {out['cpu_count']} CPUs, load average at start {out['loadavg_start']}")
    for name in ("healthy", "slow"):
        r = out[name]
        print(f"\n[{name}] {r['iterations']} iterations, median {r['median_iteration_s']} s/iteration, wall {r['wall_s']} s, "
              f"load after {r['loadavg_after']}")
        print(f"  live events: {r['suspicions']} suspicions, {r['cleared']} cleared, {r['verdicts']} verdicts; "
              f"before onset: {r['suspicions_per_1000_healthy']} suspicions / 1000, {r['verdicts_per_1000_healthy']} verdicts / 1000")
        for v in r["verdict_list"]:
            print(f"    verdict {v}")
        if name == "slow":
            print(f"  rank {slow_rank} named: {r['detected']}")
        for det_name in ("resihp", "greyhound", "nvrx"):
            b = out["replay"][name][det_name]
            print(f"  replay {det_name:<9} FA/1000 {b['false_alarms_per_1000']:>7} detected {b['detected']} "
                  f"latency {b['detection_latency_iters']} localisation {b['localisation_accuracy']}")
        ours = out["replay"][name]["resihp"]
        print(f"  predictor MAPE: micro-batch {ours['mtp_mape']}%, iteration {ours['itp_mape']}% (without speed levels "
              f"{ours['mtp_mape_without_levels']}%, {ours['itp_mape_without_levels']}%); "
              f"decision {ours['decision_ms_per_iter']} ms/iteration")
        if ours["same_work_mape"] is None:
            print("  no work repeated 8 times in this run (same stage, kind, features), so no same-run floor")
        else:
            print(f"  ops that did identical work in this run (same stage, kind, features; before any fault) "
                  f"spread {ours['same_work_mape']}% around their median")
        floor = out["timer_floor"]
        print(f"  timing floor of this host: a fixed {floor['op_ms']} ms op, timed alone, repeats with MAPE "
              f"{floor['mape_pct']}% (CV {floor['cv_pct']}%)")
    h = out["detection_overhead"]
    print(f"\ndetection on/off, {h['detections_paired']} detections timed with the next iteration against the same "
          f"iterations clean: overhead {h['overhead_pct']}% of an iteration "
          f"(95% interval {h['ci95_pct']}), within runs; across runs {h['cross_run_pct']}% "
          f"(95% interval {h['cross_run_ci95_pct']}); median iteration {h['median_step_s_on']} / "
          f"{h['median_step_s_off']} s; timed directly, the decider's judging took {h['judging_pct']}% of an "
          f"iteration ({h['decider_cpu_pct']}% in CPU), the hooks {h['hooks_pct']}%: {h['direct_pct']}% in all")
    if "pair_results" in h:
        print(f"that estimate is pooled over {h['pairs']} pairs of runs, which read {h['pair_overhead_pct']}%; its "
              f"interval's half width is the wider of {h['between_pairs_half_pct']}% between the pairs and "
              f"{h['within_pairs_half_pct']}% within them; the other figures are the first pair's")
    print(f"where it lay: the detecting iteration (its training and detection steps) {h['detecting_iteration_pct']}%, "
          f"the next iteration {h['next_iteration_pct']}%")
    if "host_busy_pct" in h:
        print(f"the host was busy {h['host_busy_pct']}% of an iteration (median); the collector paused "
              f"{h['gc_ms_per_iteration']} ms per iteration, with {h['gc_full']} full collections")
    if h["probe_round_ms"] is not None:
        print(f"detecting iterations with probe rounds, left out of the above: {h['probe_rounds']} rounds in the two "
              f"runs, {h['probe_round_ms']} ms each; the estimate with them in: {h['overhead_pct_with_probes']}%")
    print(f"load average at end {out['loadavg_end']}")


if __name__ == "__main__":
    main()
