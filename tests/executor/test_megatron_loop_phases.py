"""Where a survivor of a failure between two steps of Megatron's loop goes on from
(megatron.resihp.megatron_loop_phases): the phases it skips, the one it finishes, the ones it runs."""

from megatron.resihp.megatron_loop_phases import BetweenSteps, Phase, Position


def test_positions_order_by_iteration_then_phase_in_the_loops_order():
    order = [Position(4, Phase.STEP), Position(4, Phase.STEPPED), Position(4, Phase.LOG), Position(4, Phase.EVAL),
             Position(4, Phase.SAVE), Position(5, Phase.STEP)]
    assert sorted(reversed(order)) == order
    assert str(Position(4, Phase.SAVE)) == "iteration 4's save"


def test_a_rank_behind_skips_what_the_furthest_passed_and_finishes_the_phase_it_stood_in():
    phases = BetweenSteps(loop=None)
    phases.position = Position(4, Phase.LOG)
    phases.catch_up_to = Position(4, Phase.SAVE)  # the furthest survivor failed in the save of 4
    assert not phases._barriers_run()  # the timers' barriers before the save: the others passed them
    assert phases.enter(Position(4, Phase.EVAL)) == "skip"
    assert phases.enter(Position(4, Phase.SAVE)) == "finish"
    assert phases._barriers_run()  # from here every survivor issues the same collectives
    assert phases.enter(Position(5, Phase.STEP)) == "run" and phases.catch_up_to is None


def test_with_nobody_ahead_every_phase_runs():
    phases = BetweenSteps(loop=None)
    assert phases.enter(Position(1, Phase.STEP)) == "run"
    assert phases.enter(Position(1, Phase.LOG)) == "run" and phases._barriers_run()
