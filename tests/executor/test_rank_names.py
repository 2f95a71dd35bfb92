"""Log lines about failures name launch ranks, also after the world re-formed.

A re-formed world numbers its members afresh; users know ranks by what they launched (and
killed). The world below is a launch world of 8 after launch rank 2 died: its ranks 0..6 are
launch ranks 0, 1, 3, 4, 5, 6, 7, so world rank 2 is launch rank 3, and a line that named it
"rank 2" would point at the rank that died earlier.
"""

import argparse
import logging
import types

from megatron.resihp.detection import describe
from megatron.resihp.heartbeat import HeartbeatMonitor
from megatron.resihp.heartbeat_beacon import DEAD_MARK
from megatron.resihp.logging_utils import rank_name, ranks_name, world_numbered
from megatron.resihp.run_state import RunState
from resihp_ext.detection.validation import fail_stop_verdict

LAUNCH = RunState(layout=None, groups=None, rank=0, launch_rank=0, identity=tuple(range(8)), generation=0,
                  objects=None, quotas=())
# Launch rank 2 left; the survivors keep their order in the new world.
REFORMED = LAUNCH.renumbered({old: new for new, old in enumerate(r for r in range(8) if r != 2)})


def test_the_reformed_identity_is_the_one_the_lines_below_use():
    assert REFORMED == (0, 1, 3, 4, 5, 6, 7)


def test_a_rank_of_a_reformed_world_is_named_by_its_launch_rank():
    assert rank_name(2, REFORMED) == "launch rank 3 (world rank 2)"
    assert ranks_name([4, 2], REFORMED) == "launch ranks [3, 5] (world ranks [2, 4])"
    # Where the numbers agree the world's number would only repeat it.
    assert rank_name(1, REFORMED) == "launch rank 1"
    assert ranks_name([0, 1], REFORMED) == "launch ranks [0, 1]"
    assert rank_name(5, LAUNCH.identity) == "launch rank 5"
    # A rank moving to the next world keeps its launch name.
    assert rank_name(4, REFORMED, new_rank=3) == "launch rank 5 (world rank 4 -> 3)"
    # A number this world does not have is not passed off as a launch rank.
    assert rank_name(9, REFORMED) == "world rank 9"


def test_a_verdict_names_launch_ranks_and_says_its_reason_is_in_world_ranks():
    verdict = fail_stop_verdict("dead", [2], iteration=7)
    line = describe(verdict, REFORMED)
    assert line.startswith("verdict dead launch ranks [3] (world ranks [2]): ranks [2] stopped sending heartbeats")
    assert "[in world ranks; world ranks 0.. are launch ranks [0, 1, 3, 4, 5, 6, 7]]" in line
    # Before any re-form both numberings agree, and nothing is added.
    assert describe(verdict, LAUNCH.identity) == "verdict dead launch ranks [2]: ranks [2] stopped sending heartbeats"


def test_a_large_world_marks_the_numbering_without_listing_it():
    identity = tuple(r for r in range(200) if r != 2)
    assert world_numbered("dead ranks [5] broke replicas [0]", identity) == \
        "dead ranks [5] broke replicas [0] [in world ranks]"
    assert world_numbered("dead ranks [5] broke replicas [0]", tuple(range(200))) == "dead ranks [5] broke replicas [0]"


class _Store:
    """Enough of a TCPStore for one heartbeat poll."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def test_the_heartbeat_warning_names_launch_ranks(caplog):
    store, now = _Store(), 1000.0
    monitor = HeartbeatMonitor(store, 0, len(REFORMED), interval_s=0.2, timeout_s=1.5, prefix="hb/",
                               clock=lambda: now, identity=REFORMED)
    monitor._started_at = now
    for rank in range(len(REFORMED)):
        store.set(f"hb/{rank}", f"{now:.6f}:5" + (f":{DEAD_MARK}" if rank == 2 else ""))
    with caplog.at_level(logging.WARNING, logger="megatron.resihp.heartbeat"):
        monitor._poll()
    assert monitor.dead_ranks == {2}
    assert "heartbeat: launch rank 0 sees launch ranks [3] (world ranks [2]) dead ([3]: process exited)" in caplog.text


def test_the_failure_callback_names_the_watcher_and_the_failed_by_launch_rank(capsys):
    from megatron.resihp.resilience import ResilienceHooks

    hooks = ResilienceHooks.__new__(ResilienceHooks)
    emitted = []
    hooks.events = types.SimpleNamespace(emit=lambda event, iteration, **fields: emitted.append(fields))
    hooks.cfg = argparse.Namespace(enable=False)
    hooks.monitor = None
    hooks.planned_out = set()
    hooks.iteration = 7
    # World rank 4 (launch rank 5) watches; world rank 2 (launch rank 3) dies.
    hooks._on_failed("dead", 4, REFORMED)(frozenset({2}), 0.0)
    line = capsys.readouterr().out
    assert "resihp: launch rank 5 (world rank 4) sees verdict dead launch ranks [3] (world ranks [2])" in line
    # The event keeps its world ranks (readers of the log compare them with the world's layout).
    assert emitted[0]["ranks"] == [2]

