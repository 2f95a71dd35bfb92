"""Observations as they travel to the decider: packed, they unpickle equal to what was sent, and
the decider's op tables, judgements and cost fits from them are the ones it makes from unpacked
observations."""

import dataclasses
import pickle

import numpy as np
import pytest

from resihp_ext.config import ResiHPConfig
from resihp_ext.detection.detector import FailSlowDetector
from resihp_ext.faults import parse_fault
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.detection.observation_wire import PackedObservation, packed
from resihp_ext.detection.observations import RankObservation
from resihp_ext.detection.op_signals import op_tables
from resihp_ext.planner.calibration import fit_compute_costs
from resihp_ext.detection.traces import SyntheticSpec, synthetic_trace

OPS = (("F", 0, 0.1, 0.2), ("F", 1, 0.2, 0.3), ("B", 1, 0.35, 0.5), ("B", 0, 0.5, 0.7))
FEATURES = ((512, 70000, 3), (512, 90000, 2))


def _travel(obs):
    return pickle.loads(pickle.dumps(packed(obs), protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize("obs", [
    RankObservation(3, 1, 2, 0, OPS, FEATURES, 1.5, busy=(0.09, 0.1, 0.14, 0.2)),  # busy measured
    RankObservation(3, 1, 2, 0, OPS, FEATURES, 1.5),  # busy is each op's wall time
    RankObservation(0, 0, 0, 0, (), ((8, 64),), 1.0),  # nothing ran
], ids=["busy", "wall", "empty"])
def test_a_packed_observation_arrives_equal_to_the_one_sent(obs):
    arrived = _travel(obs)
    assert type(arrived) is PackedObservation and isinstance(arrived, RankObservation)
    assert arrived == obs and obs == arrived and hash(arrived) == hash(obs)
    assert arrived.ops == obs.ops and arrived.busy == obs.busy and arrived.op_busy() == obs.op_busy()
    assert all(type(mb) is int and type(start) is float for _, mb, start, _ in arrived.ops)
    assert packed(arrived) is arrived and _travel(arrived) == obs  # sent on again as it is
    assert arrived != dataclasses.replace(obs, iteration_s=2.0)


def _spec(**kw):
    return SyntheticSpec(tp_degree=2, pp_degree=4, dp_degree=3, **kw)


def test_op_tables_of_packed_observations_are_those_of_the_observations():
    # Replicas with different micro-batch counts: tables padded to the widest.
    _, observations = next(iter(synthetic_trace(_spec(), 1, seed=4)))
    fewer = [dataclasses.replace(o, ops=tuple(op for op in o.ops if op[1] < 5), features=o.features[:5])
             for o in observations if o.replica == 1]
    mixed = [o for o in observations if o.replica != 1] + fewer
    expected = op_tables(mixed)
    got = op_tables([_travel(o) for o in mixed])
    assert got.shape == expected.shape == (len(mixed), 6, 8)
    np.testing.assert_array_equal(got, expected)  # NaN where the other has NaN


def test_the_detector_and_the_cost_fit_judge_packed_observations_as_the_observations():
    spec = _spec()
    model = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
                      vocab_size=32000, seq_length=spec.seq_length, micro_batch_size=1)
    layout = Layout.uniform(model, 2, 4, 3)
    plain, travelled = FailSlowDetector(ResiHPConfig()), FailSlowDetector(ResiHPConfig())
    suspicions = []
    for iteration, observations in synthetic_trace(spec, 40, [parse_fault("slow:rank=9,factor=1.5,at=25")], seed=2):
        arrived = [_travel(o) for o in observations]
        tables = op_tables(arrived)
        expected = plain.observe(iteration, observations)
        assert travelled.observe(iteration, arrived, tables) == expected
        assert travelled.last_report == plain.last_report
        assert fit_compute_costs(iteration, arrived, layout, tables) == fit_compute_costs(iteration, observations,
                                                                                          layout)
        if expected is not None:
            suspicions.append(expected)
            plain.mute(expected)
            travelled.mute(expected)
    assert [s.ranks for s in suspicions] == [(8, 9)]  # the slow rank's TP group was suspected
