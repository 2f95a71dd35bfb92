"""Failure timelines: arrival statistics, segments, and goodput accounting worked out by hand."""

import functools
import math

import pytest

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.peers.checkpoint_restart import checkpoint_restart
from resihp_ext.peers.response import Response
from resihp_ext.peers.timeline import Episode, Rates, generate, run, segments
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.plan import Plan

HW = HardwareModel(layer_forward_s=1.0, backward_factor=2.0, tp_efficiency=1.0, include_embedding_cost=False,
                   link_bandwidth_Bps=1e30, grad_bytes_per_param=0.0, regroup_s=5.0, restart_s=600.0)
MODEL = ModelSpec(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=16, micro_batch_size=1, global_batch_size=12)
LAYOUT = Layout.uniform(MODEL, 1, 1, 4)  # 4 replicas of one GPU, 3 micro-batches each: 9 s/iter


def test_arrivals_match_the_configured_rates():
    # 1,000 GPUs at 2e-6 and 1e-6 per GPU-second over 1e6 s: 2,000 and 1,000 expected
    rates = Rates(fail_stop_per_gpu_s=2e-6, fail_slow_per_gpu_s=1e-6, repair_s=500.0, slow_s=300.0)
    episodes = generate(tuple(range(1000)), 1e6, rates, seed=7)
    stops = [e for e in episodes if e.kind == "fail-stop"]
    slows = [e for e in episodes if e.kind == "fail-slow"]
    # Poisson counts: within 4 standard deviations (sqrt of the mean)
    assert abs(len(stops) - 2000) < 4 * math.sqrt(2000)
    assert abs(len(slows) - 1000) < 4 * math.sqrt(1000)
    # exponential durations: the sample mean within 4 standard errors (sd = mean / sqrt(n))
    repair = sum(e.end_s - e.start_s for e in stops) / len(stops)
    assert abs(repair - 500.0) < 4 * 500.0 / math.sqrt(len(stops))
    assert all(1 <= len(e.ranks) <= 8 and len({r // 8 for r in e.ranks}) == 1 for e in slows)
    assert all(0.2 <= e.speed <= 0.8 for e in slows)
    assert generate(tuple(range(1000)), 1e6, rates, seed=7) == episodes


def test_segments_union_overlapping_episodes():
    eps = (Episode("fail-stop", 10.0, 30.0, (1,)), Episode("fail-slow", 20.0, 40.0, (1, 2), 0.5))
    cuts = segments(eps, 50.0)
    assert [(a, b) for a, b, _ in cuts] == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50)]
    assert cuts[2][2] == Health(dead={1}, speed={2: 0.5})  # the dead rank is not also slow
    assert cuts[3][2] == Health(speed={1: 0.5, 2: 0.5})
    assert cuts[4][2] == Health()


def test_response_with_a_ski_rental_switch():
    first = Plan("adapt", None, (), (), 3.0, 2.0, 0.0, "S1")
    then = Plan("adapt", None, (), (), 2.0, 1.0, 10.0, "S2")
    answer = Response("x", first, then, 10)
    # 10 iterations at 2 s, 10 s to switch, 90 at 1 s: 120 s for 100
    assert answer.average_iteration_s(100) == pytest.approx(1.2)
    # in 50 s: 10 iterations (20 s), the switch (10 s), 20 more
    assert answer.iterations_in(50.0) == pytest.approx(30.0)


def test_goodput_accounting_adds_up_for_checkpoint_restart():
    policy = functools.partial(checkpoint_restart, gpus_per_node=1)
    episodes = (Episode("fail-stop", 1050.0, 3050.0, (2,)),)
    result = run(policy, "checkpoint-restart", LAYOUT, episodes, 5000.0, HW, checkpoint_interval_s=90.0,
                 checkpoint_s=10.0)
    # checkpoints every 100 s of wall time take 10 s: 0.9 of the time works.
    # [0, 1050): 1050 / 9 * 0.9 = 105 iterations.
    # [1050, 3050): restart 600 s + 50 s lost since the checkpoint at 1000 s; 3 replicas at 12 s:
    #   (2000 - 650) / 12 * 0.9 = 101.25.
    # [3050, 5000): the node is back; a planned restart (600 s + a 10 s checkpoint), 9 s again:
    #   (1950 - 610) / 9 * 0.9 = 134.
    assert [p[2] for p in result.pieces] == pytest.approx([105.0, 101.25, 134.0])
    assert result.iterations == pytest.approx(340.25)
    assert result.ettr == pytest.approx(340.25 * 9.0 / 5000.0)
    assert result.goodput == pytest.approx(340.25 * 12 / 5000.0)


def test_a_quiet_run_loses_only_checkpoint_time():
    result = run(functools.partial(checkpoint_restart, gpus_per_node=1), "cr", LAYOUT, (), 1000.0, HW,
                 checkpoint_interval_s=90.0, checkpoint_s=10.0)
    assert result.ettr == pytest.approx(0.9)
