"""Which rank judges: the first rank of replica 0's last pipeline stage, and the measurement-only
switches of scripts/bench/decider_placement.py."""

import pytest

from megatron.resihp.detection import decider_rank, judging_pad_s
from resihp_ext.layout import Layout, ModelSpec, ReplicaSpec, StageSpec

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=8, ffn_hidden_size=256, vocab_size=512,
                  seq_length=64, micro_batch_size=1)


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
    monkeypatch.delenv("RESIHP_DECIDER", raising=False)
    monkeypatch.delenv("RESIHP_JUDGING_PAD_S", raising=False)


@pytest.mark.parametrize("tp, pp, dp, decider", [(2, 2, 2, 4), (1, 4, 1, 3), (1, 1, 4, 0), (4, 1, 2, 0), (2, 4, 2, 12)])
def test_the_decider_is_the_first_rank_of_replica_0s_last_stage(tp, pp, dp, decider):
    layout = Layout.uniform(MODEL, tp_degree=tp, pp_degree=pp, dp_degree=dp)
    assert decider_rank(layout) == decider == layout.replicas[0].stages[-1].ranks[0]
    assert layout.stage_of(decider) == (0, pp - 1)


def test_after_a_replan_it_follows_replica_0s_own_depth():
    # Replica 0 repartitioned to three stages on ranks 5, 2, 7; replica 1 kept two.
    layout = Layout(replicas=(ReplicaSpec((StageSpec(0, 3, (5,)), StageSpec(3, 3, (2,)), StageSpec(6, 2, (7,)))),
                              ReplicaSpec((StageSpec(0, 4, (1,)), StageSpec(4, 4, (3,))))), model=MODEL)
    assert decider_rank(layout) == 7


def test_rank_0_decides_when_measurement_asks_for_it_and_a_wrong_value_is_refused(monkeypatch, capsys):
    layout = Layout.uniform(MODEL, tp_degree=1, pp_degree=2, dp_degree=2)
    monkeypatch.setenv("RESIHP_DECIDER", "first")
    assert decider_rank(layout) == 0
    monkeypatch.setenv("RESIHP_DECIDER", "middle")
    with pytest.raises(SystemExit) as exit_:
        decider_rank(layout)
    assert exit_.value.code == 2 and "RESIHP_DECIDER must be 'first'" in capsys.readouterr().err


def test_the_judging_pad_is_seconds_and_anything_else_is_refused(monkeypatch, capsys):
    assert judging_pad_s() == 0.0
    monkeypatch.setenv("RESIHP_JUDGING_PAD_S", "0.05")
    assert judging_pad_s() == 0.05
    for bad in ("soon", "-1", "120"):
        monkeypatch.setenv("RESIHP_JUDGING_PAD_S", bad)
        with pytest.raises(SystemExit) as exit_:
            judging_pad_s()
        assert exit_.value.code == 2 and "RESIHP_JUDGING_PAD_S must be seconds" in capsys.readouterr().err
