"""The planner's predicted iteration time against the measured one, before and after each re-plan.

Every ``plan`` event a live job writes carries what the planner's simulator predicted for one
iteration if nothing changed (``predicted_iteration_s_before``) and under the plan
(``predicted_iteration_s_after``; a fail-stop plan has both in ``executed``). The job's
``iteration`` events carry what each iteration measured (``elapsed_s``). This script runs a live CPU
job on Megatron-LM's loop (``adaptation.py``'s TP2 x PP2 x DP2 job with packed variable-length
documents) that emulates one device per rank (``--cpu-device-time-scale``, so a slow rank bounds its
pipeline as on GPUs and the cores do not), with one rank slowed and later fast again, and prints,
per re-plan, predicted and measured iteration seconds on both sides and their error as a ratio
against the measurement (goal: within 5%).

Measured windows: "before" is the iterations since the last change (a fault starting or ending, or
the previous re-plan) up to the re-plan's iteration, "after" those from the re-plan's iteration + 2
(the first one on a new layout pays for its rebuild) up to the next change; the first iteration
after a change is left out of both, and each window's median is what is compared.

    python scripts/bench/simulator_check.py [--json] [--iters 40] [--factor 2.0] [--slow-rank 7]
        [--slow-at 10] [--recover-at 22] [--device-time-scale 16] [--workdir DIR]
    python scripts/bench/simulator_check.py --events EVENTS.jsonl   # an existing log, no run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GOAL = 0.05  # the bound on the simulator's error


@dataclass(frozen=True)
class Comparison:
    """One plan's predictions beside the same run's measurements (seconds per iteration).

    ``*_window`` is ``[first, last]`` measured iteration; a side with no iteration to measure has
    ``None`` for its measurement and error."""

    plan_iteration: int
    action: str
    policy: str | None
    predicted_before_s: float | None
    measured_before_s: float | None
    before_window: tuple[int, int] | None
    predicted_after_s: float | None
    measured_after_s: float | None
    after_window: tuple[int, int] | None

    @property
    def error_before(self) -> float | None:
        return _error(self.predicted_before_s, self.measured_before_s)

    @property
    def error_after(self) -> float | None:
        return _error(self.predicted_after_s, self.measured_after_s)

    @property
    def unpredicted_s(self) -> tuple[float | None, float | None]:
        """Measured minus predicted seconds, before and after: what the simulator does not model
        (work outside the timed ops) shows as a similar amount on both sides."""
        return (_gap(self.predicted_before_s, self.measured_before_s),
                _gap(self.predicted_after_s, self.measured_after_s))

    def to_dict(self) -> dict:
        before, after = self.unpredicted_s
        return {**asdict(self), "error_before": _round(self.error_before), "error_after": _round(self.error_after),
                "unpredicted_before_s": _round(before), "unpredicted_after_s": _round(after)}


def _error(predicted: float | None, measured: float | None) -> float | None:
    """Predicted over measured, minus one (+0.05: the simulator said 5% slower than it ran)."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return predicted / measured - 1.0


def _gap(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or measured is None else measured - predicted


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _predictions(plan: dict) -> tuple[float | None, float | None]:
    if "predicted_iteration_s_before" in plan or "predicted_iteration_s_after" in plan:
        return plan.get("predicted_iteration_s_before"), plan.get("predicted_iteration_s_after")
    executed = plan.get("executed") or {}
    return executed.get("iteration_s_before"), executed.get("iteration_s_after")


def compare(records: list[dict]) -> list[Comparison]:
    """Each plan event with a prediction, beside the medians measured around it.

    Args:
        records: a job's event log, one dict per line (every rank's lines, in any order).

    Returns:
        One Comparison per plan that carries a predicted iteration time, in iteration order.
    """
    elapsed: dict[int, float] = {}
    for r in sorted((r for r in records if r.get("event") == "iteration"), key=lambda r: r.get("time", 0.0)):
        elapsed[int(r["iteration"])] = float(r["elapsed_s"])  # a redone iteration: its last run counts
    plans = sorted((r for r in records if r.get("event") == "plan" and any(v is not None for v in _predictions(r))),
                   key=lambda r: r["iteration"])
    # Where the job's speed changes: a fault starts or ends before iteration I runs (I is the first
    # iteration that has it), a plan at iteration P changes the layout from P + 1 on.
    changes = sorted({int(r["iteration"]) for r in records if r.get("event") in ("inject", "inject_end")}
                     | {int(p["iteration"]) + 1 for p in plans})
    out = []
    for plan in plans:
        p = int(plan["iteration"])
        since = max((c for c in changes if c <= p), default=min(elapsed, default=0))
        until = min((c for c in changes if c > p + 1), default=max(elapsed, default=p) + 1)
        before = _window(elapsed, since + 1, p)
        after = _window(elapsed, p + 2, until - 1)
        predicted_before, predicted_after = _predictions(plan)
        out.append(Comparison(
            plan_iteration=p, action=str(plan.get("action")), policy=plan.get("policy"),
            predicted_before_s=predicted_before, measured_before_s=before[0], before_window=before[1],
            predicted_after_s=predicted_after, measured_after_s=after[0], after_window=after[1]))
    return out


def _window(elapsed: dict[int, float], first: int, last: int) -> tuple[float | None, tuple[int, int] | None]:
    times = [elapsed[i] for i in range(first, last + 1) if i in elapsed]
    if not times:
        return None, None
    return statistics.median(times), (first, last)


def read_log(path: Path) -> list[dict]:
    """Every record of a JSONL event log; a bad file exits 2 with one message."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise SystemExit(_refuse(f"--events: cannot read {path} ({error.strerror}); give a run's --resihp-event-log"))
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as error:
        raise SystemExit(_refuse(f"--events: {path} is not JSONL (line {error.lineno}: {error.msg}); "
                                 f"give a run's --resihp-event-log"))


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_job(args, work: Path) -> Path:
    """The live job: one rank slowed, then fast again, adapted in place; returns its event log."""
    from scripts.bench.adaptation import MODEL, PACKED_DOCUMENTS, launch  # noqa: PLC0415 - only a live run needs them
    log = work / "simulator_check.events.jsonl"
    log.unlink(missing_ok=True)
    spec = f"slow:rank={args.slow_rank},factor={args.factor},at={args.slow_at}"
    if args.recover_at:
        spec += f",until={args.recover_at}"
    launch([*MODEL, *PACKED_DOCUMENTS, "--global-batch-size", str(args.global_batch), "--train-iters", str(args.iters),
            "--cpu-device-time-scale", str(args.device_time_scale), "--resihp-event-log", str(log),
            "--resihp-enable", "--resihp-inject", spec])
    return log


def _fmt(value: float | None, pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def _fmt_window(window) -> str:
    return "-" if window is None else f"{window[0]}-{window[1]}"


def report(rows: list[Comparison]) -> None:
    print(f"{'plan at':>7} {'action':>6}  {'predicted':>9} {'measured':>8} {'error':>7} {'its.':>6}"
          f"  {'predicted':>9} {'measured':>8} {'error':>7} {'its.':>6}")
    print(f"{'':>7} {'':>6}  {'--- before the re-plan (s/it.) ---':>34}  {'--- after (s/it.) ---':>34}")
    for row in rows:
        print(f"{row.plan_iteration:>7} {row.action:>6}  {_fmt(row.predicted_before_s):>9} "
              f"{_fmt(row.measured_before_s):>8} {_fmt(row.error_before, '{:+.1%}'):>7} "
              f"{_fmt_window(row.before_window):>6}  {_fmt(row.predicted_after_s):>9} "
              f"{_fmt(row.measured_after_s):>8} {_fmt(row.error_after, '{:+.1%}'):>7} {_fmt_window(row.after_window):>6}")
    gaps = [g for row in rows for g in row.unpredicted_s if g is not None]
    if gaps:
        print(f"measured - predicted: {', '.join(f'{g:+.3f}' for g in gaps)} s per iteration")
    errors = [abs(e) for row in rows for e in (row.error_before, row.error_after) if e is not None]
    if errors:
        print(f"largest |error| {max(errors):.1%}; goal {GOAL:.0%}: "
              f"{'met' if max(errors) <= GOAL else 'not met'} ({sum(e <= GOAL for e in errors)} of {len(errors)} within)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=Path, help="compare the plans of this event log instead of running a job")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--factor", type=float, default=2.0, help="slowdown of --slow-rank")
    parser.add_argument("--slow-rank", type=int, default=7,
                        help="rank slowed (7: TP rank 1 of the last stage of replica 1, of 8)")
    parser.add_argument("--slow-at", type=int, default=10)
    parser.add_argument("--recover-at", type=int, default=22,
                        help="iteration from which --slow-rank is fast again (0: slow to the end)")
    parser.add_argument("--global-batch", type=int, default=32, help="8 micro-batches per replica")
    parser.add_argument("--device-time-scale", type=float, default=16.0,
                        help="--cpu-device-time-scale: one emulated device per rank, this many times slower than a core")
    parser.add_argument("--workdir", help="keep the event log here (default: a temporary folder)")
    args = parser.parse_args()
    if args.events is None:
        if not 0 <= args.slow_rank < 8:
            parser.error(f"--slow-rank takes a rank 0-7 of the 8-process job; got {args.slow_rank}")
        if args.recover_at and not args.slow_at < args.recover_at < args.iters:
            parser.error(f"--recover-at must lie between --slow-at ({args.slow_at}) and --iters ({args.iters}); "
                         f"got {args.recover_at}, or 0 to keep the rank slow")
        if args.device_time_scale <= 0:
            parser.error("--device-time-scale must be > 0: without emulated devices the cores, not the plan, "
                         "bound the job")
        work = Path(args.workdir or tempfile.mkdtemp(prefix="simulator_check_"))
        work.mkdir(parents=True, exist_ok=True)
        log = run_job(args, work)
    else:
        log = args.events
    records = read_log(log)
    try:
        rows = compare(records)
    except (KeyError, TypeError, ValueError) as error:
        raise SystemExit(_refuse(f"{log}: an event has a missing or malformed field ({error!r}); "
                                 f"give a run's --resihp-event-log")) from None
    if not rows:
        raise SystemExit(_refuse(f"{log}: no plan event with a predicted iteration time; "
                                 f"the job re-planned nothing (give a run with --resihp-enable and a fault)"))
    # The host's load says how busy the shared cores were, which only means something right after a run.
    load = None if args.events else os.getloadavg()
    if args.json:
        print(json.dumps({"events": str(log), "loadavg_after_run": load, "goal": GOAL,
                          "plans": [row.to_dict() for row in rows]}))
        return
    print(f"event log {log}" + ("" if load is None else f"; load average after the run {load}"))
    report(rows)


if __name__ == "__main__":
    main()
