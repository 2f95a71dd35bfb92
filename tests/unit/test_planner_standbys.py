"""Standing-by ranks taken back by a fail-stop plan (resihp_ext.planner.standby_places, survivors)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.standby_places import standby_places
from resihp_ext.planner.survivors import SurvivorPlan, continuing_layout, plan_survivors, surviving_layout
from resihp_ext.shard_map import transfers

MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=2, global_batch_size=16)
# Compute dwarfs the gradient sync, as in the tiny CPU jobs: a smaller-TP replica is worth adding.
HW = HardwareModel(layer_forward_s=0.01, output_forward_s=0.005, tp_efficiency=1.0)


class Job:
    """A job's ranks through a sequence of kills, as the executor renumbers them: ``layout`` in this
    world's ranks, ``identity`` their launch ranks, ``standbys`` the launch ranks standing by."""

    def __init__(self, tp, pp, dp, keep_tp=False, model=MODEL):
        self.layout = Layout.uniform(model, tp, pp, dp)
        self.keep_tp = keep_tp
        self.identity = list(range(self.layout.world_size))
        self.standbys: list[int] = []

    def kill(self, launch_rank: int) -> SurvivorPlan:
        dead = frozenset({self.identity.index(launch_rank)})
        n = len(self.identity)
        extended = [*self.identity, *self.standbys]  # standbys numbered after this world's ranks
        plan = plan_survivors(self.layout, dead, hw=HW, standbys=tuple(range(n, n + len(self.standbys))),
                              keep_tp=self.keep_tp)
        if plan.action != "adapt":
            return plan
        new = continuing_layout(self.layout, plan)
        # Every unit a rank of the new layout holds comes from a live rank that held it (never a standby).
        for t in transfers(self.layout, new, dead):
            assert t.src in self.layout.world_ranks and t.src not in dead
        assert {t.dst for t in plan.transfers if t.crosses} >= set(plan.joiners)
        joined = {extended[r] for r in plan.joiners}
        self.standbys = sorted((set(self.standbys) - joined) | {extended[r] for r in plan.spares})
        self.layout = surviving_layout(self.layout, plan)
        self.identity = [extended[old] for old in sorted(plan.new_rank, key=plan.new_rank.get)]
        return plan


def test_a_standby_takes_a_dead_ranks_place_and_restores_its_replica():
    layout = Layout.uniform(MODEL, 2, 1, 2)  # replicas (0, 1) and (2, 3)
    plan = plan_survivors(layout, frozenset({1}), hw=HW, standbys=(4,))
    assert plan.action == "adapt" and plan.filled == {1: 4} and plan.joiners == (4,)
    assert [r.ranks for r in continuing_layout(layout, plan).replicas] == [(0, 4), (2, 3)]
    assert plan.spares == () and plan.new_rank == {0: 0, 4: 1, 2: 2, 3: 3}
    # Rank 4 receives TP shard 1 of every layer from rank 3, the one live holder; rank 0 keeps its own.
    crossing = {(t.src, t.dst) for t in plan.transfers if t.crosses}
    assert {dst for _, dst in crossing} == {4} and {src for src, _ in crossing} <= {0, 2, 3}
    assert all(t.src == 3 for t in plan.transfers if t.dst == 4 and not t.replicated)
    assert "standing-by ranks [4] take the places of dead ranks [1]" in plan.reason
    assert SurvivorPlan.from_dict(plan.to_dict()) == plan


def test_without_standbys_or_state_moves_the_plan_is_unchanged():
    layout = Layout.uniform(MODEL, 2, 1, 2)
    plain = plan_survivors(layout, frozenset({1}), hw=HW)
    assert plan_survivors(layout, frozenset({1}), hw=HW, standbys=()) == plain
    assert plan_survivors(layout, frozenset({1}), hw=HW, move_state=False, standbys=(4,)) == \
        plan_survivors(layout, frozenset({1}), hw=HW, move_state=False)
    assert plain.filled == {} and plain.joiners == ()


def test_a_replica_is_filled_only_whole_and_fewest_dead_first():
    layout = Layout.uniform(MODEL, 2, 1, 3)  # replicas (0, 1), (2, 3), (4, 5)
    # Replica 0 lost two ranks, replica 2 one: the one standby restores replica 2.
    assert standby_places(layout, frozenset({0, 1, 5}), (6,)) == {5: 6}
    assert standby_places(layout, frozenset({0, 1, 5}), (6, 7, 8)) == {5: 6, 0: 7, 1: 8}


def test_a_place_whose_state_no_live_rank_holds_is_not_filled():
    layout = Layout.uniform(MODEL, 2, 1, 2)
    # TP shard 1 died with both its holders (ranks 1 and 3): a standby in either place would hold nothing.
    assert standby_places(layout, frozenset({1, 3}), (4, 5)) == {}
    plan = plan_survivors(layout, frozenset({1, 3}), hw=HW, standbys=(4, 5))
    assert plan.filled == {} and plan.joiners == ()


def test_standbys_must_be_ranks_outside_the_layout():
    layout = Layout.uniform(MODEL, 2, 1, 2)
    with pytest.raises(ValueError, match="outside the layout"):
        standby_places(layout, frozenset({1}), (3,))
    with pytest.raises(ValueError, match="outside the layout"):
        standby_places(layout, frozenset({1}), (4, 4))


def test_three_kills_on_tp2_pp2_dp2_are_survived_when_spares_stand_by():
    # Launch rank = TP rank + 2 * replica + 4 * stage. Kill 7: replica 0 goes on whole, ranks 2 and
    # 6 form a TP-1 replica, rank 3 stands by. Kill 2: rank 3 takes 2's place. Kill 4: replica
    # (3 | 6) goes on whole and rank 6 hands rank 5 the TP half of stage 1 it lacks.
    job = Job(2, 2, 2)
    first = job.kill(7)
    assert first.action == "adapt" and job.standbys == [3]
    second = job.kill(2)
    assert second.action == "adapt" and second.joiners and job.standbys == []
    assert sorted(job.identity) == [0, 1, 3, 4, 5, 6]
    third = job.kill(4)
    assert third.action == "adapt", third.reason
    assert 3 in job.identity and 6 in job.identity


def test_the_same_three_kills_end_the_job_without_standbys():
    # What the executor did before spares stood by: the plan's spares left the job.
    layout = Layout.uniform(MODEL, 2, 2, 2)
    identity = list(range(8))
    for launch in (7, 2, 4):
        plan = plan_survivors(layout, frozenset({identity.index(launch)}), hw=HW)
        if plan.action != "adapt":
            break
        layout = surviving_layout(layout, plan)
        identity = [identity[old] for old in sorted(plan.new_rank, key=plan.new_rank.get)]
    assert launch == 4 and plan.action == "checkpoint-restart" and plan.missing_shards


def test_five_kills_on_tp2_pp2_dp2_are_survived_when_spares_stand_by():
    job = Job(2, 2, 2)
    for launch in (7, 2, 4, 6, 0):
        plan = job.kill(launch)
        assert plan.action == "adapt", (launch, plan.reason)
    assert sorted(job.identity + job.standbys) == [1, 3, 5]
    assert job.layout.world_size >= 2


# TP1 x PP2 x DP4 with a global batch of 12: launch rank = replica + 4 * stage.
DP4_MODEL = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=1, global_batch_size=12)


def test_with_replicas_kept_alike_spares_carry_four_kills_on_dp4():
    # Kill 7: replicas 0-2 go on, rank 3 stands by. Kill 6: rank 3 takes its place (stage 1, from a
    # live holder), DP stays 3. Kill 0: rank 4 stands by. Kill 5: rank 4 takes its place, DP 2.
    job = Job(1, 2, 4, keep_tp=True, model=DP4_MODEL)
    dps = []
    for launch in (7, 6, 0, 5):
        plan = job.kill(launch)
        assert plan.action == "adapt", (launch, plan.reason)
        assert job.layout.replicas_alike() and {s.tp_degree for r in job.layout.replicas for s in r.stages} == {1}
        dps.append(job.layout.num_replicas)
    assert dps == [3, 3, 2, 2] and job.standbys == []
    assert sorted(job.identity) == [1, 2, 3, 4]


def test_the_same_four_kills_end_the_job_when_spares_leave():
    layout = Layout.uniform(DP4_MODEL, 1, 2, 4)
    identity = list(range(8))
    for launch in (7, 6, 0, 5):
        plan = plan_survivors(layout, frozenset({identity.index(launch)}), hw=HW, keep_tp=True)
        if plan.action != "adapt":
            break
        layout = surviving_layout(layout, plan)
        identity = [identity[old] for old in sorted(plan.new_rank, key=plan.new_rank.get)]
    assert launch == 5 and plan.action == "checkpoint-restart"


def test_keep_tp_never_plans_a_smaller_tp_replica():
    # Kill 7 of TP2 x PP2 x DP2: without keep_tp ranks 2 and 6 run a TP-1 replica; with it replica 0
    # goes on alone and ranks 2, 3 and 6 become spares.
    layout = Layout.uniform(MODEL, 2, 2, 2)
    assert plan_survivors(layout, frozenset({7}), hw=HW).rebuilt_replicas
    kept = plan_survivors(layout, frozenset({7}), hw=HW, keep_tp=True)
    assert kept.action == "adapt" and kept.rebuilt_replicas == () and kept.spares == (2, 3, 6)


@settings(max_examples=80, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), dp=st.integers(1, 3), keep_tp=st.booleans(),
       data=st.data())
def test_every_plan_with_standbys_is_executable(tp, pp, dp, keep_tp, data):
    layout = Layout.uniform(MODEL, tp, pp, dp)
    n = layout.world_size
    dead = frozenset(data.draw(st.sets(st.sampled_from(layout.world_ranks), min_size=1, max_size=n)))
    standbys = tuple(range(n, n + data.draw(st.integers(0, 3))))
    plan = plan_survivors(layout, dead, hw=HW, standbys=standbys, keep_tp=keep_tp)
    if keep_tp and plan.action == "adapt":  # what a loop building every replica from one configuration runs
        assert continuing_layout(layout, plan).replicas_alike()
    assert set(plan.filled) <= dead and set(plan.filled.values()) <= set(standbys)
    if plan.action != "adapt":
        return
    new = continuing_layout(layout, plan)
    assert not set(new.world_ranks) & dead
    assert set(new.world_ranks) <= set(layout.world_ranks) | set(standbys)
    # Standbys hold nothing: every unit they need comes from a live rank of the old layout, and the
    # plan carries exactly those transfers.
    needed = {(t.item, t.unit, t.grid, t.dst) for t in transfers(layout, new, dead | set(standbys))}
    carried = {(t.item, t.unit, t.grid, t.dst) for t in plan.transfers}
    joined = set(new.world_ranks) & set(standbys)
    assert {x for x in needed if x[3] in joined} <= carried
    assert all(t.src not in standbys and t.src not in dead for t in plan.transfers)
    assert sorted(plan.new_rank.values()) == list(range(new.world_size))
    assert set(plan.spares) == set(layout.world_ranks) - dead - set(new.world_ranks)


def test_a_plan_keeps_a_number_of_replicas_the_batch_splits_evenly_over():
    # TP1 x PP2 x DP4, 8 micro-batches, rank 7 dead: Megatron-LM's loop splits the batch evenly, so 2
    # replicas go on (replicas 0 and 1) and the live ranks of replica 2 stand by with rank 3.
    layout = Layout.uniform(MODEL, 1, 2, 4)
    free = plan_survivors(layout, frozenset({7}), hw=HW, keep_tp=True)
    assert free.kept_replicas == (0, 1, 2)
    even = plan_survivors(layout, frozenset({7}), hw=HW, keep_tp=True, replica_counts=frozenset({1, 2, 4}))
    assert even.action == "adapt" and even.kept_replicas == (0, 1) and even.spares == (2, 3, 6)
    assert "1 more left out: the global batch of 8 micro-batches splits evenly over 2 replicas" in even.reason
    # The same under the distributed optimizer, whose plans keep whole replicas only.
    parts = plan_survivors(layout, frozenset({7}), hw=HW, sharded_optimizer=True, part_copies=True,
                           replica_counts=frozenset({1, 2, 4}))
    assert parts.kept_replicas == (0, 1) and parts.spares == (2, 3, 6) and 7 in parts.part_sources
    # A spare taken back may make a left-out replica whole again only if the count allows it.
    with_spare = plan_survivors(layout, frozenset({7}), hw=HW, keep_tp=True, standbys=(8,),
                                replica_counts=frozenset({1, 2, 4}))
    assert continuing_layout(layout, with_spare).num_replicas == 4 and with_spare.filled == {7: 8}


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(2, 4), data=st.data())
def test_every_plan_keeps_an_allowed_number_of_replicas(dp, data):
    layout = Layout.uniform(MODEL, 1, 2, dp)
    counts = frozenset(data.draw(st.sets(st.integers(1, dp), min_size=1)) | {1})
    dead = frozenset(data.draw(st.sets(st.sampled_from(layout.world_ranks), min_size=1, max_size=layout.world_size)))
    plan = plan_survivors(layout, dead, hw=HW, keep_tp=True, replica_counts=counts)
    if plan.action == "adapt":
        assert continuing_layout(layout, plan).num_replicas in counts
        unrestricted = plan_survivors(layout, dead, hw=HW, keep_tp=True)
        kept = continuing_layout(layout, plan).num_replicas
        assert kept == max(c for c in counts if c <= continuing_layout(layout, unrestricted).num_replicas)
