"""Fail-slow detection and re-plans under the interleaved schedule, on synthetic traces whose ops
are each one model chunk's, in the order megatron-core runs them (``SyntheticSpec.num_chunks``)."""

import dataclasses
import statistics

import pytest

from resihp_ext.detection.detector import FailSlowDetector, Verdict
from resihp_ext.detection.predictor import predict_replica
from resihp_ext.detection.simulator import pipeline_time_s
from resihp_ext.detection.traces import synthetic_trace
from resihp_ext.faults import parse_fault
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.calibration import fit_compute_costs
from resihp_ext.planner.cost import iteration_s, replica_timing
from resihp_ext.planner.dp import assign_quotas
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.schedule import Interleaving
from tests.unit.detector_runs import SPEC, run_detector

CHUNKS = 2
# TP2 x PP2 x DP2 as the other detector tests, two chunks per stage, 4 micro-batches per replica.
INTERLEAVED = dataclasses.replace(SPEC, num_chunks=CHUNKS)


def _trace(iterations, faults=(), seed=5):
    return list(synthetic_trace(INTERLEAVED, iterations, [parse_fault(f) for f in faults], seed=seed))


def _run(iterations, faults=()):
    return run_detector(_trace(iterations, faults), faults, FailSlowDetector(interleaving=Interleaving(CHUNKS)),
                        spec=INTERLEAVED)


def test_each_op_is_a_chunks_and_a_healthy_run_raises_nothing():
    trace = _trace(200)
    obs = trace[0][1][0]
    assert len(obs.ops) == 2 * CHUNKS * INTERLEAVED.num_microbatches
    assert len(obs.features) == CHUNKS * INTERLEAVED.num_microbatches
    det, events = run_detector(trace, (), FailSlowDetector(interleaving=Interleaving(CHUNKS)), spec=INTERLEAVED)
    assert events == []
    assert det.predictor.mape() < 4.0


def test_a_replicas_schedule_is_predicted_by_walking_the_interleaved_schedule():
    # After 40 iterations of fitting, each replica's pipeline span (its last op's end) is what the
    # fitted chunk ops predict through the interleaved schedule, to 1% (median).
    trace = _trace(60)
    det = FailSlowDetector(interleaving=Interleaving(CHUNKS))
    for iteration, obs in trace[:40]:
        det.observe(iteration, obs)
    errors = []
    for _, obs in trace[40:]:
        for replica in range(INTERLEAVED.dp_degree):
            mine = [o for o in obs if o.replica == replica]
            span = max(end for o in mine for *_, end in o.ops)
            keys = [det.keys_for(replica, stage, INTERLEAVED.tp_degree) for stage in range(INTERLEAVED.pp_degree)]
            predicted = predict_replica(det.predictor, keys, mine[0].features, INTERLEAVED.p2p_s,
                                        interleaving=Interleaving(CHUNKS))
            errors.append(abs(predicted.total_s / span - 1))
    assert statistics.median(errors) < 0.01


@pytest.mark.parametrize("rank", [5, 2])
def test_a_one_point_five_x_slow_rank_is_named_within_three_iterations(rank):
    fault = f"slow:rank={rank},factor=1.5,at=60"
    _, events = _run(80, (fault,))
    assert len(events) == 1
    suspicion, outcome = events[0]
    assert suspicion.kind == "compute" and rank in suspicion.ranks and 60 <= suspicion.iteration <= 62
    assert isinstance(outcome, Verdict) and outcome.ranks == (rank,)
    assert outcome.factor == pytest.approx(1.5, rel=0.2)


def test_a_slow_link_between_stages_is_named_from_the_gaps_within_a_chunk():
    # Each micro-batch crosses the boundary once per chunk, so the slow link's sibling on the other
    # TP rank waits in its collectives for longer than under 1F1B: stage 0's group may be suspected
    # first, and its probes clear it. The link itself is named within three iterations.
    fault = "link:src=1,dst=5,factor=4,at=50"
    _, events = _run(70, (fault,))
    verdicts = [(s, o) for s, o in events if isinstance(o, Verdict)]
    assert verdicts, f"slow link not named: {events}"
    suspicion, outcome = verdicts[0]
    assert suspicion.kind == "link" and suspicion.iteration <= 53
    assert set(outcome.ranks) == {1, 5} and outcome.factor == pytest.approx(4.0, rel=0.2)
    assert all(o.kind == "link" for _, o in verdicts)


def test_the_cost_fit_sums_a_micro_batchs_chunk_ops_per_stage():
    # The same job under 1F1B and interleaved, same data and costs: the per-layer forward seconds
    # fitted to one iteration agree once each micro-batch's two chunk ops are summed; read op by
    # op, a chunk's op would pass for a whole stage's and the layer cost come out halved.
    layout = Layout.uniform(ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                                      vocab_size=1024, seq_length=4096, micro_batch_size=1), 2, 2, 2)
    # The two traces draw their documents and noise apart, so single iterations differ; over 40,
    # with one kind of documents throughout (no switch to long ones), the medians do not.
    spec = dataclasses.replace(SPEC, long_fraction=0.0, replica_deviation=0.0)
    plain = list(synthetic_trace(spec, 44, seed=3))[4:]
    chunked = list(synthetic_trace(dataclasses.replace(spec, num_chunks=CHUNKS), 44, seed=3))[4:]
    reference = statistics.median(fit_compute_costs(i, obs, layout).layer_forward_s for i, obs in plain)
    summed = statistics.median(fit_compute_costs(i, obs, layout, interleaving=Interleaving(CHUNKS)).layer_forward_s
                               for i, obs in chunked)
    op_by_op = statistics.median(fit_compute_costs(i, obs, layout).layer_forward_s for i, obs in chunked)
    assert summed == pytest.approx(reference, rel=0.05)
    assert op_by_op == pytest.approx(reference / CHUNKS, rel=0.1)


def test_quotas_come_in_whole_groups():
    assert assign_quotas([1.0, 1.0], [1.0, 2.0], 12, step=2) == (8, 4)
    assert all(q % 3 == 0 for q in assign_quotas([0.5, 0.5, 0.5], [1.0, 1.5, 3.0], 18, step=3))
    with pytest.raises(ValueError, match="whole steps"):
        assign_quotas([1.0, 1.0], [1.0, 1.0], 9, step=2)


def test_a_quota_re_plan_keeps_counts_the_interleaved_schedule_runs_and_prices_it():
    # PP2 x DP2, 12 micro-batches; rank 6 (stage 1 of replica 1) runs 2x slow. Layers stay.
    model = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
                      vocab_size=1024, seq_length=256, micro_batch_size=1, global_batch_size=12)
    layout = Layout.uniform(model, 1, 2, 2)
    hw = HardwareModel(layer_forward_s=0.01, output_forward_s=0.01, regroup_s=0.0,
                       interleaving=Interleaving(CHUNKS))
    slow = Health(speed={layout.replicas[1].stages[1].ranks[0]: 0.5})
    plan = plan_adaptation(layout, slow, hw, horizon_iters=100, stages_fixed=True)
    assert plan.action == "adapt"
    assert sum(plan.quotas) == 12 and all(q % 2 == 0 and q >= 2 for q in plan.quotas)
    assert plan.quotas[0] > plan.quotas[1]
    # Priced as the interleaved schedule runs: its smaller bubble makes the same split faster than
    # under 1F1B, and the even split it replaces costs what the schedule's simulation says.
    one_f_one_b = dataclasses.replace(hw, interleaving=Interleaving())
    assert plan.iteration_s_after < iteration_s(layout, plan.quotas, slow, one_f_one_b)
    even = iteration_s(layout, (6, 6), slow, hw)
    assert plan.iteration_s_before == pytest.approx(even)
    timing = replica_timing(layout.replicas[1], model, hw, slow)
    assert timing.simulate_s(6) == pytest.approx(pipeline_time_s(2, 6, timing.forward_s, timing.backward_s,
                                                                 timing.p2p_s, num_chunks=CHUNKS))
