"""The local launcher's exit code tells a supervisor what happened to the job."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # as the launcher runs: a script
from launch_local import exit_code  # noqa: E402


def test_a_job_whose_survivors_finished_succeeds():
    assert exit_code({0: 0, 1: -9, 2: 0}, [1, 0, 2]) == 0


def test_a_rank_that_left_on_its_own_error_is_a_failed_rank_the_job_survived():
    # Rank 1 raised and left (4) so that the others could go on; they finished.
    assert exit_code({0: 0, 1: 4, 2: 0}, [1, 0, 2]) == 0
    # Every rank left on an error of its own: nothing finished.
    assert exit_code({0: 4, 1: 4}, [0, 1]) == 4
    # A rank that crashed otherwise still fails the job, with the first failure's code.
    assert exit_code({0: 0, 1: 4, 2: 1}, [1, 2, 0]) == 4


def test_survivors_that_fell_back_make_the_job_exit_3_whatever_died_first():
    # Rank 1 crashed (1), rank 2 was killed, the survivors wrote a fallback checkpoint (3).
    assert exit_code({0: 3, 1: 1, 2: -9, 3: 3}, [2, 1, 0, 3]) == 3


def test_otherwise_the_first_failure_is_the_jobs_code():
    assert exit_code({0: 1, 1: 2}, [1, 0]) == 2
    assert exit_code({0: -15, 1: -15}, [0, 1]) == 128 + 15
