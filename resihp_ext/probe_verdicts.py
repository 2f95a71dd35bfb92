"""What one probe round says about one suspicion.

Responsible for turning a localised probe round (``resihp_ext.validation.localise``) into the
Verdict it supports, or the Cleared it ends in, given what is already known of the suspects:
each rank's known slowdown (``FailSlowDetector.expect``), and whether it is slow only in bursts.
The detector decides what to probe and what to do with the outcome (mute, release); this module
only reads the round.

Pure: no clocks, no process groups.
"""

from __future__ import annotations

from collections.abc import Mapping

from resihp_ext.observations import Suspicion
from resihp_ext.validation import Cleared, Localisation, ProbeResults, Verdict


def known_factors(ranks, expected: Mapping[int, float], in_bursts: Mapping[int, float]) -> dict[int, float]:
    """Each of ``ranks``' known slowdown: steady (``expected``) or in bursts; 1.0 when none."""
    return {r: expected.get(r, in_bursts.get(r, 1.0)) for r in ranks}


def rank_evidence(suspicion: Suspicion, probes: ProbeResults, loc: Localisation) -> dict:
    """The suspects' probe factors, seconds and reference, as a verdict's evidence carries them."""
    return {
        "probe_factors": {str(r): round(loc.rank_factors[r], 4) for r in suspicion.ranks if r in loc.rank_factors},
        "probe_s": {str(r): probes.rank_s[r] for r in suspicion.ranks if r in probes.rank_s},
        "probe_reference_s": loc.rank_reference_s,
    }


def link_evidence(probes: ProbeResults, loc: Localisation) -> dict:
    """Every probed link's factor and seconds (keys ``"src->dst"``), and the round's reference."""
    return {
        "probe_factors": {f"{a}->{b}": round(f, 4) for (a, b), f in loc.link_factors.items()},
        "probe_s": {f"{a}->{b}": s for (a, b), s in probes.link_s.items()},
        "probe_reference_s": loc.link_reference_s,
    }


def compute_verdict(suspicion: Suspicion, loc: Localisation, known: Mapping[int, float], threshold: float,
                    onset: int, evidence: dict) -> Verdict | None:
    """A ``compute`` verdict for the suspects the round names slow, or None.

    A suspect with a known slowdown is named only when its probe is at least ``threshold`` times
    it (``known_factors`` goes into the evidence): a group a plan kept is watched again for a
    further change, and its probe has to show one. Live, a one-rank job kept at 1.36x was named
    again at 1.28x when a busy spell of its host slowed its iterations.
    """
    if any(f > 1.0 for f in known.values()):
        evidence["known_factors"] = {str(r): round(f, 4) for r, f in known.items() if f > 1.0}
    slow = [r for r in loc.slow_ranks if r in suspicion.ranks and loc.rank_factors[r] >= threshold * known[r]]
    if not slow:
        return None
    return Verdict("compute", tuple(sorted(slow)), loc.rank_factors[slow[0]], onset, evidence,
                   f"{loc.reason}; group ran {suspicion.ratio:.2f}x predicted since iteration {onset}")


def recovered_verdict(suspicion: Suspicion, loc: Localisation, known: Mapping[int, float],
                      in_bursts: Mapping[int, float], threshold: float, evidence: dict) -> Verdict | None:
    """A ``recovered`` verdict for the known slow suspects whose probe beats their known slowdown
    by ``threshold``, or None if none does."""
    evidence["known_factors"] = {str(r): round(f, 4) for r, f in known.items()}
    now = {r: max(loc.rank_factors[r], 1.0) for r in suspicion.ranks
           if r in loc.rank_factors and loc.rank_factors[r] * threshold <= known[r]}
    if not now:
        return None
    named = ", ".join(f"{r} ({f:.2f}x, was {known[r]:.2f}x)" for r, f in sorted(now.items()))
    if all(r in in_bursts for r in now):
        seen = f"no burst in its group since iteration {suspicion.onset_iteration}"
    else:
        seen = (f"group ran {suspicion.ratio:.2f}x faster than its known slowdown since iteration "
                f"{suspicion.onset_iteration}")
    return Verdict("recovered", tuple(sorted(now)), max(now.values()), suspicion.onset_iteration, evidence,
                   f"faster again: ranks {named}; {seen}")


def link_verdict(suspicion: Suspicion, loc: Localisation, onset: int, evidence: dict) -> Verdict | None:
    """A ``link`` verdict for the slowest suspect link the round names slow, or None."""
    slow = [link for link in loc.slow_links if link in suspicion.links]
    if not slow:
        return None
    return Verdict("link", tuple(slow[0]), loc.link_factors[slow[0]], onset, evidence,
                   f"{loc.reason}; transfers ran {suspicion.ratio:.2f}x baseline since iteration {onset}")


def cleared(suspicion: Suspicion, loc: Localisation, iteration: int, evidence: dict) -> Cleared:
    """What a round that supports no verdict says: what it did not find, and the suspicion dropped."""
    found = {"compute": "no rank slower than its known slowdown" if "known_factors" in evidence else "no slow rank",
             "link": "no slow link", "recovery": "no rank faster than its known slowdown"}[suspicion.kind]
    return Cleared(iteration, suspicion.ranks, evidence,
                   f"probes found {found} ({loc.reason}); suspicion at iteration {suspicion.iteration} dropped")
