"""The reference group a suspect's probes are compared with: healthy first, then the least slow."""

from resihp_ext.detection.suspicions import reference_ranks

# TP 1 x PP 2 x DP 2: group (replica, stage) -> its rank.
GROUPS = {(0, 0): (0,), (1, 0): (1,), (0, 1): (2,), (1, 1): (3,)}


def test_a_healthy_group_on_the_suspects_stage_comes_first():
    assert reference_ranks((1, 1), GROUPS) == (2,)
    assert reference_ranks((1, 1), GROUPS, avoid={(0, 1), (0, 0)}) == (1,)


def test_of_groups_all_in_runs_of_slow_iterations_the_least_slow_is_the_reference():
    # Rank 0 known slow; rank 2, on the suspect's stage, in a run of 3x readings; rank 1 in a run of
    # 1.26x ones (a busy host). The suspect, rank 3, must be probed beside rank 1.
    running = {(0, 1): 3.0, (1, 0): 1.26, (1, 1): 3.2}
    last_resort = (running, set(), {(0, 0): 2.8})
    assert reference_ranks((1, 1), GROUPS, last_resort=last_resort, slowness=running) == (1,)
    # Without the readings the stage preference decides, as before.
    assert reference_ranks((1, 1), GROUPS, last_resort=last_resort) == (2,)
