"""A collective that outlasts ``--resihp-collective-timeout-s`` while no rank failed, on Megatron-LM's
own loop, 4 CPU ranks PP2 x DP2.

The first iteration of a script with a ``torch.compile`` fusion (``--cross-entropy-loss-fusion``,
as Megatron-LM's Llama scripts run) compiles on the last stage while the first stage waits in its
send, past a short collective timeout and past the hang timeout too. A rank compiling is not hung:
nobody died or hung, so the world re-forms as it was and redoes the iteration, whose compiled code
is cached now, and the training is stock Megatron-LM's.
A peer that outlasts the timeout again at the same iteration stops the job, naming the flag.
"""

from __future__ import annotations

import re

import pytest

from tests.dist.launch import check, read_events, run_job
from tests.dist.megatron_jobs import assert_same_training, job_args, replaced, stock_training

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

ITERATIONS = 4
# Short enough that the compile outlasts them (6-20 s here from a cold cache, depending on the
# host's pace), long enough for every other wait of the job.
HANG_TIMEOUT_S = 4
TIMEOUTS = ["--resihp-collective-timeout-s", "3", "--resihp-hang-timeout-s", str(HANG_TIMEOUT_S)]
# A peer only slow, never hung: the hang timeout far above its iterations.
SLOW_PEER_TIMEOUTS = ["--resihp-collective-timeout-s", "3", "--resihp-hang-timeout-s", "120"]


def pp2_dp2_args(tmp, name: str) -> list[str]:
    return replaced(job_args(tmp, name), {"--tensor-model-parallel-size": "1", "--train-iters": str(ITERATIONS)})


def test_a_first_iteration_compiling_past_the_collective_timeout_re_forms_the_world_as_it_was_exactly(tmp_path):
    fused = ["--cross-entropy-loss-fusion"]
    failure_free = stock_training(4, [*pp2_dp2_args(tmp_path / "stock", "ckpt"), *fused])
    events = tmp_path / "events.jsonl"
    # A cache of its own, so that the compile is not served by the failure-free run's.
    proc = run_job(4, [*pp2_dp2_args(tmp_path, "ckpt"), *fused, "--resihp-enable", "--resihp-event-log", str(events),
                       *TIMEOUTS], env_extra={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}, timeout_s=420)
    check(proc)
    assert "a collective outlasted --resihp-collective-timeout-s (3 s) while every rank stayed alive" in proc.stdout
    # The compile outlasted the hang timeout as well, and was told apart from a hang.
    assert ("has compiled a torch.compile graph for" in proc.stdout and
            f"past the hang timeout ({HANG_TIMEOUT_S} s)" in proc.stdout), proc.stdout[-3000:]
    assert " hung (" not in proc.stdout
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"], a["quotas"]) for a in adapted] == \
        [(1, 4, [], [4, 4])], adapted
    # The first stage waits for the compiling ranks to reach their recovery (up to 20 s here), and
    # then the world re-forms at once: not the hang timeout and more after the compile (10 s) later.
    waited = [float(s) for s in re.findall(r"adapted in place, [^(]*\(([0-9.]+) s since the failure surfaced\)",
                                           proc.stdout)]
    assert len(waited) == 4 and min(waited) < 9, waited
    (plan,) = read_events(events, "plan")
    assert plan["reason"].startswith("no rank of the layout failed; continue in place"), plan
    assert len(read_events(events, "start")) == 4  # one start per process: nothing restarted
    assert_same_training(proc.stdout, tmp_path / "ckpt", failure_free, iterations=range(1, ITERATIONS + 1))


def test_a_peer_past_the_collective_timeout_again_at_the_same_iteration_stops_the_job_naming_the_flag(tmp_path):
    # Rank 3 computes 100x slow through iteration 2, the redone one too.
    events = tmp_path / "events.jsonl"
    proc = run_job(4, [*pp2_dp2_args(tmp_path, "ckpt"), "--resihp-enable", "--resihp-event-log", str(events),
                       *SLOW_PEER_TIMEOUTS, "--resihp-inject", "slow:rank=3,factor=100,at=2,until=3"], timeout_s=420)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert [(a["iteration"], a["failed_ranks"]) for a in read_events(events, "adapted")] == [(2, [])]
    stopped = [line for line in proc.stdout.splitlines() if "again at this iteration after the world re-formed" in line]
    assert len(stopped) == 4 and all("raise --resihp-collective-timeout-s (3 s)" in line for line in stopped), \
        proc.stdout[-3000:]
    assert "iteration        3/" not in proc.stdout
