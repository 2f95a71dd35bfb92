"""Which micro-batch counts megatron-core's interleaved schedule runs (``resihp_ext.schedule``)."""

import pytest

from resihp_ext.schedule import interleaved_runs


# megatron-core 0.19.2 refuses, before any op: a group larger than the count ("should range in
# [PP, M]") and a last group shorter than the pipeline ("The remainder of M ... should be 0, or
# larger than or equal to the pipeline-parallel size").
@pytest.mark.parametrize("count, stages, group, runs", [
    (2, 2, 2, True), (3, 2, 2, False), (4, 2, 2, True), (1, 2, 2, False), (6, 2, 2, True),
    (5, 4, 4, False), (8, 4, 4, True), (12, 4, 4, True),
    (3, 2, 3, True), (5, 2, 3, True), (4, 2, 3, False), (2, 2, 3, False),
    (10, 4, 6, True), (7, 4, 6, False),
])
def test_the_counts_it_runs(count, stages, group, runs):
    assert interleaved_runs(count, stages, group) is runs

