"""With the optimizer state split over data-parallel ranks (Megatron's distributed optimizer), a dead
rank's part survives only as the copy the next rank of its position keeps: whole replicas go on when
every dead rank's copy lives, and the plan says where each comes from. Where that is worse, or
impossible, every replica may go on at one smaller TP degree instead, all alike."""

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.optimizer_parts import (HeldCopy, PartsAgreement, agree_on_update, copied_owner, copy_holder,
                                        part_ring, part_sources)
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.memory import megatron_state_bytes, stage_memory_bytes
from resihp_ext.planner import survivors
from resihp_ext.planner.survivors import SurvivorPlan, plan_survivors

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=1, global_batch_size=8)
LAYOUT = Layout.uniform(MODEL, 2, 2, 2, (2, 2))  # ranks 0-3 stage 0, 4-7 stage 1; TP pairs, replicas by DP
DP4 = Layout.uniform(MODEL, 1, 2, 4, (2, 2))  # stage 0: ranks 0-3, stage 1: ranks 4-7, one per replica


def test_each_part_is_copied_on_the_next_rank_of_its_position_in_a_ring():
    assert part_ring(LAYOUT, 5) == (5, 7) and copy_holder(LAYOUT, 5) == 7 and copy_holder(LAYOUT, 7) == 5
    assert part_ring(DP4, 6) == (4, 5, 6, 7)
    assert [copy_holder(DP4, r) for r in (4, 5, 6, 7)] == [5, 6, 7, 4]
    assert [copied_owner(DP4, r) for r in (4, 5, 6, 7)] == [7, 4, 5, 6]
    one = Layout.uniform(MODEL, 2, 2, 1, (2, 2))
    assert copy_holder(one, 3) is None and copied_owner(one, 3) is None


def test_a_dead_ranks_part_survives_unless_the_holder_of_its_copy_died_too():
    assert part_sources(DP4, frozenset({5})) == ({5: 6}, ())
    assert part_sources(DP4, frozenset({1, 5})) == ({1: 2, 5: 6}, ())
    assert part_sources(DP4, frozenset({5, 6})) == ({6: 7}, ((1, 0),))  # 6's copy is on 7; 5's was on 6: lost


def test_without_copies_a_sharded_optimizer_falls_back_naming_what_was_lost():
    assert plan_survivors(LAYOUT, frozenset({5})).action == "adapt"
    plan = plan_survivors(LAYOUT, frozenset({5}), sharded_optimizer=True)
    assert plan.action == "checkpoint-restart"
    assert plan.missing_shards == ((1, 1),)  # rank 5: stage 1, TP rank 1
    assert plan.spares == (0, 1, 2, 3, 4, 6, 7) and not plan.new_rank
    assert "without a copy" in plan.reason and "[5]" in plan.reason
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan  # it travels through the store unchanged
    assert plan_survivors(LAYOUT, frozenset({2, 5, 7}), sharded_optimizer=True).missing_shards == ((0, 0), (1, 1))


def test_with_copies_whole_replicas_go_on_and_the_plan_names_each_copy_it_uses():
    plan = plan_survivors(LAYOUT, frozenset({5}), sharded_optimizer=True, part_copies=True)
    assert plan.action == "adapt" and plan.kept_replicas == (1,)
    assert plan.part_sources == {5: 7} and not plan.transfers  # no stage moves: parts only
    assert plan.spares == (0, 1, 4)  # replica 0's live ranks send their parts, then leave
    assert "5's on rank 7" in plan.reason
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan
    # DP 4, a rank of stage 0 and one of stage 1 dead: two replicas go on.
    plan = plan_survivors(DP4, frozenset({1, 6}), sharded_optimizer=True, part_copies=True)
    assert plan.action == "adapt" and plan.kept_replicas == (0, 3) and plan.part_sources == {1: 2, 6: 7}
    # The holder of the copy died too: nothing left of that part.
    plan = plan_survivors(DP4, frozenset({5, 6}), sharded_optimizer=True, part_copies=True)
    assert plan.action == "checkpoint-restart" and plan.missing_shards == ((1, 0),)
    assert "copies died too" in plan.reason
    # A replicated optimizer's plans carry no part sources.
    assert plan_survivors(LAYOUT, frozenset({5})).part_sources is None


def test_the_parts_are_brought_to_the_lowest_update_any_of_them_stands_at():
    # Ranks 4, 6, 7 live; rank 5 dead, its copy on rank 6.
    held = {6: HeldCopy(5, 3, 2), 4: HeldCopy(7, 3, 2), 7: HeldCopy(6, 3, 2)}
    before = {4: 2, 6: 2, 7: 2}
    assert agree_on_update({4: 3, 6: 3, 7: 3}, before, held, {5: 6}) == PartsAgreement(3)
    # Rank 5 died after its update, before its copy reached rank 6: every survivor goes back one update.
    behind = {**held, 6: HeldCopy(5, 2, 1)}
    assert agree_on_update({4: 3, 6: 3, 7: 3}, before, behind, {5: 6}) == PartsAgreement(2, (4, 6, 7))
    # The failure struck between ranks' updates: those ahead go back, and so does rank 5's copy.
    assert agree_on_update({4: 3, 6: 2, 7: 3}, {4: 2, 6: 1, 7: 2}, held, {5: 6}) == PartsAgreement(2, (4, 7), (5,))
    # A rank ahead that keeps nothing from before (Megatron's loop had counted its iteration): no state.
    assert "while the optimizer stepped" in agree_on_update({4: 3, 6: 2, 7: 3}, {4: None, 6: 1, 7: 2}, held, {5: 6})
    # A copy ahead by one without the one before it, or two behind: no state.
    assert "while copies were sent" in agree_on_update({4: 2, 6: 2, 7: 2}, {}, {**held, 6: HeldCopy(5, 3, None)},
                                                       {5: 6})
    assert "keeps no copy" in agree_on_update({4: 3, 6: 3, 7: 3}, before, {**held, 6: None}, {5: 6})
    assert "keeps no copy" in agree_on_update({4: 3, 6: 3, 7: 3}, before, {**held, 6: HeldCopy(4, 3)}, {5: 6})
    assert agree_on_update({}, {}, {}, {}) == PartsAgreement(0)


def test_a_standby_takes_a_dead_ranks_place_and_receives_parts_only():
    # DP 3 (stage 0: ranks 0-2, stage 1: 3-5) and a standby, numbered 6 after this world's ranks.
    # Rank 5 dies: the standby takes its place, replica 2 is whole again, and 5's part comes from
    # its copy on the next rank of its position's ring.
    three = Layout.uniform(MODEL, 1, 2, 3, (2, 2))  # stage 0: 0-2, stage 1: 3-5
    plan = plan_survivors(three, frozenset({5}), sharded_optimizer=True, part_copies=True, standbys=(6,))
    assert plan.action == "adapt" and plan.filled == {5: 6} and plan.joiners == (6,)
    assert len(plan.kept_replicas) == 3 and plan.spares == ()
    assert plan.part_sources == {5: copy_holder(three, 5)}
    assert plan.transfers == ()  # no weights move: the standby's parameters come from the parts
    assert "standing-by ranks [6] take the places of dead ranks [5]" in plan.reason
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan
    # Without a live copy of the dead rank's part, no standby helps.
    lost = plan_survivors(three, frozenset({4, 5}), sharded_optimizer=True, part_copies=True, standbys=(6, 7))
    assert lost.action == "checkpoint-restart"


def test_a_standby_can_make_a_replica_whole_where_none_is_left():
    # TP 2 x DP 2 (replicas (0, 1) and (2, 3)): ranks 0 and 3 die, one of each replica's TP pair, so
    # no replica is whole and no TP group is intact. A standby in 0's place makes (4, 1) whole;
    # without it the job falls back. 0's part comes from its copy on 2, 3's from its copy on 1.
    tp2 = Layout.uniform(MODEL, 2, 1, 2, (4,))
    assert plan_survivors(tp2, frozenset({0, 3}), sharded_optimizer=True, part_copies=True).action == \
        "checkpoint-restart"
    plan = plan_survivors(tp2, frozenset({0, 3}), sharded_optimizer=True, part_copies=True, standbys=(4,))
    assert plan.action == "adapt" and plan.filled == {0: 4} and plan.joiners == (4,), plan.reason
    assert plan.part_sources == {0: 2, 3: 1} and plan.transfers == ()


# A model where compute, not latency, decides (the planner's reference device).
LARGE = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384, vocab_size=51200,
                  seq_length=2048, micro_batch_size=1, global_batch_size=64)
ROOMY = HardwareModel(device_memory_bytes=10**12)


def test_with_no_replica_left_whole_every_replica_goes_on_at_a_smaller_tp_degree():
    # TP2 x PP2 x DP2: ranks 0 and 3 held stage 0's TP halves in replicas 0 and 1, so no replica is
    # whole and no stage-0 group intact: the whole-replica plan falls back. Every replica alike at
    # TP 1 (the distributed optimizer's buffers pair replica with replica) goes on in place: stage 0
    # has ranks 1 and 2 left, stage 1 four, so two replicas, and ranks 6 and 7 are spares.
    assert plan_survivors(LAYOUT, frozenset({0, 3}), sharded_optimizer=True, part_copies=True).action == \
        "checkpoint-restart"
    plan = plan_survivors(LAYOUT, frozenset({0, 3}), sharded_optimizer=True, part_copies=True, uniform_tp=True)
    assert plan.action == "adapt" and plan.kept_replicas == (), plan.reason
    assert [[s.ranks for s in r.stages] for r in plan.rebuilt_replicas] == [[(1,), (4,)], [(2,), (5,)]]
    assert plan.spares == (6, 7) and plan.new_rank == {1: 0, 2: 1, 4: 2, 5: 3} and plan.quotas == ()
    assert plan.part_sources == {0: 2, 3: 1}
    assert "every replica re-formed at TP 1" in plan.reason and "0's on rank 2" in plan.reason
    # Every new rank receives the TP half of its stage it did not hold, from a live holder.
    new = Layout(plan.rebuilt_replicas, MODEL)
    assert {t.dst for t in plan.transfers if t.src != t.dst} == set(new.world_ranks)
    assert not {t.src for t in plan.transfers} & {0, 3}
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan
    # Without copies the dead ranks' parts are lost, whatever the degree.
    assert plan_survivors(LAYOUT, frozenset({0, 3}), sharded_optimizer=True, uniform_tp=True).action == \
        "checkpoint-restart"
    # Where TP 1 cannot hold a stage, nothing changes.
    small = HardwareModel(device_memory_bytes=1)
    assert plan_survivors(LAYOUT, frozenset({0, 3}), sharded_optimizer=True, part_copies=True, uniform_tp=True,
                          hw=small).action == "checkpoint-restart"


def test_beside_a_whole_replica_the_cost_model_decides_between_it_and_every_replica_smaller(monkeypatch):
    layout = Layout.uniform(LARGE, 2, 2, 2, (16, 16))
    # One rank dead: one whole replica at TP 2, or three at TP 1. On the reference device the large
    # model's compute decides: three replicas, the batch split 22/21/21, rank 1 a spare (stage 0 has
    # four live ranks, stage 1 three).
    plan = plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=True, hw=ROOMY)
    assert plan.action == "adapt" and len(plan.rebuilt_replicas) == 3, plan.reason
    assert sorted(plan.quotas) == [21, 21, 22] and plan.spares == (3,), plan.reason
    assert "against" in plan.reason  # the whole replica's predicted iteration, for comparison
    # Replica counts the loop can split the batch over (say 1 or 2) cut it to two, which would do the
    # work of the one whole TP-2 replica: that replica goes on.
    two = plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=True, hw=ROOMY,
                         replica_counts=frozenset({1, 2}))
    assert two.kept_replicas == (1,) and two.rebuilt_replicas == (), two.reason
    # A known slow rank of stage 0 is the one left out.
    slow = plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=True, hw=ROOMY,
                          health=Health(speed={1: 0.5}))
    assert slow.spares == (1,), slow.reason
    # Only a clear gain re-forms every rank's state: asked for a 40% shorter iteration, the 31% predicted
    # here keeps the whole replica.
    monkeypatch.setattr(survivors, "UNIFORM_TP_GAIN", 0.6)
    kept = plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=True, hw=ROOMY)
    assert kept.kept_replicas == (1,) and kept.rebuilt_replicas == (), kept.reason
    # The tiny model's iteration is all latency on the reference device: its whole replica is kept.
    kept = plan_survivors(LAYOUT, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=True)
    assert kept.kept_replicas == (1,) and kept.rebuilt_replicas == (), kept.reason


def test_fewer_replicas_whose_optimizer_shares_would_not_fit_a_device_fall_back():
    # One rank of TP2 x PP2 x DP2 dead under the distributed optimizer (bf16): the whole replica left
    # would hold each stage's optimizer state alone, twice its share before, on devices that held
    # the share but not the whole; TP-1 replicas would hold more still. A re-form that runs out of
    # memory part way is worse than the restart from the last checkpoint.
    layout = Layout.uniform(LARGE, 2, 2, 2, (16, 16))
    facts = megatron_state_bytes(half_precision=True, grads_in_fp32=True, distributed_optimizer=True)
    needs = [stage_memory_bytes(LARGE, HardwareModel(**facts), num_layers=16, tp_degree=2, stage=0, num_stages=2,
                                num_microbatches=LARGE.num_microbatches, dp_degree=d) for d in (2, 1)]
    tight = HardwareModel(**facts, device_memory_bytes=sum(needs) / 2)
    for uniform_tp in (False, True):
        plan = plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, uniform_tp=uniform_tp,
                              hw=tight)
        assert plan.action == "checkpoint-restart", plan.reason
        assert "share of the optimizer state" in plan.reason and "stage positions [0]" in plan.reason, plan.reason
    roomy = HardwareModel(**facts, device_memory_bytes=needs[1] * 1.5)
    assert plan_survivors(layout, frozenset({5}), sharded_optimizer=True, part_copies=True, hw=roomy).action == "adapt"
