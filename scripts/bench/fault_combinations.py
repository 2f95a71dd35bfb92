"""Fault combinations: a second fault around a dropped and readmitted replica, and faults of the
processes beside the ranks (a rank's heartbeat beacon, the launcher's rank fork server).

Runs a TP1 x PP2 x DP2 job on Megatron-LM's loop (4 gloo processes, tiny GPT, dropout off, 32
iterations of global batch 8) under ``scripts/launch_local.py`` with ``--resihp-enable``, once
failure-free and once per case, and prints one row per case:

    case -> outcome (exit code, losses against the failure-free run's) -> launch seconds

* around a readmission: launch rank 3 runs 16x slow from iteration 5 until 14, replica 1 (ranks 1
  and 3) is dropped and stands by, and is taken back once healthy; then both standbys SIGKILLed,
  a standby SIGTERMed, a working rank SIGSTOPped or SIGKILLed after the readmission, a working
  rank killed as the readmission forms (before any state moved: the job falls back by design, the
  stage's only current holder being gone);
* beside the ranks: rank 2's beacon (its first child, the process that publishes its heartbeat)
  SIGKILLed, alone, then with the rank SIGKILLed or SIGSTOPped later; the rank fork server (every
  rank's parent) SIGKILLed, alone and then with a rank SIGKILLed later.

Signals are sent from outside by pid, the ranks' pids read from the event log's ``start`` events.
Outcomes: ``in place, exact`` (exit 0, every iteration's loss equal to the failure-free run's
within 1e-5), ``in place, differs``, ``fallback`` (exit 3 with a resume command), ``failed (exit
N)``, ``hung`` (the launch still ran at ``--timeout-s`` and was killed).

    python scripts/bench/fault_combinations.py [--cases TEXT ...] [--list] [--json] [--workdir D] [--timeout-s 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402
from scripts.bench.case_choice import add_case_arguments, chosen_cases, work_folder  # noqa: E402
from scripts.bench.event_losses import iteration_losses, same_losses  # noqa: E402
from scripts.signal_rank import events  # noqa: E402

NPROC, ITERS = 4, 32
MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--weight-decay", "0.1", "--init-method-std", "0.02",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--split", "99,1,0", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--save-interval", "1000", "--ckpt-format", "torch", "--resihp-enable",
]
# Replica 1 dropped at its verdict and taken back once healthy; standbys probe every 0.1 s, and no
# re-plan is on trial, so the readmission comes early enough to be struck after.
DROPPED = ["--resihp-inject", "slow:rank=3,factor=16,at=5,until=14", "--resihp-verify-iters", "0",
           "--resihp-standby-probe-interval-s", "0.1"]


@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...] = ()
    strikes: tuple[tuple[str, int, str, int], ...] = ()  # (when, at, what, signal), in order


def _iteration(log: Path) -> int:
    return max((e["iteration"] for e in events(log, "iteration")), default=0)


def _readmitted(log: Path) -> int | None:
    grown = [a for a in events(log, "adapted") if a.get("joined_launch_ranks")]
    return grown[0]["iteration"] if grown else None


def _dropped(log: Path) -> bool:
    return any(a.get("world_size") == 2 for a in events(log, "adapted"))


def _pid(log: Path, what: str) -> list[int]:
    """The pids ``what`` names: ``rank R``, ``beacon R`` (rank R's first child) or ``fork server``."""
    ranks = {e["rank"]: e["pid"] for e in events(log, "start")}
    if what == "fork server":
        return [_parent(ranks[0])]
    kind, _, rank = what.partition(" ")
    if kind == "ranks":
        return [ranks[int(r)] for r in rank.split(",")]
    if kind == "beacon":
        return [_children(ranks[int(rank)])[0]]  # forked by the rank before anything else
    return [ranks[int(rank)]]


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (state, parent, ...; start time at 19)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _children(pid: int) -> list[int]:
    """``pid``'s children, the first started first."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return sorted(kids, key=lambda k: int(_stat(k)[19]))


def _reached(log: Path, when: str, at: int) -> bool:
    """``when``: "iteration" (iteration ``at`` logged), "dropped" (replica 1 left out and iteration
    ``at`` logged), "readmitted" (``at`` iterations logged after the readmission)."""
    if when == "dropped":
        return _dropped(log) and _iteration(log) >= at
    if when == "readmitted":
        back = _readmitted(log)
        return back is not None and _iteration(log) >= back + at
    return _iteration(log) >= at


def cases() -> list[Case]:
    kill, term, stop = signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP
    return [
        Case("both standbys SIGKILLed after 13", tuple(DROPPED), (("dropped", 13, "ranks 1,3", kill),)),
        Case("standby 1 SIGTERMed after 13", tuple(DROPPED), (("dropped", 13, "rank 1", term),)),
        Case("working rank 2 SIGSTOPped 2 after the readmission", tuple(DROPPED), (("readmitted", 2, "rank 2", stop),)),
        Case("working rank 0 SIGKILLed 2 after the readmission", tuple(DROPPED), (("readmitted", 2, "rank 0", kill),)),
        Case("working rank 0 killed as the readmission forms",
             (*DROPPED, "--resihp-inject", "kill:rank=0,at=1,during=readmission")),
        Case("rank 2's beacon SIGKILLed at 6", (), (("iteration", 6, "beacon 2", kill),)),
        Case("rank 2's beacon SIGKILLed at 6, rank 2 SIGKILLed at 10", (),
             (("iteration", 6, "beacon 2", kill), ("iteration", 10, "rank 2", kill))),
        Case("rank 2's beacon SIGKILLed at 6, rank 2 SIGSTOPped at 10", (),
             (("iteration", 6, "beacon 2", kill), ("iteration", 10, "rank 2", stop))),
        Case("the rank fork server SIGKILLed at 6", (), (("iteration", 6, "fork server", kill),)),
        Case("the rank fork server SIGKILLed at 6, rank 2 SIGKILLed at 10", (),
             (("iteration", 6, "fork server", kill), ("iteration", 10, "rank 2", kill))),
    ]


def run(case: Case | None, work: Path, timeout_s: float) -> dict:
    """One launch; ``case`` None is the failure-free reference."""
    name = "reference" if case is None else case.name.replace(" ", "_").replace(",", "").replace("'", "")
    log = work / f"{name}.events.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={NPROC}",
           str(REPO / "pretrain_gpt_resilient.py"), *MODEL, "--save", str(work / f"{name}_ckpt"),
           "--resihp-event-log", str(log), *(case.flags if case else ())]
    struck, hung = [], False
    started = time.monotonic()
    # Output to a file: a pipe nobody reads while this waits would fill and stall the job.
    with open(work / f"{name}.out", "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=sink, stderr=subprocess.STDOUT)
        try:
            for when, at, what, sig in (case.strikes if case else ()):
                while proc.poll() is None and not _reached(log, when, at):
                    time.sleep(0.02)
                if proc.poll() is not None:
                    break
                for pid in _pid(log, what):
                    os.kill(pid, sig)
                struck.append(f"{signal.Signals(sig).name} {what} at {_iteration(log)}")
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"log": log, "code": proc.returncode, "hung": hung, "seconds": round(time.monotonic() - started, 1),
            "struck": struck, "strikes": len(case.strikes) if case else 0}


def judge(result: dict, reference: dict[int, float]) -> dict:
    exact = same_losses(iteration_losses(result["log"]), reference, ITERS)
    code = result["code"]
    if result["hung"]:
        outcome = f"hung ({'every loss exact' if exact else 'losses differ'})"
    elif code == 0:
        outcome = "in place, exact" if exact else "in place, differs"
    elif code == 3:
        outcome = "fallback"
    else:
        outcome = f"failed (exit {code})"
    if len(result["struck"]) < result["strikes"]:
        outcome += f" ({result['strikes'] - len(result['struck'])} strikes never came)"
    return {"outcome": outcome, "exit_code": code, "launch_s": result["seconds"], "struck": result["struck"],
            "verdicts": sorted({v["kind"] for v in events(result["log"], "verdict")}),
            "adaptations": len(events(result["log"], "adapted"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="a launch still running after this long is killed and called hung")
    args = parser.parse_args()
    every = cases()
    chosen = chosen_cases(parser, args, every)
    if not chosen:
        return
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive; got {args.timeout_s:g}")
    work = work_folder(args, "fault_combinations_")
    reference_run = run(None, work, args.timeout_s)
    if reference_run["code"] != 0:
        raise SystemExit(f"failure-free run failed ({reference_run['code']}); its output: {work / 'reference.out'}")
    reference = iteration_losses(reference_run["log"])
    rows = []
    for case in chosen:
        row = {"case": case.name, **judge(run(case, work, args.timeout_s), reference)}
        rows.append(row)
        if not args.json:
            print(f"{case.name:<60} {row['outcome']:<20} {row['launch_s']:>6.1f} s  (verdicts {row['verdicts']}, "
                  f"adaptations {row['adaptations']}; {'; '.join(row['struck']) or 'no signal sent'})", flush=True)
    if args.json:
        print(json.dumps({"workdir": str(work), "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
