"""The interleaved schedule's virtual micro-batch order (``resihp_ext.schedule.virtual_microbatches``)
is megatron-core's own table. The whole op order, warm-up included, is checked against what
megatron-core runs in ``tests/dist/test_megatron_loop_interleaved.py``."""

from __future__ import annotations

import pytest

from resihp_ext.schedule import virtual_microbatches

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [2, 3, 4, 6])
def test_virtual_microbatches_are_megatron_cores_schedule_table(chunks, group):
    for count in range(1, 20):
        assert virtual_microbatches(count, chunks, group) == tuple(schedules.get_schedule_table(count, chunks, group))
