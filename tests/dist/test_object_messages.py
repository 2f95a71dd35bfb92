"""Objects sent rank to rank without the sender waiting (megatron.resihp.object_messages), on real gloo ranks."""

from __future__ import annotations

import datetime

from megatron.resihp.object_messages import CAPACITY, Outbox, recv_object
from tests.dist.ranks import run_ranks

SMALL = {"rank": 1, "ops": [("F", 0, 0.0, 0.25)]}
LARGE = list(range(CAPACITY))  # pickles to several times the first message


def _exchange(rank, world_size, store):
    if rank != 0:
        outbox = Outbox()
        outbox.send(LARGE, [0], tag=5)
        under_way = len(outbox)  # nobody has received yet: rank 0 waits for the key below
        store.set(f"sent{rank}", "1")
        outbox.send(SMALL, [0], tag=5)  # waits until rank 0 took LARGE, not for SMALL
        outbox.send(f"other tag from {rank}", [0], tag=6)
        kept = len(outbox)
        outbox.wait_all()
        return under_way, kept
    store.wait([f"sent{r}" for r in range(1, world_size)], datetime.timedelta(seconds=30))
    return [[recv_object(r, tag=5), recv_object(r, tag=5), recv_object(r, tag=6)] for r in range(1, world_size)]


def test_the_sender_goes_on_before_the_receiver_takes_the_objects_and_large_ones_arrive_whole():
    results = run_ranks(_exchange, 3)
    assert results[0] == [[LARGE, SMALL, "other tag from 1"], [LARGE, SMALL, "other tag from 2"]]
    for rank in (1, 2):
        under_way, kept = results[rank]
        assert under_way == 2  # the large object went as two messages, neither taken yet
        assert kept == 1  # only the newest batch is held; older ones were waited on
