"""Jobs run Megatron-LM's own training loop (megatron-core 0.19.2) on CPU ranks.

Megatron's example scripts run with their flag sets as written, changed only where the test says, and
again with resilience on;
TP2 x PP2 x DP2 trains with the distributed optimizer and sequence parallelism; checkpoints move
between pretrain_gpt_resilient.py and a plain ``megatron.training.pretrain`` GPT script both ways,
and resuming reproduces the uninterrupted run's losses; a fully reshardable save of the distributed
optimizer holds each parameter's own state (``reshardable_save_offsets``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from scripts.child_env import job_env
from tests.dist.launch import REPO, check, read_events, run_job
from tests.dist.megatron_jobs import checkpoint_tensors, job_args, logged_losses, replaced

mcore = pytest.importorskip("megatron.core.package_info")
pytestmark = pytest.mark.skipif(mcore.__version__.split("+")[0] != "0.19.2",
                                reason="Megatron-LM's training package ships in megatron-core 0.19.2 (Python >= 3.12)")

# Megatron prints one line per logged iteration: "iteration  N/  M | ... | lm loss: X | ...".
_ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|")
# What --device cpu stands for, spelled out for a script that has no --device flag.
CPU_FLAGS = ["--distributed-backend", "gloo", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
             "--no-rope-fusion", "--no-masked-softmax-fusion", "--transformer-impl", "local"]


def run_script(nproc: int, script: Path, args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Start ``script`` on ``nproc`` ranks through scripts/launch_local.py, as run_job does for ours."""
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local.py"), f"--nproc-per-node={nproc}", str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout_s)


def gpt3_175b_args(tmp: Path) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh's flags (GPT_MODEL_ARGS, TRAINING_ARGS,
    MODEL_PARALLEL_ARGS, DATA_ARGS, EVAL_AND_LOGGING_ARGS), in its order.

    Changed: sizes (model, batch, iterations, TP8 x PP16 -> TP2 x PP2, eval iterations, the log
    interval, so each iteration is logged); ``--data-path`` -> ``--mock-data``; the tokenizer: the script
    passes GPT-2's ``--vocab-file``/``--merge-file`` (GPT2BPETokenizer, which needs those files and the
    ``transformers`` package), replaced by ``--tokenizer-type NullTokenizer --vocab-size 512``;
    ``--rampup-batch-size 16 16 5859375`` is left out here (megatron-core 0.19.2 ignores it, so the job
    refuses it: ``test_rampup_batch_size_is_refused``); paths in ``tmp``; ``--device cpu``.
    """
    return [
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
        "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "5",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--split", "949,50,1",
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--eval-iters", "2",
        "--tensorboard-dir", str(tmp / "tb"),
        "--device", "cpu",
    ]


def llama3_8b_fp8_args(tmp: Path) -> list[str]:
    """examples/llama/train_llama3_8b_h100_fp8.sh's flags (MODEL_ARGS, TRAINING_ARGS with DDP_ARGS,
    MODEL_PARALLEL_ARGS, the MOCK branch of DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS), in its order.

    Changed: sizes (model, batch, samples, vocabulary, eval iterations; TP_SIZE 2, as the script's
    sequence-parallel comment has it, and its commented-out ``--pipeline-model-parallel-size`` line
    in, with PP_SIZE 2); DTYPE fp8 -> bf16 (the DTYPE_ARGS are the fp8 ones: a CPU has no fp8); the
    ``--split '99,1,0'`` the script writes with literal quotes (its unquoted array expansion passes
    them on) as ``99,1,0``; paths in ``tmp``; ``--device cpu``.
    """
    return [
        "--use-mcore-models", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "224",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
        "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "48",
        "--lr-decay-samples", "40", "--lr-warmup-samples", "8", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
        "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
        "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
        "--data-cache-path", str(tmp / "cache"), "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
        "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
        "--save", str(tmp / "ckpt"), "--load", str(tmp / "ckpt"), "--tensorboard-dir", str(tmp / "tb"),
        "--device", "cpu",
    ]


@pytest.mark.parametrize("flags, world", [(gpt3_175b_args, 6), (llama3_8b_fp8_args, 4)],
                         ids=["gpt3_175b_distributed", "llama3_8b_h100_fp8"])
def test_megatron_example_script_with_resilience_survives_a_sigkilled_rank_in_place(tmp_path, flags, world):
    """Each example script's flag set with ``--resihp-enable`` added runs to its last iteration, every
    iteration logged, and saves there; rank 5, SIGKILLed in iteration 4, is survived in place on the
    way. Replica 1 goes on whole; under the gpt3 script's plain optimizer ranks 0 and 4 of replica 0
    go on beside it at TP 1 (world 6), under the llama script's distributed optimizer replica 1 alone
    (world 4). The gpt3 script's fp16 skips its first iterations' updates while the loss scale (2^32
    to start) halves on each overflow, as it does on GPUs, so only the llama script's bf16 logs every
    loss."""
    events = tmp_path / "events.jsonl"
    # The llama script's --cross-entropy-loss-fusion compiles (torch.compile) in the last stage's
    # first iteration while the first stage waits on it in a send: on a loaded 2-core host that
    # took past the default 30 s collective timeout, and the world then re-forms as it was
    # (test_megatron_loop_collective_timeouts.py), a change this test does not count on. The kill
    # is named by heartbeats, not by this timeout.
    proc = run_job(8, [*flags(tmp_path), "--resihp-enable", "--resihp-event-log", str(events),
                       "--resihp-collective-timeout-s", "120", "--resihp-inject", "kill:rank=5,at=4"], timeout_s=420)
    check(proc)
    adapted = read_events(events, "adapted")
    assert [(a["iteration"], a["world_size"], a["failed_ranks"]) for a in adapted] == [(4, world, [5])], adapted
    assert sorted(int(i) for i in _ITERATION.findall(proc.stdout)) == list(range(1, 7)), proc.stdout[-3000:]
    if "--bf16" in flags(tmp_path):
        assert sorted(logged_losses(proc.stdout)) == list(range(1, 7)), proc.stdout[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_a_corpus_preprocessed_with_a_hugging_face_tokenizer_trains_with_the_same_tokenizer_flags(tmp_path):
    """The Llama scripts' non-mock data branch: ``--data-path`` with ``--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model DIR``, the folder given to ``tools/preprocess_data.py``
    too (made here, read offline). Megatron pads the tokenizer's vocabulary for the model, and the
    resilient job trains every iteration on the documents."""
    from tests.dist.input_files import corpus_texts, hugging_face_tokenizer, write_corpus

    vocab = hugging_face_tokenizer(tmp_path / "tokenizer", corpus_texts()).get_vocab_size()
    tokenizer = ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tokenizer"))
    prefix = write_corpus(tmp_path, tokenizer, name="hf")
    proc = run_job(2, [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "4", "--lr", "1e-3", "--data-path", str(prefix), *tokenizer,
        "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache"), "--eval-iters", "0",
        "--eval-interval", "1000", "--log-interval", "1", "--device", "cpu", "--resihp-enable",
        "--resihp-event-log", str(tmp_path / "events.jsonl")], timeout_s=300)
    check(proc)
    assert sorted(logged_losses(proc.stdout)) == [1, 2, 3, 4], proc.stdout[-3000:]
    padded = -(-vocab // 128) * 128  # --make-vocab-size-divisible-by 128 at TP 1
    assert f"padded vocab (size: {vocab}) with {padded - vocab} dummy tokens (new size: {padded})" in \
        proc.stdout + proc.stderr, proc.stdout[-3000:]


def test_rampup_batch_size_is_refused(tmp_path):
    args = gpt3_175b_args(tmp_path)
    at = args.index("--train-iters")
    args[at:at] = ["--rampup-batch-size", "16", "16", "5859375"]
    proc = run_job(1, args, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--rampup-batch-size" in proc.stderr and "--step-batch-size-schedule" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "ckpt").exists()


# A GPT pretraining script with nothing of this project but the CPU layer: megatron-core's GPT model
# with its local layer spec, its mock datasets, and Megatron's own pretrain().
PLAIN_GPT = textwrap.dedent('''
    from functools import partial

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args, get_tokenizer, pretrain
    from megatron.training.argument_utils import core_transformer_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron.resihp import cpu_training


    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        args = get_args()
        return GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                        pre_process=pre_process, post_process=post_process, pg_collection=pg_collection,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        vp_stage=vp_stage)


    def datasets(num_samples):
        args = get_args()
        config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, split=args.split,
                                  tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=False, create_attention_mask=False)
        built_here = lambda: mpu.get_tensor_model_parallel_rank() == 0
        return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, built_here, config).build()


    datasets.is_distributed = True  # the builder synchronises every rank: all of them call it


    def loss(loss_mask, output):
        mask = loss_mask.float().view(-1)
        total = torch.sum(output.float().view(-1) * mask)
        count = mask.sum().to(torch.int)
        return total, count, {"lm loss": torch.cat([total.detach().view(1), count.detach().float().view(1)])}


    def forward_step(data_iterator, model):
        args = get_args()
        first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        tokens = labels = loss_mask = position_ids = None
        if first or last:
            tp_rank = mpu.get_tensor_model_parallel_rank()
            batch = dict(next(data_iterator), attention_mask=None) if tp_rank == 0 else {}
            batch = get_batch_on_this_tp_rank(
                batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
                broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
                broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
                micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                is_pipeline_first_stage=first, is_pipeline_last_stage=last)
            tokens, labels, loss_mask, position_ids = (batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
        return model(tokens, position_ids, None, labels=labels), partial(loss, loss_mask)


    if __name__ == "__main__":
        cpu_training.enable()
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        pretrain(pretrain_cfg_container_from_args(args), datasets, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
''')

# TP2 x PP2 x DP2 with the distributed optimizer and sequence parallelism, dropout on.
SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--lr", "1e-3", "--lr-decay-iters", "8", "--train-iters", "8", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "1000", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel",
         "--no-create-attention-mask-in-dataloader"]


def assert_resumed(resumed: dict[int, float], reference: dict[int, float], start: int, end: int) -> None:
    """Iterations start+1..end logged as in the uninterrupted run.

    Megatron logs a run's first iteration without resetting its loss sum (``is_first_iteration``), so
    with ``--log-interval 1`` a run's second logged loss is the mean of its first two iterations: in
    the reference, iteration 2; in a resumed run, iteration start+2.
    """
    assert sorted(resumed) == list(range(start + 1, end + 1)), resumed
    expected = {i: reference[i] for i in resumed}
    expected[start + 2] = (reference[start + 1] + reference[start + 2]) / 2
    for i in resumed:
        assert resumed[i] == pytest.approx(expected[i], rel=2e-6), (i, resumed, reference)


def test_checkpoints_move_between_our_script_and_a_plain_megatron_script(tmp_path):
    plain = tmp_path / "plain_pretrain_gpt.py"
    plain.write_text(PLAIN_GPT)
    ours_ckpt, plain_ckpt = tmp_path / "ours", tmp_path / "plain"
    # Uninterrupted, saving at 3 (and, as Megatron does at the end, at 8).
    full = run_job(8, [*SHAPE, "--device", "cpu", "--save", str(ours_ckpt), "--save-interval", "3"], timeout_s=420)
    check(full)
    reference = logged_losses(full.stdout)
    assert sorted(reference) == list(range(1, 9))
    # The plain script resumes our iteration-3 checkpoint and stops at 6, saving there.
    to_six = run_script(8, plain, [*SHAPE, *CPU_FLAGS, "--load", str(ours_ckpt), "--ckpt-step", "3",
                                   "--save", str(plain_ckpt), "--save-interval", "3", "--exit-interval", "6"],
                        timeout_s=420)
    check(to_six)
    assert_resumed(logged_losses(to_six.stdout), reference, 3, 6)
    # Ours resumes the plain script's iteration-6 checkpoint and finishes.
    to_end = run_job(8, [*SHAPE, "--device", "cpu", "--load", str(plain_ckpt)], timeout_s=420)
    check(to_end)
    assert_resumed(logged_losses(to_end.stdout), reference, 6, 8)


def test_a_fully_reshardable_save_holds_each_parameters_own_optimizer_state(tmp_path):
    # TP 1 x PP 2, one layer a stage: stage 0's first bucket (position embedding and layer, 54080
    # elements) is padded to 54144, and the word embedding has a bucket of its own after it. Stock
    # megatron-core 0.19.2 saved the embedding's fp32 main copy and moments 64 elements along.
    args = replaced(job_args(tmp_path, "ckpt"), {"--num-layers": "2", "--tensor-model-parallel-size": "1",
                                                 "--ckpt-format": "torch_dist", "--train-iters": "2"})
    proc = run_job(2, [*args, "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"], timeout_s=300)
    check(proc)
    assert "exceeds unpadded buffer" not in proc.stdout + proc.stderr
    saved = checkpoint_tensors(tmp_path / "ckpt", tmp_path)
    mains = {k.removeprefix("optimizer.state.param."): v for k, v in saved.items()
             if k.startswith("optimizer.state.param.")}
    assert "embedding.word_embeddings.weight" in mains and set(mains) <= set(saved), sorted(mains)
    for name, main in mains.items():  # fp32 weights: the main copy is the weight
        assert torch.equal(main, saved[name]), name
    for moment in ("exp_avg", "exp_avg_sq"):  # the last row is the embedding's, not zeros past the end
        assert saved[f"optimizer.state.{moment}.embedding.word_embeddings.weight"][-1].abs().max() > 0
