"""Synthetic detector runs the detector's tests share: one TP2 x PP2 x DP2 job, its traces with
faults injected, a detector run over them, and observations stretched or made busy."""

import dataclasses
import functools

from resihp_ext.detection.detector import FailSlowDetector
from resihp_ext.detection.traces import SyntheticSpec, synthetic_probes, synthetic_trace
from resihp_ext.faults import parse_fault

# TP2 x PP2 x DP2: rank = tp + 2 * (replica + 2 * stage); rank 5 is replica 0, stage 1, TP rank 1.
SPEC = SyntheticSpec(tp_degree=2, pp_degree=2, dp_degree=2, num_microbatches=4, seq_length=4096)


@functools.lru_cache(maxsize=None)
def cached_trace(num_iterations, faults=(), seed=5):
    return tuple(synthetic_trace(SPEC, num_iterations, [parse_fault(f) for f in faults], seed=seed))


def run_detector(trace, faults=(), detector=None, spec=SPEC):
    det = detector or FailSlowDetector()
    events = []
    for iteration, obs in trace:
        suspicion = det.observe(iteration, obs)
        if suspicion is not None:
            probes = synthetic_probes(spec, [parse_fault(f) for f in faults], iteration,
                                      suspicion.probe_ranks, suspicion.probe_links)
            events.append((suspicion, det.conclude(suspicion, probes)))
    return det, events


def stretch_ops(obs, ranks, factor):
    """The group's ops take ``factor`` longer (starts kept, ends pushed)."""
    out = []
    for o in obs:
        if o.rank in ranks:
            o = dataclasses.replace(o, ops=tuple((k, m, a, a + factor * (b - a)) for k, m, a, b in o.ops))
        out.append(o)
    return tuple(out)


def busy_ops(obs, factors):
    """Each rank's ops took ``factors[rank]`` times the device time (wall times unchanged)."""
    return tuple(dataclasses.replace(o, busy=tuple(factors.get(o.rank, 1.0) * t for t in o.op_busy())) for o in obs)
