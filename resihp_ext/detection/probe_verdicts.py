"""What one probe round says about one suspicion.

Responsible for turning a probe round into the Verdict it supports, or the Cleared it ends in
(``read_round``): localising it (``resihp_ext.detection.validation.localise``) against the right reference,
given what is already known of the suspects: each rank's known slowdown
(``FailSlowDetector.expect``), and whether it is slow only in bursts. The detector decides what
to probe and what to do with the outcome (mute, release); this module only reads the round.

Pure: no clocks, no process groups.
"""

from __future__ import annotations

from collections.abc import Mapping

from resihp_ext.detection.observations import Suspicion
from resihp_ext.detection.validation import (Cleared, Localisation, ProbeResults, Verdict, VerdictKind, localise,
                                             peer_reference_s)


def read_round(suspicion: Suspicion, probes: ProbeResults, onset: int, threshold: float,
               probe_baselines: Mapping[int, float], expected: Mapping[int, float],
               in_bursts: Mapping[int, float]) -> Verdict | Cleared:
    """The Verdict a probe round supports for ``suspicion``, or the Cleared it ends in.

    Args:
        suspicion: what the detector raised; ``onset`` is when its slowdown began, as its streak
            tells by now.
        probes: the round's timings.
        threshold: ``probe_threshold``.
        probe_baselines: each rank's healthy probe seconds, for suspects with no peer probed.
        expected, in_bursts: known slowdowns (rank -> factor), steady and in bursts.
    """
    # Suspect ranks against their peers (peer_reference_s), or, with no peer probed, each
    # against its own baseline. Links keep the round's median: live, 2-link rounds on a shared
    # host read 1.3-1.4x apart with no link slow (a link into a compute-slowed rank among
    # them), which only a median that includes the suspect absorbs.
    peer_reference = peer_reference_s(probes.rank_s, suspicion.ranks, threshold)
    loc = localise(probes, threshold, rank_reference_s=peer_reference,
                   rank_baselines_s=probe_baselines if peer_reference is None else None)
    evidence = {
        "observed_ratio": round(float(suspicion.ratio), 4),
        "onset_iteration": onset,
        "suspicion_iteration": suspicion.iteration,
        "probe_iteration": probes.iteration,
    }
    silent = sorted(set(loc.unresponsive) & set(suspicion.ranks))
    if silent:
        return Verdict(VerdictKind.HANG, tuple(silent), None, probes.iteration, evidence,
                       f"ranks {silent} did not answer validation probes after: {suspicion.reason}")
    known = known_factors(suspicion.ranks, expected, in_bursts)
    if suspicion.kind == "link":
        evidence.update(link_evidence(probes, loc))
        verdict = link_verdict(suspicion, loc, onset, evidence)
    else:
        evidence.update(rank_evidence(suspicion, probes, loc))
        verdict = (compute_verdict(suspicion, loc, known, threshold, onset, evidence)
                   if suspicion.kind == "compute" else
                   recovered_verdict(suspicion, loc, known, in_bursts, threshold, evidence))
    return verdict if verdict is not None else cleared(suspicion, loc, probes.iteration, evidence)


def known_factors(ranks, expected: Mapping[int, float], in_bursts: Mapping[int, float]) -> dict[int, float]:
    """Each of ``ranks``' known slowdown: steady (``expected``) or in bursts; 1.0 when none."""
    return {r: expected.get(r, in_bursts.get(r, 1.0)) for r in ranks}


def suspect_factors(suspicion: Suspicion, loc: Localisation) -> dict[int, float]:
    """The suspects' probe factors, rounded as the evidence records them (what a plan reads)."""
    return {r: round(loc.rank_factors[r], 4) for r in suspicion.ranks if r in loc.rank_factors}


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
    return Verdict(VerdictKind.COMPUTE, tuple(sorted(slow)), loc.rank_factors[slow[0]], onset, evidence,
                   f"{loc.reason}; group ran {suspicion.ratio:.2f}x predicted since iteration {onset}",
                   probe_factors=suspect_factors(suspicion, loc))


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
    return Verdict(VerdictKind.RECOVERED, tuple(sorted(now)), max(now.values()), suspicion.onset_iteration,
                   evidence, f"faster again: ranks {named}; {seen}", probe_factors=suspect_factors(suspicion, loc))


def link_verdict(suspicion: Suspicion, loc: Localisation, onset: int, evidence: dict) -> Verdict | None:
    """A ``link`` verdict for the slowest suspect link the round names slow, or None."""
    slow = [link for link in loc.slow_links if link in suspicion.links]
    if not slow:
        return None
    return Verdict(VerdictKind.LINK, tuple(slow[0]), loc.link_factors[slow[0]], onset, evidence,
                   f"{loc.reason}; transfers ran {suspicion.ratio:.2f}x baseline since iteration {onset}")


def cleared(suspicion: Suspicion, loc: Localisation, iteration: int, evidence: dict) -> Cleared:
    """What a round that supports no verdict says: what it did not find, and the suspicion dropped."""
    found = {"compute": "no rank slower than its known slowdown" if "known_factors" in evidence else "no slow rank",
             "link": "no slow link", "recovery": "no rank faster than its known slowdown"}[suspicion.kind]
    return Cleared(iteration, suspicion.ranks, evidence,
                   f"probes found {found} ({loc.reason}); suspicion at iteration {suspicion.iteration} dropped",
                   probe_factors={} if suspicion.kind == "link" else suspect_factors(suspicion, loc))
