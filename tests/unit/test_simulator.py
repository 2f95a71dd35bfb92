"""Iteration simulator: hand-computed 1F1B timings, edge cases, and the uniform fast path."""

import time

import numpy as np
import pytest

from resihp_ext.schedule import Op, OpKind, one_f_one_b
from resihp_ext.detection.simulator import IterationPrediction, pipeline_time_s, simulate_iteration


def test_two_stages_two_microbatches_by_hand():
    # Stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1; forward 1 s, backward 2 s.
    # F(0,0)=1 F(0,1)=2 | F(1,0)=2 B(1,0)=4 F(1,1)=5 B(1,1)=7 | B(0,0)=max(2,4)+2=6 B(0,1)=9
    pred = simulate_iteration(one_f_one_b(2, 2), [[1, 1], [1, 1]], [[2, 2], [2, 2]])
    assert isinstance(pred, IterationPrediction)
    assert pred.total_s == pytest.approx(9.0)
    assert pred.stage_finish_s == pytest.approx((9.0, 7.0))
    assert pred.op_finish_s[0] == pytest.approx((1.0, 2.0, 6.0, 9.0))
    assert pred.op_finish_s[1] == pytest.approx((2.0, 4.0, 5.0, 7.0))


def test_p2p_and_allreduce_by_hand():
    # Same as above with 0.5 s per transfer and 1 s gradient sync:
    # F(1,0)=1.5+1=2.5 B(1,0)=4.5 F(1,1)=max(4.5, 2.5)+1=5.5 B(1,1)=7.5
    # B(0,0)=max(2, 4.5+0.5)+2=7 B(0,1)=max(7, 7.5+0.5)+2=10 -> +1 sync = 11
    pred = simulate_iteration(one_f_one_b(2, 2), [[1, 1], [1, 1]], [[2, 2], [2, 2]], p2p_s=[0.5], allreduce_s=1.0)
    assert pred.total_s == pytest.approx(11.0)
    assert pred.stage_finish_s == pytest.approx((11.0, 8.5))


def test_heterogeneous_microbatches_slow_one_op():
    base = simulate_iteration(one_f_one_b(2, 2), [[1, 1], [1, 1]], [[2, 2], [2, 2]]).total_s
    # A slower forward of micro-batch 1 on stage 1 lies on the critical path: +3 s.
    slow = simulate_iteration(one_f_one_b(2, 2), [[1, 1], [1, 4]], [[2, 2], [2, 2]]).total_s
    assert slow == pytest.approx(base + 3.0)


def test_single_stage_is_sum_of_ops():
    f = [[0.1, 0.2, 0.3]]
    b = [[0.4, 0.5, 0.6]]
    assert simulate_iteration(one_f_one_b(1, 3), f, b, allreduce_s=0.05).total_s == pytest.approx(2.15)


def test_zero_microbatches():
    pred = simulate_iteration(one_f_one_b(4, 0), [[]] * 4, [[]] * 4, allreduce_s=0.25)
    assert pred.total_s == pytest.approx(0.25)
    assert pipeline_time_s(4, 0, 1.0, 2.0) == 0.0


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8, 13])
def test_pipeline_time_equals_simulation(num_stages, num_microbatches):
    rng = np.random.default_rng(num_stages * 100 + num_microbatches)
    for stage_f, stage_b, link in [
        ([1.0] * num_stages, [2.0] * num_stages, 0.0),
        (list(rng.uniform(0.5, 2, num_stages)), list(rng.uniform(1, 4, num_stages)), 0.0),
        (list(rng.uniform(0.5, 2, num_stages)), list(rng.uniform(1, 4, num_stages)), list(rng.uniform(0, 0.3, num_stages - 1))),
        ([1.0] * num_stages, [2.0] * num_stages, 0.2),
    ]:
        expected = simulate_iteration(
            one_f_one_b(num_stages, num_microbatches),
            [[f] * num_microbatches for f in stage_f],
            [[b] * num_microbatches for b in stage_b],
            link,
        ).total_s
        assert pipeline_time_s(num_stages, num_microbatches, stage_f, stage_b, link) == pytest.approx(expected)


def test_closed_form_uniform():
    assert pipeline_time_s(4, 8, 1.0, 2.0) == pytest.approx((8 + 4 - 1) * 3.0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="p2p_s"):
        simulate_iteration(one_f_one_b(3, 2), [[1, 1]] * 3, [[1, 1]] * 3, p2p_s=[0.1])
    with pytest.raises(ValueError, match="forward_s"):
        simulate_iteration(one_f_one_b(3, 2), [[1, 1]] * 2, [[1, 1]] * 3)
    with pytest.raises(ValueError, match="deadlock"):
        bad = ((Op(OpKind.BACKWARD, 0), Op(OpKind.FORWARD, 0)), (Op(OpKind.FORWARD, 0), Op(OpKind.BACKWARD, 0)))
        simulate_iteration(bad, [[1]] * 2, [[1]] * 2)


def test_sixteen_stages_sixty_four_microbatches_is_fast():
    rng = np.random.default_rng(0)
    schedule = one_f_one_b(16, 64)
    f, b = rng.uniform(1, 2, (16, 64)), rng.uniform(2, 4, (16, 64))
    simulate_iteration(schedule, f, b)
    start = time.perf_counter()
    for _ in range(20):
        simulate_iteration(schedule, f, b, 0.01, 0.1, keep_ops=False)
    per_call = (time.perf_counter() - start) / 20
    assert per_call < 0.02  # ~1 ms on a laptop core; generous bound for loaded CI machines


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    num_stages=st.integers(1, 5),
    num_microbatches=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    link=st.floats(0.0, 0.5),
)
def test_longest_path_bounds_and_monotonicity(num_stages, num_microbatches, seed, link):
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.1, 2.0, (num_stages, num_microbatches))
    b = rng.uniform(0.1, 4.0, (num_stages, num_microbatches))
    schedule = one_f_one_b(num_stages, num_microbatches)
    total = simulate_iteration(schedule, f, b, link).total_s
    # No stage can finish before doing all its own work; nothing takes longer than running
    # every op and transfer one after another.
    assert total >= max(f.sum(axis=1) + b.sum(axis=1)) - 1e-9
    assert total <= f.sum() + b.sum() + 2 * link * (num_stages - 1) * num_microbatches + 1e-9
    # Slowing one op never makes the iteration faster.
    s, m = rng.integers(num_stages), rng.integers(num_microbatches)
    slower = b.copy()
    slower[s, m] += 1.0
    assert simulate_iteration(schedule, f, slower, link).total_s >= total - 1e-9
