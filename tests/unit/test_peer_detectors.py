"""Baselines: they work on constant workloads but false-alarm on variable-length healthy runs."""

import dataclasses
import functools

from resihp_ext.detection.peer_detectors import GreyhoundStyleDetector, NvrxStyleDetector
from resihp_ext.detection.detector import FailSlowDetector
from resihp_ext.faults import parse_fault
from resihp_ext.detection.traces import SyntheticSpec, synthetic_trace

VARIABLE = SyntheticSpec(tp_degree=2, pp_degree=2, dp_degree=2, num_microbatches=4, seq_length=4096)
# Every document exactly one sample long: micro-batch cost never changes.
CONSTANT = dataclasses.replace(VARIABLE, short_docs="fixed:length=4096", long_docs="fixed:length=4096")


@functools.lru_cache(maxsize=None)
def _trace(spec, num_iterations, faults=(), seed=5):
    return tuple(synthetic_trace(spec, num_iterations, [parse_fault(f) for f in faults], seed=seed))


def _alarms(detector, trace):
    return [a for a in (detector.observe(i, obs) for i, obs in trace) if a is not None]


def test_baselines_false_alarm_where_ours_stays_silent():
    trace = _trace(VARIABLE, 1000)
    assert _alarms(GreyhoundStyleDetector(), trace), "Greyhound-style should be fooled by data swings"
    ours = FailSlowDetector()
    assert [s for s in (ours.observe(i, obs) for i, obs in trace) if s is not None] == []


def test_nvrx_false_alarms_when_replicas_read_different_data():
    spec = dataclasses.replace(VARIABLE, dp_degree=4, replica_deviation=0.5)
    assert _alarms(NvrxStyleDetector(), _trace(spec, 300))


def test_baselines_quiet_on_constant_workload():
    trace = _trace(CONSTANT, 300)
    assert _alarms(GreyhoundStyleDetector(), trace) == []
    assert _alarms(NvrxStyleDetector(), trace) == []


def test_greyhound_detects_step_slowdown_on_constant_workload():
    alarms = _alarms(GreyhoundStyleDetector(), _trace(CONSTANT, 80, ("slow:rank=5,factor=1.5,at=50",)))
    assert alarms and 50 <= alarms[0].iteration <= 55
    assert 5 in alarms[0].ranks


def test_nvrx_flags_slow_rank_on_constant_workload():
    alarms = _alarms(NvrxStyleDetector(), _trace(CONSTANT, 80, ("slow:rank=5,factor=1.5,at=50",)))
    assert alarms and alarms[0].iteration >= 50
    assert 5 in alarms[0].ranks
