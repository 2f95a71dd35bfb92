"""Standbys that are healthy again rejoin and restore their launch replicas (resihp_ext.planner.readmission)."""

import pytest

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.alike_stages import replica_with_split
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.readmission import plan_readmission

MODEL = ModelSpec(4, 64, 4, 256, 1024, 128, 1, 16)
HW = HardwareModel(layer_forward_s=0.01, output_forward_s=0.005, tp_efficiency=1.0, regroup_s=0.5)


def _after_exclusion(launch: Layout, slow: int, factor: float):
    """The running layout, identity and quotas after a fail-slow plan left ``slow`` out."""
    plan = plan_adaptation(launch, Health(speed={slow: 1 / factor}), HW, horizon_iters=40,
                           uniform_tp_per_replica=True)
    assert plan.action == "adapt" and not plan.layout.contains(slow), plan.reason  # the premise
    kept = sorted(plan.layout.world_ranks)
    dense = {old: new for new, old in enumerate(kept)}
    return plan.layout.relabel(dense), kept, plan.quotas


def test_a_healthy_standby_restores_the_tp_group_it_left():
    launch = Layout.uniform(MODEL, 2, 1, 2)
    layout, identity, quotas = _after_exclusion(launch, slow=1, factor=3.0)
    assert identity == [0, 2, 3] and layout.world_size == 3
    out = plan_readmission(layout, identity, launch, {1: 1.0}, Health(), HW, quotas, horizon_iters=40)
    assert out.plan.action == "adapt", out.plan.reason
    assert out.joiners == (1,) and out.new_rank_of(1, 3) == 3
    # Launch rank 1 joins as rank 3; the restored replica keeps replica 0's place.
    assert [rep.ranks for rep in out.plan.layout.replicas] == [(0, 3), (1, 2)]
    assert out.plan.layout.replicas[0].stages[0].tp_degree == 2
    assert out.plan.quotas == (8, 8) and out.plan.iteration_s_after < out.plan.iteration_s_before
    assert "standbys 1 (1.00x) rejoin" in out.plan.reason


def test_a_standby_still_slow_is_not_taken_back():
    launch = Layout.uniform(MODEL, 2, 1, 2)
    layout, identity, quotas = _after_exclusion(launch, slow=3, factor=3.0)
    out = plan_readmission(layout, identity, launch, {3: 3.0}, Health(), HW, quotas, horizon_iters=40)
    assert out.plan.action == "keep" and out.plan.layout is layout and out.joiners == ()
    assert "does not pay off" in out.plan.reason


def test_standbys_of_a_whole_dropped_replica_come_back_as_a_new_replica():
    launch = Layout.uniform(MODEL, 1, 2, 3)  # ranks: replica d holds d (stage 0) and 3 + d (stage 1)
    running = launch.with_replicas(launch.replicas[:2])  # replica 2 (ranks 2, 5) was dropped
    identity = [0, 1, 3, 4]
    layout = running.relabel({r: i for i, r in enumerate(identity)})
    out = plan_readmission(layout, identity, launch, {2: 1.0, 5: 1.0}, Health(), HW, (8, 8), horizon_iters=40)
    assert out.plan.action == "adapt", out.plan.reason
    assert out.joiners == (2, 5) and out.plan.layout.num_replicas == 3
    assert out.plan.layout.replicas[2].ranks == (4, 5) and sum(out.plan.quotas) == 16


def test_a_dropped_replica_comes_back_with_the_running_split_when_replicas_must_be_alike():
    launch = Layout.uniform(MODEL, 1, 2, 3)
    # Replica 2 (ranks 2, 5) was dropped and the others took layers [1, 3] since.
    running = launch.with_replicas(replica_with_split(rep, (1, 3)) for rep in launch.replicas[:2])
    identity = [0, 1, 3, 4]
    layout = running.relabel({r: i for i, r in enumerate(identity)})
    free = plan_readmission(layout, identity, launch, {2: 1.0, 5: 1.0}, Health(), HW, (8, 8), horizon_iters=40)
    assert free.plan.layout.replicas[2].layers_per_stage == (2, 2)  # its launch split
    alike = plan_readmission(layout, identity, launch, {2: 1.0, 5: 1.0}, Health(), HW, (8, 8), horizon_iters=40,
                             alike=True)
    assert alike.plan.action == "adapt" and alike.joiners == (2, 5), alike.plan.reason
    assert alike.plan.layout.replicas_alike() and alike.plan.layout.replicas[2].layers_per_stage == (1, 3)
    assert alike.plan.layout.replicas[2].ranks == (4, 5)


def test_a_standby_whose_launch_replica_lost_another_rank_is_not_taken_back():
    launch = Layout.uniform(MODEL, 2, 1, 2)
    # Launch rank 3 stands by, but its TP sibling 2 is gone (a fail-stop since).
    layout = Layout((ReplicaSpec((StageSpec(0, 4, (0, 1)),)),), MODEL)
    out = plan_readmission(layout, [0, 1], launch, {3: 1.0}, Health(), HW, (16,), horizon_iters=40)
    assert out.plan.action == "keep" and "complete no launch replica" in out.plan.reason


def test_no_report_keeps_the_layout():
    launch = Layout.uniform(MODEL, 2, 1, 2)
    layout, identity, quotas = _after_exclusion(launch, slow=3, factor=3.0)
    assert plan_readmission(layout, identity, launch, {}, Health(), HW, quotas, 40).plan.action == "keep"


@pytest.mark.parametrize("identity, ready, match", [
    ([0, 0, 2], {3: 1.0}, "twice"),
    ([0, 1, 2], {2: 1.0}, "work in this world"),
    ([0, 1, 2], {3: 0.5}, "slowdown"),
])
def test_rejects_inconsistent_reports(identity, ready, match):
    launch = Layout.uniform(MODEL, 2, 1, 2)
    layout, _, quotas = _after_exclusion(launch, slow=3, factor=3.0)
    with pytest.raises(ValueError, match=match):
        plan_readmission(layout, identity, launch, ready, Health(), HW, quotas, 40)


def test_every_plan_carries_and_prices_exactly_the_shard_maps_transfers():
    """One description of who sends which unit: the fail-slow plan (a TP shrink), the readmission
    after it and a fail-stop takeover each carry ``shard_map.transfers`` between their layouts,
    and charge exactly those transfers' busiest link."""
    from resihp_ext.planner.moves import move_time_s
    from resihp_ext.planner.survivors import continuing_layout, plan_survivors
    from resihp_ext.shard_map import transfers

    launch = Layout.uniform(MODEL, 2, 1, 2)
    shrink = plan_adaptation(launch, Health(speed={1: 1 / 3.0}), HW, horizon_iters=40, uniform_tp_per_replica=True)
    layout, identity, quotas = _after_exclusion(launch, slow=1, factor=3.0)
    back = plan_readmission(layout, identity, launch, {1: 1.0}, Health(), HW, quotas, horizon_iters=40).plan
    for old, plan in ((launch, shrink), (layout, back)):
        assert [t.what for t in plan.transfers] == [t.what for t in transfers(old, plan.layout)]
        assert plan.moves and all(t.num_bytes > 0 for t in plan.moves if not t.replicated)
        assert plan.one_time_cost_s == pytest.approx(HW.regroup_s + move_time_s(plan.transfers, HW))
    pp2 = Layout.uniform(MODEL, 1, 2, 3)  # rank = replica + 3 * stage
    takeover = plan_survivors(pp2, frozenset({1, 2}), hw=HW)
    assert takeover.transfers and [t.what for t in takeover.transfers] == [
        t.what for t in transfers(pp2, continuing_layout(pp2, takeover), frozenset({1, 2}))]
    crossing = [t for t in takeover.transfers if t.crosses]  # replica 0's stage 0 to rank 4, which takes it
    assert {t.src for t in crossing} == {0} and {t.dst for t in crossing} == {4}
