"""Re-plans that keep every replica alike: one shared layer split plus quotas (``stages_alike``)."""

import dataclasses

import pytest

from resihp_ext import shard_map
from resihp_ext.detection.validation import Verdict, VerdictKind
from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec, replica_shape
from resihp_ext.planner import HardwareModel, Health, plan_adaptation
from resihp_ext.planner.alike_stages import candidate_splits, with_split
from resihp_ext.planner.fail_slow import decide_fail_slow
from resihp_ext.planner.memory import largest_stage_bytes, megatron_state_bytes
from resihp_ext.planner.moves import state_moves

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=2, global_batch_size=32)
# TP2 x PP2 x DP2: stage 0 is ranks (0, 1) in replica 0 and (2, 3) in replica 1; stage 1 is (4, 5), (6, 7).
LAYOUT = Layout.uniform(MODEL, tp_degree=2, pp_degree=2, dp_degree=2)
HW = HardwareModel(layer_forward_s=0.01, output_forward_s=0.002, regroup_s=0.5)
STAGE0_SLOW = Health(speed={0: 0.5, 2: 0.5})  # the stage-0 TP group of both replicas runs 2x slow


def _stage_ranks(layout: Layout) -> list[list[tuple[int, ...]]]:
    return [[st.ranks for st in rep.stages] for rep in layout.replicas]


def _assert_alike_and_in_place(layout: Layout) -> None:
    assert layout.replicas_alike()
    assert len({rep.layers_per_stage for rep in layout.replicas}) == 1
    assert _stage_ranks(layout) == _stage_ranks(LAYOUT)  # every stage keeps its ranks and TP group


def test_layers_leave_the_slow_first_stage_of_every_replica_alike():
    assert LAYOUT.replicas[0].stages[0].ranks == (0, 1) and LAYOUT.replicas[1].stages[0].ranks == (2, 3)
    plan = plan_adaptation(LAYOUT, STAGE0_SLOW, HW, stages_alike=True)
    assert plan.action == "adapt" and plan.layout != LAYOUT
    _assert_alike_and_in_place(plan.layout)
    assert plan.layout.replicas[0].stages[0].num_layers < 4
    assert plan.spare_ranks == () and sum(plan.quotas) == MODEL.num_microbatches
    assert plan.transfers == state_moves(LAYOUT, plan.layout, frozenset(), HW)
    assert [t.what for t in plan.transfers] == [t.what for t in shard_map.transfers(LAYOUT, plan.layout)]
    assert plan.moves and plan.iteration_s_after < plan.iteration_s_before
    split = list(plan.layout.replicas[0].layers_per_stage)
    assert plan.reason.startswith(f"adapt: every replica: layers [4, 4]->{split}; quotas ")
    # Quotas alone cannot help here: both replicas are slow alike.
    assert plan_adaptation(LAYOUT, STAGE0_SLOW, HW, stages_fixed=True).action == "keep"


@pytest.mark.parametrize("rank", range(8))
@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0])
def test_one_slow_rank_gives_one_shared_split_never_worse_than_quotas_alone(rank, factor):
    health = Health(speed={rank: 1.0 / factor})
    plan = plan_adaptation(LAYOUT, health, HW, stages_alike=True)
    quotas_only = plan_adaptation(LAYOUT, health, HW, stages_fixed=True)
    _assert_alike_and_in_place(plan.layout)
    assert plan.spare_ranks == ()
    assert plan.iteration_s_after <= quotas_only.iteration_s_after * (1 + 1e-9)
    if plan.layout == LAYOUT:
        assert plan.transfers == ()
    else:
        assert plan.transfers == state_moves(LAYOUT, plan.layout, frozenset(), HW)


def test_a_healthy_layout_is_kept():
    plan = plan_adaptation(LAYOUT, Health(), HW, stages_alike=True)
    assert plan.action == "keep" and plan.layout == LAYOUT and plan.transfers == ()
    assert plan.reason == "keep: no affected replica"
    # Quotas skewed for a slowdown that has gone are still given back, the split kept.
    back = plan_adaptation(LAYOUT, Health(speed={0: 1.0}), HW, stages_alike=True, current_quotas=(6, 10))
    assert back.action == "adapt" and back.layout == LAYOUT and back.quotas == (8, 8)


def test_without_the_flag_replicas_may_take_different_splits():
    health = Health(speed={0: 0.5})
    free = plan_adaptation(LAYOUT, health, HW)
    assert free.action == "adapt" and not free.layout.replicas_alike()
    alike = plan_adaptation(LAYOUT, health, HW, stages_alike=True)
    assert alike.layout.replicas_alike()
    assert free.iteration_s_after <= alike.iteration_s_after


def test_stages_fixed_takes_precedence():
    plan = plan_adaptation(LAYOUT, STAGE0_SLOW, HW, stages_alike=True, stages_fixed=True)
    assert plan == plan_adaptation(LAYOUT, STAGE0_SLOW, HW, stages_fixed=True)


def test_dead_ranks_and_unlike_replicas_are_refused():
    with pytest.raises(ValueError, match="fail-stop"):
        plan_adaptation(LAYOUT, Health(dead=frozenset({5})), HW, stages_alike=True)
    old = LAYOUT.replicas[1]
    shifted = ReplicaSpec((StageSpec(0, 3, old.stages[0].ranks), StageSpec(3, 5, old.stages[1].ranks)))
    unlike = LAYOUT.with_replicas([LAYOUT.replicas[0], shifted])
    with pytest.raises(ValueError, match="one shape"):
        plan_adaptation(unlike, STAGE0_SLOW, HW, stages_alike=True)


def test_candidate_splits_start_with_the_current_one_and_fit_every_stage():
    anchors, others = candidate_splits(LAYOUT, STAGE0_SLOW, HW, affected=[0, 1], num_microbatches=16)
    assert anchors[0] == (4, 4) and len(anchors) == 2 and anchors[1][0] < 4
    assert len(anchors) + len(others) == 7 and len(set(anchors + others)) == 7  # every split of 8 over 2
    assert candidate_splits(LAYOUT, Health(), HW, affected=[], num_microbatches=16) == (((4, 4),), ())
    moved = with_split(LAYOUT, (3, 5))
    assert _stage_ranks(moved) == _stage_ranks(LAYOUT)
    assert [rep.layers_per_stage for rep in moved.replicas] == [(3, 5), (3, 5)]


def test_decide_fail_slow_passes_the_flag_through():
    verdict = Verdict(VerdictKind.COMPUTE, (0, 2), 2.0, 10, {}, "probed slow", probe_factors={0: 2.0, 2: 2.0})
    args = (LAYOUT, Health(), [verdict], HW, (8, 8), 500, replica_shape(LAYOUT.replicas[0]))
    alike = decide_fail_slow(*args, stages_alike=True)
    assert alike.plan.action == "adapt" and alike.plan.layout != LAYOUT
    _assert_alike_and_in_place(alike.plan.layout)
    assert alike.plan == plan_adaptation(LAYOUT, STAGE0_SLOW, HW, current_quotas=(8, 8), horizon_iters=500,
                                         uniform_tp_per_replica=True, stages_alike=True)
    assert decide_fail_slow(*args, stages_fixed=True).plan.action == "keep"
    # One slow rank: left free, only its replica is reshaped; with the flag both take one split.
    one = Verdict(VerdictKind.COMPUTE, (0,), 2.0, 10, {}, "probed slow", probe_factors={0: 2.0})
    args = (LAYOUT, Health(), [one], HW, (8, 8), 500, replica_shape(LAYOUT.replicas[0]))
    free = decide_fail_slow(*args).plan
    assert free.action == "adapt" and not free.layout.replicas_alike()
    alike = decide_fail_slow(*args, stages_alike=True).plan
    assert alike.action == "adapt" and alike.layout.replicas_alike()
    assert alike.iteration_s_after <= decide_fail_slow(*args, stages_fixed=True).plan.iteration_s_after


# ----------------------------------------------------------------- dropping whole replicas
VERY_SLOW = Health(speed={5: 1.0 / 30})  # rank 5 (replica 0, stage 1) 30x slow


def test_a_very_slow_replica_is_dropped_whole_when_the_executor_can_run_fewer_replicas():
    kept_all = plan_adaptation(LAYOUT, VERY_SLOW, HW, stages_alike=True)
    dropped = plan_adaptation(LAYOUT, VERY_SLOW, HW, stages_alike=True, drop_to={1, 2})
    assert kept_all.layout.num_replicas == 2  # without drop_to no replica is dropped
    assert dropped.action == "adapt" and dropped.layout.num_replicas == 1
    assert dropped.layout.replicas[0] == LAYOUT.replicas[1]  # the healthy replica, as it was
    assert dropped.quotas == (MODEL.num_microbatches,)
    assert set(dropped.spare_ranks) == set(LAYOUT.replicas[0].ranks)  # the dropped replica's ranks stand by
    assert dropped.iteration_s_after < kept_all.iteration_s_after
    assert dropped.transfers == state_moves(LAYOUT, dropped.layout, frozenset(), HW)
    assert not [t for t in dropped.transfers if t.crosses]  # the kept replica holds every shard it needs
    assert dropped.reason.startswith("adapt: replica [0] dropped; the rest: layout kept; quotas [16]")


def test_a_replica_is_dropped_only_to_a_count_the_executor_runs():
    assert plan_adaptation(LAYOUT, VERY_SLOW, HW, stages_alike=True, drop_to={2}).layout.num_replicas == 2


def test_a_mildly_slow_replica_keeps_its_place_and_takes_fewer_micro_batches():
    plan = plan_adaptation(LAYOUT, Health(speed={5: 0.5}), HW, stages_alike=True, drop_to={1, 2})
    assert plan.layout.num_replicas == 2 and plan.spare_ranks == ()


def test_quotas_alone_may_drop_a_replica_too():
    fixed = plan_adaptation(LAYOUT, VERY_SLOW, HW, stages_fixed=True, drop_to={1, 2})
    assert fixed.action == "adapt" and fixed.layout.replicas == (LAYOUT.replicas[1],)
    assert plan_adaptation(LAYOUT, VERY_SLOW, HW, stages_fixed=True).layout.num_replicas == 2


def test_under_the_interleaved_schedule_a_very_slow_replica_is_dropped_and_a_slow_one_keeps_whole_groups():
    from resihp_ext.schedule import Interleaving

    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=2, global_batch_size=16)
    layout = Layout.uniform(model, tp_degree=1, pp_degree=2, dp_degree=2)  # replica 1 is ranks 1 and 3
    hw = HardwareModel(layer_forward_s=0.01, output_forward_s=0.002, regroup_s=0.5, interleaving=Interleaving(2))
    kwargs = dict(stages_fixed=True, current_quotas=(4, 4), horizon_iters=20, drop_to={1, 2})
    very_slow = plan_adaptation(layout, Health(speed={3: 1 / 16}), hw, **kwargs)
    assert very_slow.layout.replicas == (layout.replicas[0],) and very_slow.quotas == (8,)
    assert set(very_slow.spare_ranks) == {1, 3}
    kept = plan_adaptation(layout, Health(speed={3: 1 / 16}), hw, **{**kwargs, "drop_to": None})
    assert very_slow.iteration_s_after < kept.iteration_s_after
    slow = plan_adaptation(layout, Health(speed={3: 1 / 3}), hw, **kwargs)
    assert slow.layout.num_replicas == 2 and slow.quotas == (6, 2)  # whole groups of the pipeline's 2


@pytest.mark.parametrize("first, second", [(2.27, 1.0), (1.0, 1.3), (2.27, 3.0), (1.5, 5.0)])
def test_under_the_interleaved_schedule_a_shared_split_gives_each_replica_whole_groups(first, second):
    # TP2 x PP2 x DP2 interleaved (two chunks a stage), 8 micro-batches: each replica's first stage
    # slowed as much as its verdict said, unlike the other's. Its quotas may differ, but each must be
    # a count the schedule runs (whole groups of the pipeline's 2): a shared split once priced an odd
    # quota, and the simulator refused it mid-run.
    from resihp_ext.schedule import Interleaving

    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=1, global_batch_size=8)
    layout = Layout.uniform(model, tp_degree=2, pp_degree=2, dp_degree=2)
    hw = HardwareModel(layer_forward_s=0.01, output_forward_s=0.002, regroup_s=0.5, interleaving=Interleaving(2))
    for current in ((4, 4), (6, 2)):
        plan = plan_adaptation(layout, Health(speed={0: 1 / first, 2: 1 / second}), hw, stages_alike=True,
                               current_quotas=current, horizon_iters=26)
        assert sum(plan.quotas) == 8 and all(q % 2 == 0 for q in plan.quotas), plan.reason
        _assert_alike_and_in_place(plan.layout)


@pytest.mark.parametrize("layers", ["alike", "fixed"])
def test_a_very_slow_replica_is_kept_where_the_others_could_not_hold_its_share_of_the_optimizer_state(layers):
    # Under the distributed optimizer one replica left would hold each stage's optimizer state alone:
    # on devices that hold a half but not the whole, the slow replica keeps its place and fewer
    # micro-batches.
    facts = megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=True)
    half, whole = (largest_stage_bytes(layout, HardwareModel(**facts))
                   for layout in (LAYOUT, LAYOUT.with_replicas(LAYOUT.replicas[1:])))
    mode = {"stages_alike": True} if layers == "alike" else {"stages_fixed": True}
    roomy = dataclasses.replace(HW, **facts, device_memory_bytes=whole * 1.01)
    assert plan_adaptation(LAYOUT, VERY_SLOW, roomy, drop_to={1, 2}, **mode).layout.num_replicas == 1
    tight = dataclasses.replace(roomy, device_memory_bytes=(half + whole) / 2)
    plan = plan_adaptation(LAYOUT, VERY_SLOW, tight, drop_to={1, 2}, **mode)
    assert plan.layout.num_replicas == 2 and plan.spare_ranks == (), plan.reason
    assert plan.quotas[0] < plan.quotas[1], plan.reason
