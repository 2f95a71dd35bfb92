"""Members of a layout change agree, through a real TCPStore, on whether every one of them finished.

``recovery.agree_on_commit`` decides whether a re-plan or a readmission stands after a failure;
every member must reach the same answer, or survivors would recover from different layouts.
Members here are threads with store clients of their own.
"""

from __future__ import annotations

import datetime
import random
import threading
import time

import pytest
import torch.distributed as dist

from megatron.resihp.recovery import agree_on_commit

NEVER = lambda: None  # noqa: E731 - a stop that never fires


@pytest.fixture()
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store


def client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def agree_in_threads(server, members: list[tuple[bool, object]], wait_s: float = 10.0) -> list[bool]:
    """Each (finished, stop) runs ``agree_on_commit`` in a thread; the answers in that order."""
    answers: list = [None] * len(members)

    def member(i: int, finished: bool, stop) -> None:
        answers[i] = agree_on_commit(client(server), "step/", len(members), finished, stop, wait_s)

    threads = [threading.Thread(target=member, args=(i, *m)) for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return answers


def test_every_member_finished_commits(server):
    assert agree_in_threads(server, [(True, NEVER)] * 3) == [True, True, True]


def test_one_member_that_did_not_finish_abandons_for_everyone(server):
    assert agree_in_threads(server, [(True, NEVER), (False, NEVER), (True, NEVER)]) == [False, False, False]


def test_a_member_that_finishes_after_another_gave_up_abandons_too(server):
    # A member gave up (it saw a failure) while another was still moving state: the late one's
    # mark must not make it commit alone.
    assert agree_on_commit(client(server), "step/", 2, finished=False, stop=NEVER, wait_s=5.0) is False
    assert agree_on_commit(client(server), "step/", 2, finished=True, stop=NEVER, wait_s=5.0) is False


def test_a_failure_seen_after_the_last_member_finished_still_commits(server):
    # The first member is waiting; the second finishes (and may die at once), and only then does the
    # first see a failure: everyone had finished, so the new layout stands for both.
    late: list[bool] = []

    def failure_seen_after_the_other_finished() -> str:
        late.append(agree_on_commit(client(server), "step/", 2, finished=True, stop=NEVER, wait_s=5.0))
        return "rank 1 failed"

    first = agree_on_commit(client(server), "step/", 2, finished=True, stop=failure_seen_after_the_other_finished,
                            wait_s=5.0)
    assert late == [True] and first is True


def test_a_missing_member_abandons_at_the_deadline(server):
    # A member that never arrives (hung, and not yet named) is given up on after wait_s.
    assert agree_on_commit(client(server), "step/", 2, finished=True, stop=NEVER, wait_s=0.3) is False
    # and the member that arrives late learns that, rather than committing.
    assert agree_on_commit(client(server), "step/", 2, finished=True, stop=NEVER, wait_s=0.3) is False


class _Died(Exception):
    """A member's process ends here: it makes no further store call."""


class DiesAfter:
    """A real store client whose member dies after ``calls`` store writes or reads (None: never)."""

    def __init__(self, store, calls: int | None) -> None:
        self.store, self.left = store, calls

    def __getattr__(self, name):
        op = getattr(self.store, name)

        def call(*args):
            if self.left is not None:
                if self.left == 0:
                    raise _Died
                self.left -= 1
            return op(*args)
        return call


@pytest.mark.parametrize("dies_after_calls", [1, 2, 3, 4])
def test_a_member_that_dies_as_it_gives_up_leaves_the_others_one_answer(server, dies_after_calls):
    # Three members finish. The first sees a failure only after the third has finished, gives up,
    # and dies between two of its store calls. The second, polling slowly, looks only after that;
    # it must answer as the third did. (Once, a member that died between counting its give-up and
    # publishing the decision left the second abandoning while the third had committed.)
    second: list[bool] = []
    waiting = threading.Thread(target=lambda: second.append(
        agree_on_commit(client(server), "step/", 3, finished=True, stop=NEVER, wait_s=5.0, poll_s=0.5)))
    waiting.start()
    time.sleep(0.1)  # the second member has counted itself and sleeps
    third: list[bool] = []

    def failure_seen_after_the_third_finished() -> str:
        third.append(agree_on_commit(client(server), "step/", 3, finished=True, stop=NEVER, wait_s=5.0))
        return "rank 2 failed"

    with pytest.raises(_Died):
        agree_on_commit(DiesAfter(client(server), dies_after_calls), "step/", 3, finished=True,
                        stop=failure_seen_after_the_third_finished, wait_s=5.0)
    if not third:  # the first died before it looked for failures: the third finishes after that
        failure_seen_after_the_third_finished()
    waiting.join(timeout=30)
    assert second == third and len(third) == 1, (second, third)


def test_members_agree_whatever_order_they_finish_fail_give_up_and_die_in(server):
    # Steps of 4 members: a member finishes or not, arrives after a random delay, may see a failure
    # at a random moment, and may die between any two of its store calls. In every step the live
    # members answer alike, and the answer is commit only if every member finished.
    rng = random.Random(7)
    clients = [client(server) for _ in range(4)]
    for step in range(30):
        plan = [(rng.random() < 0.85, rng.uniform(0, 0.02), rng.choice([None, rng.uniform(0, 0.04)]),
                 rng.choice([None, None, 0, 1, 2, 3])) for _ in clients]
        answers: list = [None] * len(plan)

        def member(i: int, finished: bool, delay_s: float, fails_at_s: float | None, dies_after: int | None) -> None:
            time.sleep(delay_s)
            start = time.monotonic()
            stop = (lambda: None) if fails_at_s is None else (
                lambda: "a rank failed" if time.monotonic() - start > fails_at_s else None)
            try:
                answers[i] = agree_on_commit(DiesAfter(clients[i], dies_after), f"step{step}/", len(plan), finished,
                                             stop, wait_s=0.1, poll_s=0.001)
            except _Died:
                answers[i] = "died"

        threads = [threading.Thread(target=member, args=(i, *m)) for i, m in enumerate(plan)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        live = {a for a in answers if a != "died"}
        assert len(live) <= 1 and None not in answers, (plan, answers)
        assert True not in live or all(finished for finished, *_ in plan), (plan, answers)
