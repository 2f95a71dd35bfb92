"""The interleaved schedule's op order (``resihp_ext.schedule.interleaved``) and its simulated time.

The order is checked here against its definition, by hand for one small case, and as a whole
against megatron-core's own functions in ``tests/executor/test_interleaved_order.py`` and against
what megatron-core runs in ``tests/dist/test_megatron_loop_interleaved.py``.
"""

import numpy as np
import pytest

from resihp_ext.schedule import OpKind, interleaved, interleaved_runs, one_f_one_b, pipeline_schedule, virtual_microbatches
from resihp_ext.detection.simulator import pipeline_time_s, simulate_iteration


def _names(ops):
    return " ".join(str(op) for op in ops)


def test_two_stages_two_chunks_four_microbatches_by_hand():
    # Groups of 2 through chunk 0, then chunk 1: virtual order 0 1 0.1 1.1 2 3 2.1 3.1. Stage 0 warms
    # up with 2 * (2 - 0 - 1) + (2 - 1) * 2 = 4 forwards, stage 1 with 2; backwards run the chunks in
    # reverse.
    stage0, stage1 = interleaved(2, 2, 4, 2)
    assert _names(stage0) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert _names(stage1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"


def test_the_last_group_holds_what_is_left():
    assert virtual_microbatches(5, 2, 3) == ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                             (3, 0), (4, 0), (3, 1), (4, 1))


@pytest.mark.parametrize("stages, chunks, group", [(2, 2, 2), (2, 3, 2), (3, 2, 3), (4, 2, 4), (4, 3, 5), (2, 2, 3)])
def test_every_stage_runs_each_op_once_and_backwards_follow_their_forwards(stages, chunks, group):
    for count in range(1, 14):
        if not interleaved_runs(count, stages, group):
            with pytest.raises(ValueError, match="does not run"):
                interleaved(stages, chunks, count, group)
            continue
        for ops in interleaved(stages, chunks, count, group):
            everything = {(kind, m, c) for kind in OpKind for m in range(count) for c in range(chunks)}
            assert sorted((op.kind, op.microbatch, op.chunk) for op in ops) == sorted(everything)
            done = set()
            for op in ops:  # a stage never runs a chunk's backward before its forward
                if op.kind is OpKind.BACKWARD:
                    assert (op.microbatch, op.chunk) in done
                else:
                    done.add((op.microbatch, op.chunk))


def test_one_chunk_is_one_f_one_b():
    assert pipeline_schedule(3, 5) == one_f_one_b(3, 5)
    assert interleaved(3, 1, 5, 3) == one_f_one_b(3, 5)


@pytest.mark.parametrize("stages, chunks", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_uniform_stages_take_the_interleaved_bubble(stages, chunks):
    # With equal ops and free transfers the interleaved schedule's bubble is (P - 1) / V of a
    # micro-batch's forward and backward, against P - 1 under 1F1B.
    for count in (stages, 2 * stages, 3 * stages):
        f, b = 1.0, 2.0
        assert pipeline_time_s(stages, count, f, b, num_chunks=chunks) == pytest.approx(
            (count + (stages - 1) / chunks) * (f + b))
        assert pipeline_time_s(stages, count, f, b) == pytest.approx((count + stages - 1) * (f + b))


def test_a_slow_stage_and_slow_transfers_cost_the_interleaved_schedule_more():
    stages, chunks, count = 2, 2, 6
    base = pipeline_time_s(stages, count, 1.0, 2.0, num_chunks=chunks)
    assert pipeline_time_s(stages, count, [1.0, 2.0], [2.0, 4.0], num_chunks=chunks) > base + count * 2.5
    # every micro-batch crosses the boundary twice per chunk pair and wraps once: transfers add up
    assert pipeline_time_s(stages, count, 1.0, 2.0, 0.2, num_chunks=chunks) > base


def test_durations_are_read_by_each_ops_place_in_its_kind():
    # The k-th forward of a stage is virtual micro-batch k: slowing column k slows that op only.
    schedule = interleaved(2, 2, 4, 2)
    f, b = np.ones((2, 8)), 2 * np.ones((2, 8))
    base = simulate_iteration(schedule, f, b)
    f[1, 7] += 5.0  # stage 1's last forward, F3.1, whose backward follows at once
    slow = simulate_iteration(schedule, f, b)
    assert slow.total_s == pytest.approx(base.total_s + 5.0)
    position = [str(op) for op in schedule[1]].index("F3.1")
    assert slow.op_finish_s[1][position] == pytest.approx(base.op_finish_s[1][position] + 5.0)
