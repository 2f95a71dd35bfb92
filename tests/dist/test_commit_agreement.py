"""Members of a layout change agree, through a real TCPStore, on whether every one of them finished.

``recovery.agree_on_commit`` decides whether a re-plan or a readmission stands after a failure;
every member must reach the same answer, or survivors would recover from different layouts.
Members here are threads with store clients of their own.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from megatron.training.recovery import agree_on_commit

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
