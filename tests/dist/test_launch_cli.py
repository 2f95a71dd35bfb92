"""The launch users run: Megatron's flags, iteration lines, loss falls; bad input exits 2."""

import subprocess
import sys

import pytest

from tests.dist.launch import OWN_LOOP, REPO, TINY_GPT, check, iteration_losses, read_events, run_job

# On the project's own loop (Megatron-LM's loop needs --eval-interval, and prints tokens per second
# only with --log-throughput; tests/dist/test_megatron_loop.py launches it).
ISSUE_LAUNCH = [*OWN_LOOP] + (
    "--device cpu --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 "
    "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 "
    "--train-iters 12 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1"
).split()


def test_tp2_pp2_dp2_launch_trains(tmp_path):
    log = tmp_path / "events.jsonl"
    proc = run_job(8, [*ISSUE_LAUNCH, "--resihp-event-log", str(log)], launcher="torchrun")
    check(proc)
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(lines) == 12
    assert "consumed samples:          192" in lines[-1] and "tokens per second:" in lines[-1]
    assert "| loss scale: 1.0 |" in lines[-1] and "number of skipped iterations:   0 |" in lines[-1]
    losses = iteration_losses(log)
    assert losses[12] < losses[1]


def test_a_log_line_reports_its_intervals_mean_loss(tmp_path):
    log = tmp_path / "ev.jsonl"
    args = list(TINY_GPT)
    args[args.index("--log-interval") + 1] = "2"
    proc = run_job(1, [*args, "--train-iters", "4", "--resihp-event-log", str(log)])
    check(proc)
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss:" in line]
    assert [line.split("iteration")[1].split("/")[0].strip() for line in lines] == ["2", "4"]
    losses = iteration_losses(log)
    printed = [float(line.split("lm loss:")[1].split("|")[0]) for line in lines]
    assert printed == pytest.approx([(losses[1] + losses[2]) / 2, (losses[3] + losses[4]) / 2], rel=1e-6)


def _parse_only(argv, tmp_path):
    """Runs the entry point in one process; a validation error must stop it before any group or file."""
    return subprocess.run(
        [sys.executable, str(REPO / "pretrain_gpt_resilient.py"), *argv, "--save", str(tmp_path / "ckpt"),
         "--resihp-event-log", str(tmp_path / "ev.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "WORLD_SIZE": "8", "PATH": ""},
    )


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--bogus-flag"], "--bogus-flag"),
        (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
        (["--global-batch-size", "10", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
         "--global-batch-size"),
        (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ett|tL"], "--pipeline-model-parallel-layout"),
        (["--resihp-inject", "slow:rank=1"], "--resihp-inject"),
        (["--tokenizer-type", "NoSuchTokenizer"], "--tokenizer-type"),
        (["--cpu-device-time-scale", "0.5"], "--cpu-device-time-scale"),
        (["--packed-seq-layout", "thd"], "--reset-attention-mask"),
    ],
    ids=["unknown-flag", "tp-vs-heads", "global-batch", "layout-vs-layers", "inject-grammar", "tokenizer",
         "device-time-scale", "thd-without-documents"],
)
def test_bad_input_exits_2_naming_the_flag(tmp_path, extra, flag):
    base = [a for a in TINY_GPT] + ["--train-iters", "2"]
    proc = _parse_only([*base, *extra], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ev.jsonl").exists()


@pytest.mark.parametrize("extra", [["--sequence-parallel"], ["--use-distributed-optimizer", "--ckpt-format", "torch"],
                                   ["--context-parallel-size", "2"], ["--distributed-backend", "nccl"],
                                   ["--transformer-impl", "transformer_engine"]],
                         ids=["sequence-parallel", "distributed-optimizer", "context-parallel", "backend", "te"])
def test_megatron_flags_the_resilient_front_end_lacks_are_refused_not_dropped(tmp_path, extra):
    proc = _parse_only([*TINY_GPT, "--train-iters", "1", *extra], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert extra[0] in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "ev.jsonl").exists()


def test_megatron_flags_whose_request_is_met_are_accepted(tmp_path):
    log = tmp_path / "ev.jsonl"
    proc = run_job(1, [*TINY_GPT, "--train-iters", "1", "--use-mcore-models", "--transformer-impl", "local",
                       "--distributed-backend", "gloo", "--no-bias-gelu-fusion", "--resihp-event-log", str(log)])
    check(proc)
    assert [e["iteration"] for e in read_events(log, "iteration")] == [1]


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    # The project's own loop's writer (TINY_GPT names --resihp-loop resihp).
    check(run_job(1, [*TINY_GPT, "--train-iters", "3", "--tensorboard-dir", str(board),
                      "--resihp-event-log", str(tmp_path / "ev.jsonl")]))
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3]
    assert {"learning-rate", "grad-norm", "iteration-time"} <= set(events.Tags()["scalars"])
