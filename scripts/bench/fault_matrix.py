"""Fault matrix: each kind of failure at each moment it can strike, and what the job made of it.

Runs a TP2 x PP2 x DP2 job on Megatron-LM's loop (8 gloo processes, tiny GPT, dropout off, 8
iterations of global batch 16, an evaluation and a checkpoint in Megatron's torch format every 2
iterations) once failure-free and once per case, under ``scripts/launch_local.py`` with
``--resihp-enable`` and default flags, and prints one row per case:

    case -> outcome -> recovery time

* signals sent from outside to a rank's process (its pid is in the event log): SIGKILL, SIGTERM
  and SIGSTOP, each at three moments of iteration 4 (early, middle and late in the iteration:
  forward, backward, the gradient sync and the optimizer step, as this job's iteration spreads
  them);
* kills injected at named phases (``--resihp-inject kill:...,during=PHASE``): as a rank's optimizer
  step returns, as the iteration is logged, as an evaluation begins, as a save begins and once a
  rank's checkpoint files are written (Megatron's save writes its files in place and then its
  tracker file, with no rename between: those two are the save's phases a kill can wait for), the
  end of a finished job, and a second failure in a recovery's re-form and its rendezvous;
* a kill at iteration 1, before the rank's first batch (Megatron's loop reads an iteration's
  batches inside its step);
* an error of one rank's own raised in its forward, backward or optimizer step (``raise:``: that
  rank leaves, exit 4, and the others go on as after a kill);
* a rank hung in Python (``hang:``), named once it has worked without progress for ``--resihp-hang-iters``
  iterations while the others wait for it (``megatron/resihp/hang_rules.py``);
* cascades: a second and a third kill after the first adaptation (after the first kill one
  replica goes on and the other's ranks stand by as spares; a later kill may take a shard no live
  rank holds, spares or not, and then the job falls back).

Outcomes: ``in place, exact`` (exit 0, losses of every iteration equal the failure-free run's
within 1e-5 and consumed samples exact), ``in place, differs``, ``fallback`` (exit 3 with a resume
command), or ``failed (exit N)``; a row says how many of its case's injected faults never struck
(the job ended, or never reached their phase, first). Megatron logs no loss for an iteration whose
step finished before the failure surfaced on the logging rank: such an iteration counts as exact
when every loss logged matches (the row says how many were not logged). Recovery time: from the
fault (the signal, or the ``inject`` event) to the first iteration finished after the last
adaptation.

    python scripts/bench/fault_matrix.py [--distributed-optimizer] [--async-save] [--json] [--cases TEXT ...] [--list]

``--distributed-optimizer`` runs every job with ``--use-distributed-optimizer``, where a dead rank's
part of the optimizer state comes from its copy on another rank, and adds a kill between a rank's
update and its copy (``during=update``), which the survivors undo: every part goes back to the
update before, and the iteration runs again, and a second kill while a recovery moves the dead
replica's parts to the survivors (``during=moves``; with the plain optimizer this job's plans move
no state).

``--async-save`` runs every job with megatron-core's asynchronous ``torch_dist`` saves
(``--async-save --use-persistent-ckpt-worker --async-strategy mcore``): each save is handed to a
writer process per rank and finalized at a later step's top. Its save cases kill a rank as the save
begins, once its save is with its writer (``during=save-scheduled``) and as Megatron finalizes the
save at the next step's top (``during=finalize``).

Not covered: failures before the first iteration (model build, checkpoint load, the loaders'
set-up). The store host's death is not a case here: the store lives in the launcher, whose ranks
die with it; ``tests/dist/test_megatron_loop_resilience.py`` kills torchrun's agent, whose ranks
outlive it, instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.child_env import job_env  # noqa: E402
from scripts.bench.case_choice import add_case_arguments, chosen_cases, work_folder  # noqa: E402
from scripts.bench.event_losses import iteration_losses, same_losses  # noqa: E402
from scripts.signal_rank import events, run_and_signal  # noqa: E402
from resihp_ext.faults import RAISE_PHASES  # noqa: E402

NPROC, ITERS, GLOBAL_BATCH = 8, 8, 16
MODEL = [
    "--device", "cpu", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", "2",
    "--pipeline-model-parallel-size", "2", "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERS),
    "--save-interval", "2", "--ckpt-format", "torch", "--split", "99,1,0", "--eval-interval", "2", "--eval-iters", "1",
]
# Save phases of the fault grammar that no case here strikes (--cases naming one exits 2 with why).
SAVE_PHASES_NOT_STRUCK = ("save-rename",)
SAVE_PHASES_WHY = ("Megatron's save writes each rank's files in place, with no rename, and then its tracker file; "
                   "on Megatron's loop a kill waits for a save as it begins (save), once a rank's files are "
                   "written (save-write) or, on rank 0, before the tracker names the save (save-tracker)")


@dataclass(frozen=True)
class Case:
    name: str
    inject: tuple[str, ...] = ()  # --resihp-inject specs
    signal: int | None = None  # sent from outside to rank 5 during iteration 4
    at_fraction: float = 0.5  # how far into iteration 4, as a fraction of a median iteration


ASYNC_SAVES = ["--ckpt-format", "torch_dist", "--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


def cases(distributed_optimizer: bool = False, async_save: bool = False) -> list[Case]:
    out = [Case(f"{sig.name} {label} in iteration 4", signal=sig, at_fraction=fraction)
           for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP)
           for label, fraction in (("early", 0.1), ("middle", 0.5), ("late", 0.9))]
    phases = (("update", 5),) if distributed_optimizer else ()
    saves = (("save", 3), ("save-scheduled", 2), ("finalize", 0)) if async_save else \
        (("save", 3), ("save-write", 2), ("save-tracker", 0))
    for phase, rank in (*phases, ("optimizer", 5), ("log", 5), ("eval", 5), *saves):
        out.append(Case(f"kill rank {rank} during {phase} at 4", (f"kill:rank={rank},at=4,during={phase}",)))
    # State moves after a kill only where the dead replica's optimizer parts go to the survivors:
    # with the plain optimizer, this job's plans move nothing (its torch-format saves keep every
    # replica at the launch's TP degree, so no survivor goes on at a smaller one), and a kill
    # waiting for the moves would never strike.
    moves = (("moves", 4),) if distributed_optimizer else ()
    # Rank 5's death breaks replica 0 (ranks 0, 1, 4, 5 in Megatron's rank order) and replica 1
    # (2, 3, 6, 7) goes on: the second kill strikes one of those, as it joins the re-form or the
    # new world's rendezvous (a rank of replica 0 stands by and never would).
    for phase, rank in (("reform", 2), *moves, ("rendezvous", 6)):
        out.append(Case(f"kill 5 at 4, then rank {rank} during {phase}",
                        ("kill:rank=5,at=4", f"kill:rank={rank},at=4,during={phase}")))
    out.append(Case("kill rank 3 during shutdown", ("kill:rank=3,at=8,during=shutdown",)))
    out.append(Case("kill rank 5 at 1, before its first batch", ("kill:rank=5,at=1",)))
    for phase in RAISE_PHASES:
        out.append(Case(f"rank 5 raises in its {phase} at 4", (f"raise:rank=5,at=4,during={phase}",)))
    out.append(Case("hang rank 5 at 4", ("hang:rank=5,at=4",)))
    out.append(Case("kill 5 at 4, then 2 at 6", ("kill:rank=5,at=4", "kill:rank=2,at=6")))
    # No replica left whole and no stage-0 TP group intact: only a smaller TP degree goes on in place.
    out.append(Case("kill 0 and 3 at 4, a TP rank of stage 0 in each replica", ("kill:rank=0,at=4", "kill:rank=3,at=4")))
    out.append(Case("kill 5 at 3, 2 at 5, 0 at 7", ("kill:rank=5,at=3", "kill:rank=2,at=5", "kill:rank=0,at=7")))
    return out


def run(case: Case | None, work: Path, median_s: float, model: list[str]) -> dict:
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
    return {"log": log, "code": code, "output": output, "fault_at": fault_at, "faults": case.inject if case else ()}


def judge(result: dict, reference: dict[int, float]) -> dict:
    log, code = result["log"], result["code"]
    losses = iteration_losses(log)
    adapted = events(log, "adapted")
    injected = [e["time"] for e in events(log, "inject") if "slow" not in e.get("fault", "")]
    fault_at = result["fault_at"] or (min(injected) if injected else None)
    recovery_s = None
    if adapted and fault_at is not None:
        after = [e["time"] for e in events(log, "iteration") if e["time"] > adapted[-1]["time"]]
        recovery_s = round(min(after) - fault_at, 3) if after else None
    unlogged = sum(loss is None for loss in losses.values())
    # A fault whose moment never came (a phase the job did not reach) writes no inject event.
    never_struck = len(result["faults"]) - len({e.get("fault") for e in events(log, "inject")})
    exact = same_losses(losses, reference, ITERS)
    if code == 0:
        outcome = "in place, exact" if exact else "in place, differs"
        if unlogged:
            outcome += f" ({unlogged} unlogged)"
    elif code == 3:
        outcome = "fallback"
    else:
        outcome = f"failed (exit {code})"
    if never_struck:
        outcome += f" ({never_struck} of {len(result['faults'])} faults never struck)"
    return {"outcome": outcome, "exit_code": code, "adaptations": len(adapted), "recovery_s": recovery_s,
            "world_size_after": adapted[-1]["world_size"] if adapted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser)
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="every job with --use-distributed-optimizer, and a kill between a rank's update and "
                             "its copy (during=update)")
    parser.add_argument("--async-save", action="store_true",
                        help="every job with asynchronous torch_dist saves (megatron-core's writer processes; with "
                             "--distributed-optimizer, fully reshardable), and kills once a save is with its writer "
                             "(during=save-scheduled) and as Megatron finalizes it (during=finalize)")
    args = parser.parse_args()
    for text in args.cases or ():
        for phase in SAVE_PHASES_NOT_STRUCK:
            if phase in text:
                parser.error(f"--cases {text!r}: no case kills during {phase}: {SAVE_PHASES_WHY}")
        if "moves" in text and not args.distributed_optimizer:
            parser.error(f"--cases {text!r}: a kill during a recovery's state moves needs --distributed-optimizer: "
                         f"with the plain optimizer this job's plans move no state, so the kill would never strike")
    model = [*MODEL, "--use-distributed-optimizer"] if args.distributed_optimizer else list(MODEL)
    if args.async_save:
        model = [*model, *ASYNC_SAVES]  # the later --ckpt-format wins
        if args.distributed_optimizer:
            # Its torch_dist state laid out by parameter: a save at a smaller TP degree then loads at the
            # launch's, so every replica may go on at one (without it, such a job keeps its degree).
            model.append("--dist-ckpt-optim-fully-reshardable")
    every = cases(args.distributed_optimizer, args.async_save)
    chosen = chosen_cases(parser, args, every)
    if not chosen:
        return
    work = work_folder(args, "fault_matrix_")
    reference_run = run(None, work, 0.0, model)
    if reference_run["code"] != 0:
        raise SystemExit(f"failure-free run failed ({reference_run['code']}): {reference_run['output'][-3000:]}")
    its = events(reference_run["log"], "iteration")
    reference = iteration_losses(reference_run["log"])
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
        print(json.dumps({"distributed_optimizer": args.distributed_optimizer, "async_save": args.async_save,
                          "median_iteration_s": median_s, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
