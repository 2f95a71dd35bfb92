"""The launch users run, on Megatron-LM's loop: torchrun and the local launcher, Megatron's
iteration lines, a falling loss, TensorBoard scalars; bad flags exit 2 naming the flag."""

import subprocess
import sys

import pytest

from tests.dist.launch import REPO, check, read_events, run_job
from tests.dist.megatron_jobs import logged_losses

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

LAUNCH = (
    "--device cpu --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
    "--train-iters 12 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --split 99,1,0"
).split()
ONE_RANK = [*LAUNCH[:2], *LAUNCH[6:]]


def test_tp2_pp2_dp2_launch_under_torchrun_trains(tmp_path):
    log = tmp_path / "events.jsonl"
    proc = run_job(8, [*LAUNCH, "--resihp-enable", "--resihp-event-log", str(log)], launcher="torchrun")
    check(proc)
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(lines) == 12
    assert "consumed samples:          192" in lines[-1] and "number of skipped iterations:   0 |" in lines[-1]
    losses = logged_losses(proc.stdout)
    assert losses[12] < losses[1]
    assert [e["iteration"] for e in read_events(log, "iteration")] == list(range(1, 13))


def _parse_only(argv, tmp_path):
    """Runs the entry point in one process; a validation error must stop it before any group or file."""
    return subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt_resilient.py"), *argv, "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
         "--resihp-event-log", str(tmp_path / "ev.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "WORLD_SIZE": "8", "PATH": "", "HOME": str(tmp_path)},
    )


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--bogus-flag"], "--bogus-flag"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tL"],
         "--pipeline-model-parallel-layout"),
        (["--resihp-inject", "slow:rank=1"], "--resihp-inject"),
        (["--resihp-inject", "kill:rank=99,at=2"], "--resihp-inject"),
        (["--cpu-device-time-scale", "0.5"], "--cpu-device-time-scale"),
        (["--packed-seq-layout", "thd"], "--reset-attention-mask"),
    ],
    ids=["unknown-flag", "layout-vs-layers", "inject-grammar", "inject-rank", "device-time-scale",
         "thd-without-documents"],
)
def test_bad_input_exits_2_naming_the_flag(tmp_path, extra, flag):
    proc = _parse_only([*ONE_RANK, "--resihp-enable", *extra], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert flag in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ev.jsonl").exists()


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    args = [*ONE_RANK, "--tensorboard-dir", str(board), "--resihp-enable", "--resihp-event-log", str(tmp_path / "ev")]
    args[args.index("--train-iters") + 1] = "3"
    check(run_job(1, args))
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]
    assert {"learning-rate", "grad-norm"} <= set(events.Tags()["scalars"])
