"""Fault matrix: each kind of failure at each moment it can strike, and what the job made of it.

Runs a TP2 x PP2 x DP2 job (8 gloo processes, tiny GPT, dropout off, 8 iterations of global batch
16, a checkpoint every 2 iterations) once failure-free and once per case, under
``scripts/launch_local.py`` with ``--resihp-enable`` and default flags, and prints one row per case:

    case -> outcome -> recovery time

* signals sent from outside to a rank's process (its pid is in the event log): SIGKILL, SIGTERM
  and SIGSTOP, each at three moments of iteration 4 (early, middle and late in the iteration:
  forward, backward, the gradient sync and the optimizer step, as this job's iteration spreads
  them);
* kills injected at named phases (``--resihp-inject kill:...,during=PHASE``): the checkpoint save's
  four phases, the end of a finished job, and a second failure in each phase of a recovery;
* a rank hung in Python (``hang:``), named once it has worked without progress for ``--resihp-hang-iters``
  iterations while the others wait for it (``megatron/resihp/hang_rules.py``);
* cascades: a second and a third kill after the first adaptation.

Outcomes: ``in place, exact`` (exit 0, losses of every iteration equal the failure-free run's
within 1e-5 and consumed samples exact), ``in place, differs``, ``fallback`` (exit 3 with a resume
command), or ``failed (exit N)``. Recovery time: from the fault (the signal, or the ``inject``
event) to the first iteration finished after the last adaptation.

    python scripts/bench/fault_matrix.py [--loop resihp|megatron] [--distributed-optimizer] [--json]
        [--cases NAME ...] [--list]

``--loop megatron`` runs the same job on Megatron-LM's own loop (``--resihp-loop megatron``,
checkpoints in Megatron's torch format, an evaluation every 2 iterations), with the faults that
loop takes: the signals, kills as a rank's optimizer step returns, as the iteration is logged, as
an evaluation and a save begin and once a rank's checkpoint files are written, as the job ends, a
second failure in a recovery's re-form and rendezvous, an error of one rank's own raised in its forward, backward or optimizer step
(``raise:``: that rank leaves, exit 4, and the others go on as after a kill), a hang, and the
cascades (after the first kill one replica goes on and the other's ranks stand by as spares; a
second kill then takes a shard no live rank holds, spares or not, so it falls back). Megatron logs no loss for an iteration whose step finished
before the failure surfaced on the logging rank: such an iteration counts as exact when every
loss logged matches (the table says how many were not logged).

``--distributed-optimizer`` (with ``--loop megatron``) runs every job with ``--use-distributed-optimizer``,
where a dead rank's part of the optimizer state comes from its copy on another rank, and adds a
kill between a rank's update and its copy (``during=update``), which the survivors undo: every part goes back
to the update before, and the iteration runs again.

Not covered (yet): an exception raised inside one rank's step on the resihp loop, and failures
before the first iteration (model build, checkpoint load, the loaders' set-up). The store host's death is not a case here: the store lives in
the launcher, whose ranks die with it; ``tests/dist/test_megatron_loop_resilience.py`` kills
torchrun's agent, whose ranks outlive it, instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402
from scripts.signal_rank import events, run_and_signal  # noqa: E402
from resihp_ext.faults import RAISE_PHASES  # noqa: E402

NPROC, ITERS, GLOBAL_BATCH = 8, 8, 16
MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
    "--pipeline-model-parallel-size", "2", "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERS),
    "--save-interval", "2",
]


@dataclass(frozen=True)
class Case:
    name: str
    inject: tuple[str, ...] = ()  # --resihp-inject specs
    signal: int | None = None  # sent from outside to rank 5 during iteration 4
    at_fraction: float = 0.5  # how far into iteration 4, as a fraction of a median iteration


MEGATRON_MODEL = [
    *MODEL, "--ckpt-format", "torch", "--split", "99,1,0", "--eval-interval", "2", "--eval-iters", "1",
    "--resihp-loop", "megatron",
]


def cases(loop: str = "resihp", distributed_optimizer: bool = False) -> list[Case]:
    if loop == "megatron":
        return megatron_cases(distributed_optimizer)
    out = []
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
        for label, fraction in (("early", 0.1), ("middle", 0.5), ("late", 0.9)):
            out.append(Case(f"{sig.name} {label} in iteration 4", signal=sig, at_fraction=fraction))
    for phase, rank in (("save", 3), ("save-write", 2), ("save-rename", 0), ("save-tracker", 0)):
        out.append(Case(f"kill rank {rank} during {phase} at 4", (f"kill:rank={rank},at=4,during={phase}",)))
    out.append(Case("kill rank 3 during shutdown", ("kill:rank=3,at=8,during=shutdown",)))
    for phase, rank in (("reform", 0), ("rendezvous", 4), ("moves", 4)):
        out.append(Case(f"kill 5 at 4, then rank {rank} during {phase}",
                        ("kill:rank=5,at=4", f"kill:rank={rank},at=4,during={phase}")))
    out.append(Case("hang rank 5 at 4", ("hang:rank=5,at=4",)))
    out.append(Case("kill 5 at 4, then 2 at 6", ("kill:rank=5,at=4", "kill:rank=2,at=6")))
    out.append(Case("kill 5 at 3, 2 at 5, 0 at 7", ("kill:rank=5,at=3", "kill:rank=2,at=5", "kill:rank=0,at=7")))
    return out


def megatron_cases(distributed_optimizer: bool = False) -> list[Case]:
    out = [Case(f"{sig.name} {label} in iteration 4", signal=sig, at_fraction=fraction)
           for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP)
           for label, fraction in (("early", 0.1), ("middle", 0.5), ("late", 0.9))]
    phases = (("update", 5),) if distributed_optimizer else ()
    for phase, rank in (*phases, ("optimizer", 5), ("log", 5), ("eval", 5), ("save", 3), ("save-write", 2)):
        out.append(Case(f"kill rank {rank} during {phase} at 4", (f"kill:rank={rank},at=4,during={phase}",)))
    for phase, rank in (("reform", 0), ("rendezvous", 4)):
        out.append(Case(f"kill 5 at 4, then rank {rank} during {phase}",
                        ("kill:rank=5,at=4", f"kill:rank={rank},at=4,during={phase}")))
    out.append(Case("kill rank 3 during shutdown", ("kill:rank=3,at=8,during=shutdown",)))
    # Megatron's loop reads an iteration's batches inside its step: the loader's first batch is
    # iteration 1's, before any state was trained.
    out.append(Case("kill rank 5 at 1, before its first batch", ("kill:rank=5,at=1",)))
    for phase in RAISE_PHASES:
        out.append(Case(f"rank 5 raises in its {phase} at 4", (f"raise:rank=5,at=4,during={phase}",)))
    out.append(Case("hang rank 5 at 4", ("hang:rank=5,at=4",)))
    out.append(Case("kill 5 at 4, then 2 at 6", ("kill:rank=5,at=4", "kill:rank=2,at=6")))
    return out


def run(case: Case | None, work: Path, median_s: float, model: list[str] = MODEL) -> dict:
    """One job; ``case`` None is the failure-free reference."""
    name = "reference" if case is None else case.name.replace(" ", "_").replace(",", "")
    log, ckpt = work / f"{name}.events.jsonl", work / f"{name}_ckpt"
    extra = [arg for spec in (case.inject if case else ()) for arg in ("--resihp-inject", spec)]
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={NPROC}",
           str(REPO / "pretrain_gpt_resilient.py"), *model, "--save", str(ckpt), "--resihp-event-log", str(log),
           "--resihp-enable", *extra]
    if case is not None and case.signal is not None:
        code, output, fault_at = run_and_signal(cmd, log, rank=5, sig=case.signal, after_iteration=3,
                                                delay_s=case.at_fraction * median_s, timeout_s=900)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900)
        code, output, fault_at = proc.returncode, proc.stdout, None
    return {"log": log, "code": code, "output": output, "fault_at": fault_at}


def judge(result: dict, reference: dict[int, float]) -> dict:
    log, code = result["log"], result["code"]
    losses = {e["iteration"]: e["lm_loss"] for e in events(log, "iteration")}
    adapted = events(log, "adapted")
    injected = [e["time"] for e in events(log, "inject") if "slow" not in e.get("fault", "")]
    fault_at = result["fault_at"] or (min(injected) if injected else None)
    recovery_s = None
    if adapted and fault_at is not None:
        after = [e["time"] for e in events(log, "iteration") if e["time"] > adapted[-1]["time"]]
        recovery_s = round(min(after) - fault_at, 3) if after else None
    unlogged = sum(loss is None for loss in losses.values())
    exact = (sorted(losses) == list(range(1, ITERS + 1))
             and all(losses[i] is None or abs(losses[i] - reference[i]) <= 1e-5 * abs(reference[i])
                     for i in range(1, ITERS + 1)))
    if code == 0:
        outcome = "in place, exact" if exact else "in place, differs"
        if unlogged:
            outcome += f" ({unlogged} unlogged)"
    elif code == 3:
        outcome = "fallback"
    else:
        outcome = f"failed (exit {code})"
    return {"outcome": outcome, "exit_code": code, "adaptations": len(adapted), "recovery_s": recovery_s,
            "world_size_after": adapted[-1]["world_size"] if adapted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="run only the cases whose name contains one of these texts")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary folder)")
    parser.add_argument("--loop", choices=("resihp", "megatron"), default="resihp",
                        help="the training loop the jobs run (--resihp-loop)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="with --loop megatron: every job with --use-distributed-optimizer")
    args = parser.parse_args()
    if args.distributed_optimizer and args.loop != "megatron":
        parser.error("--distributed-optimizer needs --loop megatron (the resihp loop refuses the distributed optimizer)")
    model = MEGATRON_MODEL if args.loop == "megatron" else [*MODEL, "--resihp-loop", "resihp"]
    if args.distributed_optimizer:
        model = [*model, "--use-distributed-optimizer"]
    every = cases(args.loop, args.distributed_optimizer)
    chosen = [c for c in every if not args.cases or any(t in c.name for t in args.cases)]
    if args.list:
        print("\n".join(c.name for c in every))
        return
    if not chosen:
        parser.error(f"--cases matched none of: {', '.join(c.name for c in every)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fault_matrix_"))
    work.mkdir(parents=True, exist_ok=True)
    reference_run = run(None, work, 0.0, model)
    if reference_run["code"] != 0:
        raise SystemExit(f"failure-free run failed ({reference_run['code']}): {reference_run['output'][-3000:]}")
    its = events(reference_run["log"], "iteration")
    reference = {e["iteration"]: e["lm_loss"] for e in its}
    median_s = sorted(e["elapsed_s"] for e in its if e["iteration"] > 1)[len(its) // 2 - 1]
    rows = []
    for case in chosen:
        row = {"case": case.name, **judge(run(case, work, median_s, model), reference)}
        rows.append(row)
        if not args.json:
            took = f"{row['recovery_s']:.2f} s" if row["recovery_s"] is not None else "-"
            print(f"{case.name:<44} {row['outcome']:<18} {took:>8}  (adaptations {row['adaptations']}, "
                  f"world {row['world_size_after']})", flush=True)
    if args.json:
        print(json.dumps({"loop": args.loop, "distributed_optimizer": args.distributed_optimizer,
                          "median_iteration_s": median_s, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
