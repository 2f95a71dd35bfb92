"""Each iteration's loss as a job's event log holds it, and whether a faulted job trained what its
failure-free run did: the fault benches' one test of exactness."""

from __future__ import annotations

from pathlib import Path

from scripts.signal_rank import events

# Relative difference allowed between a loss and the failure-free one (float sums in another order).
LOSS_REL = 1e-5


def iteration_losses(log: Path) -> dict[int, float | None]:
    """Iteration -> its ``lm_loss`` (None where the rank that logged it had none to log)."""
    return {e["iteration"]: e["lm_loss"] for e in events(log, "iteration")}


def same_losses(losses: dict[int, float | None], reference: dict[int, float], iterations: int) -> bool:
    """Every iteration 1..``iterations`` logged, each loss it has within ``LOSS_REL`` of the reference's."""
    return sorted(losses) == list(range(1, iterations + 1)) and all(
        loss is None or abs(loss - reference[i]) <= LOSS_REL * abs(reference[i]) for i, loss in losses.items())
