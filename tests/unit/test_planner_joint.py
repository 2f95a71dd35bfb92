"""Joint planner and baselines: decisions, moves after fail-stop, invariants, pay-off rule."""

import math

import pytest

from hypothesis import given, settings, strategies as st

from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec
from resihp_ext.planner import HardwareModel, Health, plan_adaptation
from resihp_ext.planner.simple_policies import POLICIES
from resihp_ext.planner.compare import compare

MODEL = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                  vocab_size=32768, seq_length=1024, micro_batch_size=1, global_batch_size=64)
LAYOUT = Layout.uniform(MODEL, tp_degree=4, pp_degree=4, dp_degree=4)  # 64 ranks


def test_healthy_cluster_keeps_everything():
    plan = plan_adaptation(LAYOUT, Health())
    assert plan.action == "keep" and plan.layout == LAYOUT and plan.moves == ()
    assert plan.iteration_s_after == plan.iteration_s_before


def test_fail_slow_adapts_and_beats_no_adaptation():
    health = Health(speed={16: 0.5})  # replica 0, stage 1, TP rank 0
    plan = plan_adaptation(LAYOUT, health)
    assert plan.action == "adapt"
    assert plan.iteration_s_after < 0.9 * plan.iteration_s_before
    assert sum(plan.quotas) == 64
    assert plan.quotas[0] < plan.quotas[1]  # the slow replica takes fewer micro-batches


def test_quotas_skewed_for_a_slowdown_that_has_gone_are_given_back():
    # Replica 0 took fewer micro-batches while rank 16 was slow; it is healthy again.
    skewed = (10, 18, 18, 18)
    plan = plan_adaptation(LAYOUT, Health(speed={16: 1.0}), current_quotas=skewed)
    assert plan.action == "adapt" and plan.layout == LAYOUT and plan.moves == ()
    assert plan.quotas == (16, 16, 16, 16) and plan.iteration_s_after < plan.iteration_s_before
    assert "no affected replica" in plan.reason
    assert plan_adaptation(LAYOUT, Health(), current_quotas=(16, 16, 16, 16)).reason == "keep: no affected replica"


def test_a_very_slow_replica_trains_one_micro_batch_or_is_dropped_never_idles():
    # DP4 of a 4-layer model, 8 micro-batches, compute-bound. At 3.3x, replica 0 still earns one
    # micro-batch; at 20x it is dropped (its ranks become spares) rather than kept with none.
    small = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=2, global_batch_size=16)
    layout = Layout.uniform(small, 1, 1, 4)
    hw = HardwareModel(layer_forward_s=0.002, output_forward_s=0.001, tp_efficiency=1.0, regroup_s=0.5)
    slow = plan_adaptation(layout, Health(speed={0: 1 / 3.3}), hw, horizon_iters=20)
    assert slow.action == "adapt" and slow.quotas == (1, 3, 2, 2)
    crawling = plan_adaptation(layout, Health(speed={0: 1 / 20}), hw, horizon_iters=20)
    assert crawling.action == "adapt" and crawling.quotas == (3, 3, 2) and crawling.spare_ranks == (0,)


def test_layers_moved_off_a_slow_rank_go_back_once_it_is_fast_again():
    # Replica 1 of a PP2 x DP2 job took 3 layers on stage 0 while its stage 1 rank was slow.
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                      vocab_size=512, seq_length=64, micro_batch_size=2, global_batch_size=32)
    layout = Layout.uniform(model, tp_degree=1, pp_degree=2, dp_degree=2)
    old = layout.replicas[1]
    shifted = ReplicaSpec((StageSpec(0, 3, old.stages[0].ranks), StageSpec(3, 1, old.stages[1].ranks)))
    layout = layout.with_replicas([layout.replicas[0], shifted])
    hw = HardwareModel(layer_forward_s=0.01, output_forward_s=0.002, regroup_s=0.5)
    kwargs = dict(current_quotas=(9, 7), horizon_iters=15, uniform_tp_per_replica=True)
    assert plan_adaptation(layout, Health(speed={3: 1.0}), hw, **kwargs).action == "keep"  # not told
    plan = plan_adaptation(layout, Health(speed={3: 1.0}), hw, reshaped=[1], **kwargs)
    assert plan.action == "adapt" and plan.quotas == (8, 8)
    assert [r.layers_per_stage for r in plan.layout.replicas] == [(2, 2), (2, 2)]
    assert plan.moves and plan.iteration_s_after < plan.iteration_s_before


def test_fail_stop_moves_come_from_surviving_holders_of_the_same_shard():
    dead = 17  # replica 0, stage 1, TP rank 1
    plan = plan_adaptation(LAYOUT, Health(dead=frozenset({dead})))
    assert plan.action == "adapt" and math.isinf(plan.iteration_s_before)
    assert dead not in plan.layout.world_ranks
    assert plan.moves
    for move in plan.moves:
        assert move.src != dead and move.src in LAYOUT.world_ranks and move.dst in plan.layout.world_ranks
        # the source held that item and that unit in the old layout
        held = _owned(LAYOUT, move.src, _index(move.item), 16 if move.replicated else move.grid)
        assert held and (move.replicated or move.unit in held)
    # the dead rank's own shard is fetched from another replica
    lost = [m for m in plan.moves if m.grid == 4 and m.unit == 1 and not m.replicated and _index(m.item) in range(4, 8)]
    assert lost and all(LAYOUT.replica_of(m.src) != 0 for m in lost)


def test_slow_pipeline_link_shifts_micro_batches_when_transfers_block():
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=2, dp_degree=2)
    src, dst = layout.replicas[0].stages[0].ranks[0], layout.replicas[0].stages[1].ranks[0]
    health = Health(slow_links={(src, dst): 0.02})
    # Megatron's 1F1B waits for each transfer: both stages of replica 0 lose the link's time
    plan = plan_adaptation(layout, health)
    assert plan.action == "adapt" and plan.quotas[0] < plan.quotas[1], plan.reason
    assert plan.iteration_s_after < 0.95 * plan.iteration_s_before
    # activations and gradients cross the boundary in opposite directions: both slow costs more
    both = plan_adaptation(layout, Health(slow_links={(src, dst): 0.02, (dst, src): 0.02}))
    assert both.iteration_s_before > plan.iteration_s_before and both.quotas[0] < plan.quotas[0]
    # transfers beside compute: the slow link still hides behind each stage's compute, and only
    # the pipeline fill grows, which no quota or layer change can shorten
    overlapped = plan_adaptation(layout, health, HardwareModel(overlap_p2p=True))
    assert overlapped.action == "keep", overlapped.reason


def test_no_surviving_holder_means_checkpoint_restart():
    layout = Layout.uniform(MODEL, 4, 4, 1)
    plan = plan_adaptation(layout, Health(dead=frozenset({5})), num_microbatches=8)
    assert plan.action == "checkpoint-restart" and "surviving holder" in plan.reason


def test_adaptation_that_does_not_pay_off_is_not_taken():
    # a slow device but a horizon of one iteration and a huge regroup cost
    hw = HardwareModel(regroup_s=1e6)
    plan = plan_adaptation(LAYOUT, Health(speed={16: 0.9}), hw, horizon_iters=1)
    assert plan.moves == ()  # only the free quota change (or nothing) can pay off
    assert plan.iteration_s_after <= plan.iteration_s_before


def test_unpayable_regroup_cost_leaves_only_quotas():
    # a regroup cost that no horizon pays back: only quotas, which move no state, remain
    health = Health(speed={16: 0.5})
    free = plan_adaptation(LAYOUT, health, HardwareModel(regroup_s=0.0), horizon_iters=500)
    assert free.action == "adapt" and free.layout != LAYOUT
    pinned = plan_adaptation(LAYOUT, health, HardwareModel(regroup_s=1e12), horizon_iters=500)
    assert pinned.layout == LAYOUT and pinned.moves == ()
    assert pinned.action == "adapt" and pinned.quotas != (4, 4, 4, 4)


def test_plan_to_dict_is_json_ready():
    import json
    plan = plan_adaptation(LAYOUT, Health(dead=frozenset({17})))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["action"] == "adapt" and data["iteration_s_before"] is None
    assert Layout.from_dict(data["layout"]) == plan.layout
    assert {"item", "unit", "grid", "src", "dst", "replicated", "num_bytes"} <= set(data["transfers"][0])
    assert sum(t["num_bytes"] for t in data["transfers"] if t["src"] != t["dst"]) == plan.num_bytes_moved > 0


def test_baselines_behave_as_described():
    health = Health(speed={16: 0.5})
    keep = POLICIES["no-adaptation"](LAYOUT, health)
    assert keep.layout == LAYOUT and keep.quotas == (16, 16, 16, 16)
    drop = POLICIES["drop-replica"](LAYOUT, health)
    assert drop.layout.num_replicas == 3 and 16 not in drop.layout.world_ranks and sum(drop.quotas) == 64
    dp = POLICIES["dp-only"](LAYOUT, health)
    assert dp.layout == LAYOUT and dp.quotas[0] < 16
    restart = POLICIES["checkpoint-restart"](LAYOUT, health)
    assert restart.one_time_cost_s == HardwareModel().restart_s
    assert all(r // 8 != 2 for r in restart.layout.world_ranks)  # node of rank 16 excluded


healths = st.builds(
    lambda slow, dead, link: Health(speed=slow, dead=frozenset(dead), slow_links=link),
    st.dictionaries(st.integers(0, 63), st.sampled_from([0.25, 0.5, 0.8]), max_size=3),
    st.sets(st.integers(0, 63), max_size=2),
    st.dictionaries(st.tuples(st.integers(0, 31), st.integers(32, 63)), st.sampled_from([0.1, 0.5]), max_size=1),
)


@settings(max_examples=25, deadline=None)
@given(healths)
def test_plans_validate_sum_quotas_and_never_lose_to_a_baseline(health):
    result = compare(LAYOUT, health, horizon_iters=500)
    plan = result.plan
    if plan.action != "checkpoint-restart":
        plan.layout.validate()
        assert sum(plan.quotas) == MODEL.num_microbatches
        assert not set(plan.layout.world_ranks) & health.dead
        assert len(plan.quotas) == plan.layout.num_replicas
        assert min(plan.quotas) >= 1  # a replica in the job never idles: it would still wait on every sync
    for name, value in result.baselines.items():
        assert result.predicted_throughput >= value * (1 - 1e-9), name


def _index(item) -> int:
    """An item as ``_owned`` numbers it: -1 the embeddings, ``num_layers`` the output layer."""
    return {"first": -1, "last": MODEL.num_layers}.get(item[0], item[-1])


def _owned(layout, rank, item, degree):
    """Finest shards (of ``degree``) of ``item`` that ``rank`` holds in ``layout``."""
    st_ = layout.stage_spec_of(rank)
    num_layers = layout.model.num_layers
    if not (item == -1 and st_.first_layer == 0 or item == num_layers and st_.end_layer == num_layers
            or st_.first_layer <= item < st_.end_layer):
        return set()
    i, per = layout.tp_rank_of(rank), degree // st_.tp_degree
    return set(range(i * per, (i + 1) * per))


@settings(max_examples=25, deadline=None)
@given(healths)
def test_moves_give_every_rank_what_it_serves_and_times_are_consistent(health):
    from resihp_ext.planner.cost import iteration_s
    plan = plan_adaptation(LAYOUT, health)
    if plan.action == "checkpoint-restart":
        return
    assert plan.iteration_s_after == pytest.approx(iteration_s(plan.layout, plan.quotas, health, HardwareModel()))
    degree = 16  # a multiple of every TP degree in play, so shards of all degrees compare
    received = {}
    for m in (m for m in plan.moves if not m.replicated):
        assert m.src not in health.dead
        scale = degree // m.grid
        assert _owned(LAYOUT, m.src, _index(m.item), m.grid) >= {m.unit}
        received.setdefault((m.dst, _index(m.item)), set()).update(range(m.unit * scale, (m.unit + 1) * scale))
    num_layers = MODEL.num_layers
    for rank in plan.layout.world_ranks:
        for item in range(-1, num_layers + 1):
            need = _owned(plan.layout, rank, item, degree)
            have = _owned(LAYOUT, rank, item, degree) | received.get((rank, item), set())
            assert need <= have, (rank, item)


def test_lost_shard_gives_restart_layout_without_bad_nodes():
    layout = Layout.uniform(MODEL, 2, 2, 8)  # 32 ranks, 4 nodes of 8
    # TP rank 0 of stage 0 dies in every replica: that shard survives nowhere
    dead = frozenset(layout.replicas[d].stages[0].ranks[0] for d in range(8))
    plan = plan_adaptation(layout, Health(dead=dead))
    assert plan.action == "checkpoint-restart" and "surviving holder" in plan.reason
    assert plan.layout is not None and sum(plan.quotas) == MODEL.num_microbatches
    bad_nodes = {r // 8 for r in dead}
    assert all(r // 8 not in bad_nodes for r in plan.layout.world_ranks)


def test_with_stages_fixed_only_the_quotas_change_and_no_replica_is_dropped():
    # Unconstrained, the planner reshapes the slow rank's replica or drops it; an executor that
    # cannot rebuild stages (Megatron's loop) is offered the micro-batch split alone.
    health = Health(speed={16: 0.2})
    free = plan_adaptation(LAYOUT, health)
    fixed = plan_adaptation(LAYOUT, health, stages_fixed=True)
    assert free.layout != LAYOUT and free.spare_ranks
    assert fixed.action == "adapt" and fixed.layout == LAYOUT and fixed.transfers == () and fixed.spare_ranks == ()
    assert fixed.quotas[0] < min(fixed.quotas[1:]) and sum(fixed.quotas) == 64
    assert free.iteration_s_after <= fixed.iteration_s_after < fixed.iteration_s_before
    # Even a crawling replica keeps at least one micro-batch.
    small = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=512,
                      seq_length=64, micro_batch_size=2, global_batch_size=16)
    layout = Layout.uniform(small, 1, 1, 4)
    hw = HardwareModel(layer_forward_s=0.002, output_forward_s=0.001, tp_efficiency=1.0, regroup_s=0.5)
    crawling = plan_adaptation(layout, Health(speed={0: 1 / 20}), hw, horizon_iters=20, stages_fixed=True)
    assert crawling.action == "adapt" and crawling.layout == layout and crawling.quotas[0] == 1
    assert crawling.spare_ranks == ()
