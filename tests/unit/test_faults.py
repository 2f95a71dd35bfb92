"""The --resihp-inject grammar: every kind parses, round-trips, and bad input names the fix."""

import pytest

from resihp_ext.faults import Fault, FaultKind, parse_fault


@pytest.mark.parametrize("spec", [
    "slow:rank=3,factor=2,at=20",
    "slow:rank=3,factor=2,at=20,until=40",
    "link:src=1,dst=3,factor=4,at=20",
    "kill:rank=5,at=30",
    "kill:rank=1,at=4,during=reform",
    "kill:rank=5,at=1,during=replan",
    "kill:rank=4,at=4,during=moves",
    "kill:rank=2,at=4,during=save",
    "kill:rank=2,at=4,during=save-write",
    "kill:rank=0,at=4,during=save-rename",
    "kill:rank=0,at=4,during=save-tracker",
    "kill:rank=3,at=8,during=shutdown",
    "raise:rank=5,at=4,during=backward",
    "hang:rank=2,at=40",
    "stall:rank=2,at=4,seconds=30",
    "stall:rank=2,at=4,seconds=0.5",
])
def test_round_trip(spec):
    fault = parse_fault(spec)
    assert fault.spec() == spec
    assert parse_fault(fault.spec()) == fault


def test_fields():
    link = parse_fault("link:src=1,dst=3,factor=4,at=20")
    assert (link.kind, link.src, link.dst, link.factor, link.at_iteration) == (FaultKind.LINK, 1, 3, 4.0, 20)
    kill = parse_fault("kill:rank=1,at=4,during=reform")
    assert (kill.kind, kill.rank, kill.at_iteration, kill.during) == (FaultKind.KILL, 1, 4, "reform")
    assert parse_fault("kill:rank=1,at=4").during is None


@pytest.mark.parametrize("spec, message", [
    ("melt:rank=1,at=2", "unknown fault kind"),
    ("slow:rank=1,at=2", "missing ['factor']"),
    ("kill:rank=1,at=2,factor=3", "unknown ['factor']"),
    ("slow:rank=1,factor=0.5,at=2", "factor= must be >= 1.0"),
    ("kill:rank=1,at=0", "at= must be an iteration >= 1"),
    ("link:src=2,dst=2,factor=2,at=3", "two different ranks"),
    ("kill:rank=1,at=2,during=sleep", "during= is for kill, raise and slow faults"),
    ("raise:rank=1,at=2,during=save", "a raise strikes during= one of ['forward', 'backward', 'optimizer']"),
    ("raise:rank=1,factor=2,at=2", "takes keys"),
    ("hang:rank=1,at=2,during=reform", "takes keys"),
    ("kill:rank=x,at=2", "ranks, at=, until=, on= and off= are integers"),
    ("slow:rank=1,factor=2,at=5,until=5", "until= is for slow faults and must be after at="),
    ("link:src=1,dst=2,factor=2,at=3,until=9", "unknown ['until']"),
    ("stall:rank=1,at=2", "missing ['seconds']"),
    ("stall:rank=1,at=2,seconds=0", "seconds= goes with stall faults"),
    ("stall:rank=1,at=2,seconds=soon", "seconds= numbers"),
    ("slow:rank=1,factor=2,at=2,during=reform", "a slowdown takes during=replan alone"),
    ("slow:rank=1,factor=2,at=2,until=9,during=replan", "without until=, on= or off="),
])
def test_bad_specs_name_the_flag_and_the_fix(spec, message):
    with pytest.raises(ValueError, match="--resihp-inject") as info:
        parse_fault(spec)
    assert message in str(info.value)


def test_an_unknown_phase_lists_every_phase_a_kill_can_wait_for():
    with pytest.raises(ValueError, match="--resihp-inject") as info:
        parse_fault("kill:rank=1,at=2,during=saving")
    for phase in ("reform", "rendezvous", "save", "save-write", "save-rename", "save-tracker", "shutdown"):
        assert f"'{phase}'" in str(info.value)


def test_a_raise_strikes_the_forward_pass_unless_told_otherwise():
    fault = parse_fault("raise:rank=5,at=4")
    assert (fault.kind, fault.rank, fault.at_iteration, fault.during) == (FaultKind.RAISE, 5, 4, "forward")
    assert fault.spec() == "raise:rank=5,at=4,during=forward"


def test_during_for_a_slowdown_is_a_re_plan_alone():
    with pytest.raises(ValueError, match="during="):
        Fault(FaultKind.SLOW, rank=1, at_iteration=2, factor=2.0, during="reform")
    fault = parse_fault("slow:rank=3,factor=2,at=1,during=replan")
    assert (fault.kind, fault.factor, fault.during) == (FaultKind.SLOW, 2.0, "replan")
    assert parse_fault(fault.spec()) == fault


def test_a_slowdown_with_an_end_is_active_from_at_until_before_until():
    fault = parse_fault("slow:rank=3,factor=2,at=5,until=8")
    assert [i for i in range(1, 12) if fault.active(i)] == [5, 6, 7]
    assert parse_fault("slow:rank=3,factor=2,at=5").active(10**6)


def test_an_intermittent_slowdown_is_active_in_bursts_and_round_trips():
    fault = parse_fault("slow:rank=3,factor=1.5,at=10,on=2,off=3,until=20")
    assert fault.intermittent and (fault.on_iters, fault.off_iters) == (2, 3)
    assert [i for i in range(1, 25) if fault.active(i)] == [10, 11, 15, 16]
    assert parse_fault(fault.spec()) == fault
    steady = parse_fault("slow:rank=3,factor=1.5,at=10")
    assert not steady.intermittent and all(steady.active(i) for i in range(10, 30))


@pytest.mark.parametrize("spec", ["slow:rank=3,factor=1.5,at=10,on=2",
                                  "slow:rank=3,factor=1.5,at=10,on=0,off=3",
                                  "slow:rank=3,factor=1.5,at=10,on=2,off=-1"])
def test_bursts_need_on_and_off_counts_of_at_least_one(spec):
    with pytest.raises(ValueError, match="--resihp-inject: on= and off= go together"):
        parse_fault(spec)


def test_bursts_are_for_slow_faults_only():
    with pytest.raises(ValueError, match="link takes keys"):
        parse_fault("link:src=1,dst=3,factor=4,at=20,on=2,off=2")


def test_an_injection_on_a_rank_outside_the_world_is_refused():
    from resihp_ext.faults import check_ranks_exist

    check_ranks_exist((parse_fault("kill:rank=7,at=2"), parse_fault("link:src=0,dst=7,factor=2,at=1")), 8)
    with pytest.raises(ValueError, match=r"--resihp-inject 'kill:rank=99,at=2': rank 99 does not exist in a job of 8"):
        check_ranks_exist((parse_fault("kill:rank=99,at=2"),), 8)
    with pytest.raises(ValueError, match="rank 8 does not exist"):
        check_ranks_exist((parse_fault("link:src=0,dst=8,factor=2,at=1"),), 8)
