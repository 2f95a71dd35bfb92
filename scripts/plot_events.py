"""A picture of one run: iteration time over iterations, with what the resilience layer did marked.

Reads the JSONL event log any run writes (``--resihp-event-log``) and draws, over the iterations,
each iteration's training step (``elapsed_s``) and the wall time between consecutive iterations'
ends (which also holds detection, probes, re-plans and recoveries), with a marker at each injected
fault and its end, each suspicion, verdict and cleared suspicion, each re-plan, each in-place
adaptation, each standby and each fallback to a checkpoint. It prints one line per marker drawn.
It only reads the log and writes the picture: nothing about the run is computed beyond what the
events say.

    python scripts/plot_events.py EVENTS.jsonl -o run.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Marker:
    """One mark on the picture: an event kind at an iteration, with the text beside it."""

    kind: str
    iteration: int
    label: str


# Event kind -> (legend title, colour, line style). The order is the legend's.
STYLES = {
    "inject": ("fault injected", "tab:red", "-"),
    "inject_end": ("fault ends", "tab:green", "-"),
    "suspicion": ("suspicion", "tab:orange", ":"),
    "verdict": ("verdict", "tab:purple", "--"),
    "cleared": ("suspicion cleared", "tab:gray", ":"),
    "plan": ("re-plan", "tab:blue", "--"),
    "adapted": ("adapted in place", "tab:blue", "-"),
    "standby": ("rank stands by", "tab:cyan", "-."),
    "fallback_checkpoint": ("fallback to checkpoint", "black", "-"),
}


class BadInput(Exception):
    """The log or the output path cannot be used; the message names which and the fix."""


def read_events(path: Path) -> list[dict]:
    """Every record of a JSONL event log.

    Raises:
        BadInput: the file is missing or unreadable, or a line is not a JSON object.
    """
    try:
        text = path.read_text()
    except OSError as error:
        raise BadInput(f"cannot read {path} ({error.strerror}); give the file a run wrote with "
                       f"--resihp-event-log") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise BadInput(f"{path} is not a JSONL event log (line {number}: {error.msg}); give the file a run "
                           f"wrote with --resihp-event-log") from None
        if not isinstance(record, dict) or "event" not in record:
            raise BadInput(f"{path} line {number} is not an event (no \"event\" field); give the file a run "
                           f"wrote with --resihp-event-log")
        records.append(record)
    return records


def iteration_times(records: list[dict]) -> tuple[list[int], list[float], list[tuple[int, float]]]:
    """Iterations in order, their step seconds, and the wall seconds since the previous one ended.

    A redone iteration (after a fail-stop) counts once, its last run.

    Raises:
        BadInput: the log holds no ``iteration`` event with ``elapsed_s``.
    """
    last: dict[int, dict] = {}
    for r in sorted((r for r in records if r["event"] == "iteration" and "elapsed_s" in r),
                    key=lambda r: r.get("time", 0.0)):
        last[int(r["iteration"])] = r
    if not last:
        raise BadInput("the log has no iteration event with elapsed_s: the run wrote none (it stopped before "
                       "its first iteration, or this is not the log of the job's last rank)")
    iterations = sorted(last)
    gaps = [(i, last[i]["time"] - last[prev]["time"]) for prev, i in zip(iterations, iterations[1:])
            if "time" in last[i] and "time" in last[prev]]
    return iterations, [float(last[i]["elapsed_s"]) for i in iterations], gaps


def markers(records: list[dict]) -> list[Marker]:
    """The marks to draw, in iteration order, each once (every rank with a fault logs its
    ``inject``, and every survivor the same ``dead`` verdict).

    A mark stands at the iteration during which its event was logged (the first iteration that
    ended after it), not at the ``iteration`` field: a verdict's field is where the slowdown began,
    so it is named in the label instead. An event logged after the last iteration keeps its field.
    """
    ends = sorted((r["time"], int(r["iteration"])) for r in records
                  if r["event"] == "iteration" and "time" in r and "elapsed_s" in r)
    seen, out = set(), []
    for r in records:
        kind = r["event"]
        if kind not in STYLES:
            continue
        at = next((i for t, i in ends if t > r["time"]), None) if "time" in r else None
        marker = Marker(kind, int(r.get("iteration", 0)) if at is None else at, _label(r))
        if marker not in seen:
            seen.add(marker)
            out.append(marker)
    return sorted(out, key=lambda m: (m.iteration, list(STYLES).index(m.kind)))


def _label(r: dict) -> str:
    kind = r["event"]
    if kind in ("inject", "inject_end"):
        return str(r.get("fault", ""))
    ranks = ",".join(str(x) for x in r.get("ranks", []))
    if kind == "suspicion":
        return f"{r.get('kind', '')} ranks {ranks} x{r.get('ratio', '?')} since {r.get('onset_iteration', '?')}"
    if kind == "verdict":
        factor = r.get("factor")
        return (f"{r.get('kind', '')} ranks {ranks}" + ("" if factor is None else f" x{factor}")
                + f" since {r.get('iteration', '?')}")
    if kind == "cleared":
        return f"ranks {ranks}"
    if kind == "plan":
        return f"{r.get('policy') or ''} {r.get('action', '')}".strip()
    if kind == "adapted":
        duration = r.get("duration_s")
        return f"world {r.get('world_size', '?')}" + ("" if duration is None else f", {duration:.2f} s")
    if kind == "standby":
        return f"launch rank {r.get('launch_rank', '?')}"
    return str(r.get("reason", ""))[:60]


def _short(m: Marker) -> str:
    """A marker's text on the picture: a fault's spec without its timing (the lane shows when)."""
    if m.kind in ("inject", "inject_end"):
        kind, _, fields = m.label.partition(":")
        kept = [f for f in fields.split(",") if f.split("=")[0] in ("rank", "src", "dst", "factor")]
        return f"{kind} {','.join(kept)}".strip()
    return m.label


def draw(records: list[dict], output: Path, title: str | None = None) -> list[Marker]:
    """Draw the picture of ``records`` into ``output`` (PNG); returns the markers drawn.

    Above, iteration times with a thin line at each marker; below, one lane per event kind, each
    marker labelled, so marks at nearby iterations stay readable."""
    iterations, step_s, gaps = iteration_times(records)
    marks = markers(records)
    import matplotlib  # noqa: PLC0415 - only drawing needs it; input errors come first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    lanes = [kind for kind in STYLES if any(m.kind == kind for m in marks)]
    fig, (ax, lane_ax) = plt.subplots(
        2, 1, sharex=True, figsize=(11, 4.2 + 0.35 * len(lanes)), dpi=110,
        gridspec_kw={"height_ratios": [3.0, 0.5 + 0.35 * max(len(lanes), 1)]})
    ax.plot(iterations, step_s, "-o", color="black", markersize=3, linewidth=1.2, label="training step (elapsed_s)")
    if gaps:
        ax.plot([i for i, _ in gaps], [g for _, g in gaps], color="0.6", linewidth=1.0,
                label="wall time between iteration ends")
    for m in marks:
        _, colour, style = STYLES[m.kind]
        ax.axvline(m.iteration, color=colour, linestyle=style, linewidth=1.0, alpha=0.6)
    ax.set_ylabel("seconds")
    ax.set_ylim(0, max([*step_s, *(g for _, g in gaps)]) * 1.08)
    ax.set_title(title or "iteration time and resilience events")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    for row, kind in enumerate(reversed(lanes)):
        _, colour, _ = STYLES[kind]
        for m in (m for m in marks if m.kind == kind):
            lane_ax.plot([m.iteration], [row], "o", color=colour, markersize=6)
            lane_ax.annotate(_short(m), (m.iteration, row), fontsize=7, color=colour, ha="left", va="center",
                             xytext=(5, 0), textcoords="offset points")
    lane_ax.set_yticks(range(len(lanes)), [STYLES[kind][0] for kind in reversed(lanes)], fontsize=8)
    lane_ax.set_ylim(-0.6, len(lanes) - 0.4)
    lane_ax.set_xlabel("iteration")
    lane_ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, format="png")
    plt.close(fig)
    return marks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", type=Path, help="the run's --resihp-event-log (JSONL)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", help="the picture's title")
    args = parser.parse_args(argv)
    try:
        if args.output.suffix.lower() != ".png":
            raise BadInput(f"-o {args.output}: the picture is a PNG; give a path ending in .png")
        if not args.output.parent.is_dir():
            raise BadInput(f"-o {args.output}: folder {args.output.parent} does not exist; create it first")
        records = read_events(args.events)
        try:  # refuse a log without iterations, or with fields of the wrong type, before drawing
            iteration_times(records)
            markers(records)
        except (KeyError, TypeError, ValueError) as error:
            raise BadInput(f"{args.events} has an event with a missing or malformed field ({error!r}); give the "
                           f"file a run wrote with --resihp-event-log") from None
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            raise BadInput("matplotlib is not installed; python -m pip install matplotlib") from None
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    marks = draw(records, args.output, args.title)
    for m in marks:
        print(f"{m.kind:<20} iteration {m.iteration:>5}  {m.label}")
    print(f"wrote {args.output} ({os.path.getsize(args.output)} bytes, {len(marks)} markers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
