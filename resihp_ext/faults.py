"""Fault descriptions shared by the command-line injector, the simulator, the planner and tests.

A fault is a value. ``parse_fault`` turns the ``--resihp-inject`` grammar into one:

    slow:rank=3,factor=2.0,at=20      compute on rank 3 takes 2x as long from iteration 20
    slow:rank=3,factor=2.0,at=20,until=40
                                      ... and recovers at the start of iteration 40
    slow:rank=3,factor=1.5,at=20,on=3,off=3
                                      ... in bursts: slow for 3 iterations, fast for 3, slow
                                      for 3, ... from iteration 20 (until= ends the bursts)
    slow:rank=3,factor=2.0,at=1,during=replan
                                      ... from the first iteration after a fail-slow re-plan at
                                      iteration >= 1 moved layers (a second device giving way as the
                                      job re-plans around the first; no until=, on= or off=)
    link:src=1,dst=3,factor=4,at=20   transfers from rank 1 to rank 3 take 4x as long
    kill:rank=5,at=30                 rank 5 is SIGKILLed at iteration 30
    kill:rank=1,at=4,during=reform    rank 1 is SIGKILLed as it is about to join the world that
                                      survivors re-form after a failure at iteration >= 4
    kill:rank=4,at=4,during=moves     rank 4 is SIGKILLed once the survivors of a failure at iteration
                                      >= 4 have joined the world that moves state to a stage group
                                      taking a lost stage, before any of it is sent
    kill:rank=5,at=1,during=replan    rank 5 is SIGKILLed while a fail-slow re-plan at iteration
                                      >= 1 moves layers and optimizer state between ranks
    kill:rank=3,at=1,during=readmission
                                      launch rank 3 is SIGKILLed in the world grown to readmit
                                      standbys at iteration >= 1, before state moves to them
    kill:rank=3,at=1,during=rendezvous
                                      launch rank 3 is SIGKILLed as a world it belongs to is about
                                      to form (every member has said it is there; the process
                                      group is not formed yet): the world the survivors of a
                                      failure at iteration >= 1 re-form, or the world grown to
                                      readmit standbys at iteration >= 1
    kill:rank=2,at=4,during=save      rank 2 is SIGKILLed as the first checkpoint save at iteration
                                      >= 4 begins, before any of its files is written
    kill:rank=2,at=4,during=save-write
                                      ... once it has written its model shard (if it writes one) into
                                      iter_X.tmp and before its RNG file: the save is half written
    kill:rank=0,at=4,during=save-rename
                                      ... once every file is in iter_X.tmp: the rank that renames
                                      (rank 0 of the world) just before the rename, any other rank
                                      while that rank renames
    kill:rank=0,at=4,during=save-tracker
                                      ... the renaming rank after the rename and before the tracker
                                      file names the new checkpoint (other ranks: as save-rename)
    kill:rank=5,at=4,during=log       rank 5 is SIGKILLed as the log of iteration >= 4 begins, after
                                      its optimizer step (on Megatron-LM's loop the log runs
                                      world-wide collectives)
    kill:rank=5,at=4,during=optimizer rank 5 is SIGKILLed as its optimizer step of iteration >= 4
                                      returns, before the step's loss is reduced (Megatron-LM's loop only)
    kill:rank=5,at=4,during=eval      rank 5 is SIGKILLed as the first evaluation at iteration >= 4
                                      begins (Megatron-LM's loop only)
    kill:rank=3,at=8,during=shutdown  rank 3 is SIGKILLed as a job that trained to iteration >= 8
                                      ends: after the last iteration and its checkpoint, before
                                      the ranks leave together
    kill:rank=5,at=1,during=setup     rank 5 is SIGKILLed as Megatron builds the data loaders of a
                                      launch whose first iteration is >= 1, before its first step
                                      (Megatron's loop only)
    raise:rank=5,at=4,during=backward rank 5 raises an error of its own (as a device error would) in the
                                      backward pass of its first micro-batch of iteration >= 4;
                                      during= is forward (the default), backward or optimizer (as
                                      its optimizer step begins); Megatron-LM's loop only
    hang:rank=2,at=40                 rank 2 stops making progress at iteration 40
    stall:rank=2,at=4,seconds=30      the files of rank 2's first checkpoint save at iteration >= 4
                                      are written 30 s late, as by a storage system that stops
                                      answering for a while: its writer process waits under
                                      --async-save (training goes on), the rank itself otherwise
    misjudge:rank=3,factor=4,at=1     from iteration 1, the fail-slow planner takes rank 3 to run 4x
                                      slower than the detector measured (a cost model fed a false
                                      speed: its re-plans can be wrong, and must be undone)

Executing a fault (sleeping, killing) is the training front end's job, never this module's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

FLAG = "--resihp-inject"


class FaultKind(str, enum.Enum):
    SLOW = "slow"
    LINK = "link"
    KILL = "kill"
    RAISE = "raise"
    HANG = "hang"
    MISJUDGE = "misjudge"
    STALL = "stall"


_KEYS = {
    FaultKind.SLOW: {"rank", "factor", "at", "until", "on", "off", "during"},
    FaultKind.LINK: {"src", "dst", "factor", "at"},
    FaultKind.KILL: {"rank", "at", "during"},
    FaultKind.RAISE: {"rank", "at", "during"},
    FaultKind.HANG: {"rank", "at"},
    FaultKind.MISJUDGE: {"rank", "factor", "at"},
    FaultKind.STALL: {"rank", "at", "seconds"},
}
# Phases of an in-place recovery a kill can be aimed at (a second failure during an adaptation).
RECOVERY_PHASES = ("reform", "moves", "replan", "readmission", "rendezvous")
# Phases of a checkpoint save, in the order a save passes them.
SAVE_PHASES = ("save", "save-write", "save-rename", "save-tracker", "save-scheduled", "finalize")
# Every phase a kill can wait for: an iteration's log, and the end of a finished job last.
PHASES = (*RECOVERY_PHASES, *SAVE_PHASES, "update", "optimizer", "log", "eval", "exit-check", "shutdown", "setup")
# Where in a step a rank can raise an error of its own.
RAISE_PHASES = ("forward", "backward", "optimizer")
_REQUIRED = {
    FaultKind.SLOW: {"rank", "factor", "at"},
    FaultKind.LINK: {"src", "dst", "factor", "at"},
    FaultKind.KILL: {"rank", "at"},
    FaultKind.RAISE: {"rank", "at"},
    FaultKind.HANG: {"rank", "at"},
    FaultKind.MISJUDGE: {"rank", "factor", "at"},
    FaultKind.STALL: {"rank", "at", "seconds"},
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault.

    ``rank`` is the afflicted rank (for ``link``, the sender ``src``); ``dst`` is set only for
    ``link``. ``factor`` is the slowdown (2.0 = twice as slow); 1.0 for kill/hang.
    ``at_iteration`` is the 1-based training iteration at whose start the fault begins; with
    ``during`` (kill), the fault waits instead for that phase (of a recovery, of a checkpoint
    save, or the job's end) at or after it; a raise always has one (the part of the step it strikes);
    a slowdown with ``during="replan"`` begins with the iteration after such a re-plan (``active``
    then tells only whether ``at_iteration`` has come: the executor knows when the re-plan ran).
    ``until_iteration`` (slow only) is the iteration at whose start a slowdown ends (None: never).
    ``on_iters`` and ``off_iters`` (slow only, both or neither) make it intermittent: from
    ``at_iteration`` on, slow for ``on_iters`` iterations, then healthy for ``off_iters``, and so on.
    ``seconds`` (stall only) is how long the writes of the first save at or after ``at_iteration`` wait.
    """

    kind: FaultKind
    rank: int
    at_iteration: int
    factor: float = 1.0
    dst: int | None = None
    during: str | None = None
    until_iteration: int | None = None
    on_iters: int | None = None
    off_iters: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.rank < 0 or (self.dst is not None and self.dst < 0):
            raise ValueError(f"{FLAG}: ranks must be >= 0 in {self.spec()}")
        if self.at_iteration < 1:
            raise ValueError(f"{FLAG}: at= must be an iteration >= 1 in {self.spec()}")
        if self.kind in (FaultKind.SLOW, FaultKind.LINK, FaultKind.MISJUDGE) and not self.factor >= 1.0:
            raise ValueError(f"{FLAG}: factor= must be >= 1.0 (a slowdown) in {self.spec()}")
        if self.kind is FaultKind.RAISE:
            if self.during not in RAISE_PHASES:
                raise ValueError(f"{FLAG}: a raise strikes during= one of {list(RAISE_PHASES)}; got "
                                 f"during={self.during} in {self.spec()}")
        elif self.kind is FaultKind.SLOW and self.during is not None:
            if self.during != "replan" or self.until_iteration is not None or self.on_iters is not None:
                raise ValueError(f"{FLAG}: a slowdown takes during=replan alone (from the first re-plan that moves "
                                 f"layers), without until=, on= or off=; got {self.spec()}")
        elif self.during is not None and (self.kind is not FaultKind.KILL or self.during not in PHASES):
            raise ValueError(f"{FLAG}: during= is for kill, raise and slow faults, a kill's one of {list(PHASES)}; "
                             f"got {self.kind.value} with during={self.during}")
        if self.until_iteration is not None and (self.kind is not FaultKind.SLOW
                                                 or self.until_iteration <= self.at_iteration):
            raise ValueError(f"{FLAG}: until= is for slow faults and must be after at=; got {self.kind.value} "
                             f"with at={self.at_iteration}, until={self.until_iteration}")
        if (self.on_iters is None) != (self.off_iters is None) or (
                self.on_iters is not None and (self.kind is not FaultKind.SLOW or self.on_iters < 1 or self.off_iters < 1)):
            raise ValueError(f"{FLAG}: on= and off= go together, on slow faults, as iteration counts >= 1; got "
                             f"{self.kind.value} with on={self.on_iters}, off={self.off_iters}")
        if (self.kind is FaultKind.STALL) != (self.seconds is not None) or (
                self.seconds is not None and not self.seconds > 0):
            raise ValueError(f"{FLAG}: seconds= goes with stall faults, and only with them, as a number > 0; got "
                             f"{self.kind.value} with seconds={self.seconds}")
        if self.kind is FaultKind.LINK and self.dst == self.rank:
            raise ValueError(f"{FLAG}: a link needs two different ranks, got src=dst={self.rank}")

    @property
    def src(self) -> int:
        return self.rank

    @property
    def intermittent(self) -> bool:
        return self.on_iters is not None

    def active(self, iteration: int) -> bool:
        if iteration < self.at_iteration or (self.until_iteration is not None and iteration >= self.until_iteration):
            return False
        return not self.intermittent or (iteration - self.at_iteration) % (self.on_iters + self.off_iters) < self.on_iters

    def spec(self) -> str:
        """The fault in ``--resihp-inject`` grammar (``parse_fault(f.spec()) == f``)."""
        if self.kind is FaultKind.LINK:
            return f"link:src={self.rank},dst={self.dst},factor={self.factor:g},at={self.at_iteration}"
        if self.kind is FaultKind.MISJUDGE:
            return f"misjudge:rank={self.rank},factor={self.factor:g},at={self.at_iteration}"
        if self.kind is FaultKind.SLOW:
            until = f",until={self.until_iteration}" if self.until_iteration is not None else ""
            bursts = f",on={self.on_iters},off={self.off_iters}" if self.intermittent else ""
            during = f",during={self.during}" if self.during else ""
            return f"slow:rank={self.rank},factor={self.factor:g},at={self.at_iteration}{until}{bursts}{during}"
        if self.kind is FaultKind.STALL:
            return f"stall:rank={self.rank},at={self.at_iteration},seconds={self.seconds:g}"
        during = f",during={self.during}" if self.during else ""
        return f"{self.kind.value}:rank={self.rank},at={self.at_iteration}{during}"


def parse_fault(spec: str) -> Fault:
    """Parse one ``--resihp-inject`` value; raise ``ValueError`` naming the flag and the fix."""
    kind_text, sep, body = spec.strip().partition(":")
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        raise ValueError(
            f"{FLAG} {spec!r}: unknown fault kind {kind_text!r}; use one of "
            "slow:rank=R,factor=F,at=I[,until=J][,on=A,off=B][,during=replan] | link:src=S,dst=D,factor=F,at=I | "
            f"kill:rank=R,at=I[,during={'|'.join(PHASES)}] | raise:rank=R,at=I[,during={'|'.join(RAISE_PHASES)}] | "
            "hang:rank=R,at=I | misjudge:rank=R,factor=F,at=I | stall:rank=R,at=I,seconds=S"
        ) from None
    fields: dict[str, str] = {}
    for item in filter(None, body.split(",")) if sep else []:
        key, eq, value = item.partition("=")
        if not eq or key in fields:
            raise ValueError(f"{FLAG} {spec!r}: expected distinct key=value items, got {item!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - _KEYS[kind]
    missing = _REQUIRED[kind] - set(fields)
    if unknown or missing:
        raise ValueError(
            f"{FLAG} {spec!r}: {kind.value} takes keys {sorted(_KEYS[kind])}"
            + (f"; unknown {sorted(unknown)}" if unknown else "")
            + (f"; missing {sorted(missing)}" if missing else "")
        )
    try:
        rank = int(fields["src" if kind is FaultKind.LINK else "rank"])
        dst = int(fields["dst"]) if kind is FaultKind.LINK else None
        at = int(fields["at"])
        factor = float(fields.get("factor", 1.0))
        until, on, off = (int(fields[k]) if k in fields else None for k in ("until", "on", "off"))
        seconds = float(fields["seconds"]) if "seconds" in fields else None
    except ValueError as exc:
        raise ValueError(f"{FLAG} {spec!r}: {exc}; ranks, at=, until=, on= and off= are integers, "
                         "factor= and seconds= numbers") from None
    during = fields.get("during", RAISE_PHASES[0] if kind is FaultKind.RAISE else None)
    return Fault(kind=kind, rank=rank, at_iteration=at, factor=factor, dst=dst, during=during,
                 until_iteration=until, on_iters=on, off_iters=off, seconds=seconds)


def check_ranks_exist(faults: tuple[Fault, ...], world_size: int) -> None:
    """Raise ``ValueError`` naming ``--resihp-inject`` for a fault on a rank the job does not have.

    Such a fault would be accepted and never fire, and a test or drill built on it would pass
    without the failure it meant to cause.
    """
    for fault in faults:
        for rank in (fault.rank, fault.dst):
            if rank is not None and rank >= world_size:
                raise ValueError(f"{FLAG} {fault.spec()!r}: rank {rank} does not exist in a job of {world_size} "
                                 f"ranks (0..{world_size - 1}); name a launched rank")
