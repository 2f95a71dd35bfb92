"""GPT pretraining on Megatron-LM's own training loop (``megatron.training.pretrain``, megatron-core 0.19.2).

Responsible for what Megatron-LM's ``pretrain_gpt.py`` supplies to ``pretrain()`` and the wheel does
not ship: the model provider (the Transformer Engine layer spec when TE is installed and asked for,
megatron-core's local spec otherwise), the forward step with its per-token loss, and the
train/valid/test datasets provider (megatron-core's ``GPTDataset`` builder over ``--data-path`` or
``--mock-data``, with the tokenizer Megatron builds from ``--tokenizer-*``). It adds one flag,
``--device {cuda,cpu}``; ``--device cpu`` puts the process in CPU mode (``cpu_training``) and implies
the flags a CPU job needs (``cpu_training.implied_flags``). Every other flag is Megatron's own,
parsed and validated by Megatron. Before Megatron validates them, the files they name are checked
(``megatron_inputs``: a bad one exits 2 with one message), and a job on data files without
``--data-cache-path`` keeps its dataset index caches in ``~/.cache/resihp-megatron/data-cache``.

It must never parse, drop or reinterpret a Megatron flag, with one exception that is refused
rather than dropped: ``--rampup-batch-size``, which megatron-core 0.19.2 accepts and ignores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch

# Every rank imports these, and they take seconds of CPU (megatron-core pulls in much of torch):
# imported at the top, a launcher's fork server (scripts/rank_fork_server.py) imports them once for
# all of its ranks. None of them patches anything on import; the patches are installed in main().
import megatron.core.tokenizers.text  # noqa: F401 (Megatron's tokenizers; imports transformers)
import megatron.training.training  # noqa: F401
from megatron.resihp import (cpu_training, megatron_loop_resilience, reshardable_save_offsets,  # noqa: F401
                             sync_save_results, training_compat)

# What this script sets where the command line says nothing (Megatron's args_defaults).
ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
REFUSED_FLAGS = {
    "--rampup-batch-size": (
        "megatron-core 0.19.2 accepts --rampup-batch-size and ignores it (the job would train at the full "
        "--global-batch-size from its first step); express the ramp as --step-batch-size-schedule "
        "'THRESHOLD:BATCH_SIZE ...' (and drop --global-batch-size), or remove the flag"
    ),
}


def add_device_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: the ``--device`` flag and those of packed documents."""
    from megatron.resihp import packed_documents

    packed_documents.add_args(parser)
    group = parser.add_argument_group(title="device")
    group.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                       help="where the job runs; cpu runs every rank on the host over gloo and implies "
                            + " ".join(_cpu_flags()))
    return parser


def _cpu_flags() -> list[str]:
    from megatron.resihp.cpu_training import implied_flags

    return implied_flags()


def has_transformer_engine() -> bool:
    from megatron.core.extensions import transformer_engine

    return bool(getattr(transformer_engine, "HAVE_TE", False))


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config=None, pg_collection=None):
    """One GPT model chunk, as ``get_model`` asks for it.

    Args:
        pre_process: whether this chunk holds the embedding.
        post_process: whether this chunk holds the output layer and computes the loss.
        vp_stage: the virtual pipeline stage of the chunk (interleaved schedule), else None.
        config: a ``TransformerConfig``; built from the flags when None.
        pg_collection: the process groups the chunk talks over.

    Returns:
        A ``megatron.core.models.gpt.GPTModel``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training import get_args
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.resihp import packed_documents

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine" and has_transformer_engine()
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    block_spec = packed_documents.with_document_attention(block_spec, args)
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def _dataset_built_on_this_rank(every_tp_rank: bool = False, every_stage: bool = False) -> bool:
    # Only the stages that read tokens or labels need the data (``every_stage``: all of them read
    # the documents' bounds), and only TP rank 0 of them reads it; ``every_tp_rank``: any rank of
    # theirs may read it later (at TP 1, its group having lost ranks).
    from megatron.core import parallel_state as mpu

    first = mpu.is_pipeline_first_stage(ignore_virtual=True)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    return (first or last or every_stage) and (every_tp_rank or mpu.get_tensor_model_parallel_rank() == 0)


def datasets_provider(num_samples: list[int], vp_stage: int | None = None, every_tp_rank: bool = False):
    """Train, validation and test ``GPTDataset``s (``MockGPTDataset``s with ``--mock-data``, of documents
    whose lengths ``--mock-doc-lengths`` draws when given).

    Args:
        num_samples: how many samples each split must yield at least.
        vp_stage: unused; the datasets are the same for every chunk.
        every_tp_rank: built on every TP rank of the first and last stages, not only TP rank 0.

    Returns:
        ``(train, valid, test)``, each None where the split is empty or not built on this rank.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    from megatron.resihp import packed_documents
    from megatron.resihp.data.datasets import ResiHPGPTDatasetConfig, VariableLengthMockGPTDataset

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    variable = args.mock_data and args.mock_doc_lengths is not None
    extra = {"mock_doc_lengths": args.mock_doc_lengths} if variable else {}
    config = (ResiHPGPTDatasetConfig if variable else GPTDatasetConfig)(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        **extra,
    )
    dataset_type = (VariableLengthMockGPTDataset if variable else MockGPTDataset) if args.mock_data else GPTDataset
    built_here = partial(_dataset_built_on_this_rank, every_tp_rank, packed_documents.every_stage_reads(args))
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, built_here, config).build()


# Every rank calls the provider; the builder itself decides which ranks build (``is_built_on_rank``).
datasets_provider.is_distributed = True


def _batch(data_iterator, vp_stage: int | None):
    """This rank's part of the next micro-batch (TP rank 0 reads it, the others receive it), or None
    on a stage that reads none; with whether the stage is the first and whether it is the last."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    from megatron.resihp import packed_documents

    args = get_args()
    first = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    every_stage = packed_documents.every_stage_reads(args)
    if not (first or last or every_stage):
        return None, first, last
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {k: (v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in next(data_iterator).items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=False,
        # One stage's worth (every tensor) where every stage reads: each finds the documents' bounds.
        pipeline_model_parallel_size=1 if every_stage else args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last,
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return batch, first, last


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, the token count, and ``[sum, count]`` to report.

    Megatron divides by the count (per micro-batch, or over the global batch with
    ``--calculate-per-token-loss``) and logs ``sum / count`` over the batch as ``lm loss``.
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch through ``model``: the output and the loss function the schedule applies to it."""
    from megatron.core.utils import get_attr_wrapped_model

    # The schedule hands over a chunk wrapped in DDP (and Float16Module): the stage is the GPT model's.
    from megatron.training import get_args

    from megatron.resihp import packed_documents

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    batch, first, last = _batch(data_iterator, vp_stage)
    if batch is None:  # a middle stage: its input comes from the previous one
        return model(None, None, None, labels=None), partial(loss_func, None)
    if packed_documents.document_attention(get_args()):
        output, loss_mask = packed_documents.forward(model, batch, get_args(), first, last)
        return output, partial(loss_func, loss_mask)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def add_resilient_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider`` of a resilient job: ``--device`` and the ``--resihp-*`` flags."""
    from megatron.resihp.resihp_flags import add_resihp_args

    add_resihp_args(add_device_args(parser))
    # Only with resilience: the schedule hooks that pad each op are installed by it.
    parser.add_argument("--cpu-device-time-scale", type=float, default=0.0, metavar="K",
                        help="with --device cpu: every rank acts as a dedicated device K times slower than one "
                             "core (each forward and backward is padded with sleep to K x its CPU time), so ranks "
                             "that share cores stop slowing each other down; timing only, numerics unchanged. "
                             "K >= 1; 0 (default) is off")
    return parser


def _escape_percent_signs(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make every flag's help printable: argparse %-formats help strings, and megatron-core 0.19.2
    ships one with a bare "%" (``--moe-paged-stash-buffer-size-factor-cuda``) that makes ``--help``
    raise instead of printing."""
    for action in parser._actions:
        if not action.help or "%" not in action.help:
            continue
        try:
            action.help % {**vars(action), "prog": parser.prog}
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")
    return parser


def resilience_config(args: argparse.Namespace):
    """The ``ResiHPConfig`` of the parsed ``--resihp-*`` flags; exits 2 with the flag and the fix on a
    bad value, or on a Megatron feature the resilience layer cannot carry through a re-form yet."""
    import dataclasses
    import os

    from megatron.resihp import detection_cost
    from megatron.resihp.megatron_loop_stages import launch_split
    from megatron.resihp.megatron_loop_support import unsupported_flags
    from resihp_ext.config import ResiHPConfig
    from resihp_ext.faults import check_ranks_exist

    try:
        cfg = ResiHPConfig(**{f.name: getattr(args, "resihp_" + f.name) for f in dataclasses.fields(ResiHPConfig)})
        check_ranks_exist(cfg.faults, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as error:
        _refuse(str(error))
    try:
        detection_cost.period_and_phase()
    except ValueError as error:
        _refuse(str(error))
    scale = args.cpu_device_time_scale
    if scale and (args.device != "cpu" or scale < 1):
        _refuse(f"--cpu-device-time-scale {scale:g} needs --device cpu and a value >= 1 (0 turns it off)")
    try:
        split = launch_split(args)
    except (AssertionError, ValueError) as error:
        flag = "--pipeline-model-parallel-layout" if getattr(args, "pipeline_model_parallel_layout", None) else "--num-layers"
        _refuse(f"{flag}: megatron-core places this job's layers on no pipeline split it can rebuild: "
                f"{str(error).strip() or 'an assertion'}")
    lacking = unsupported_flags(args, cfg, split)
    if lacking:
        _refuse("resilience on Megatron-LM's loop cannot carry yet: " + "; ".join(lacking)
                + ". Remove these flags, or drop the --resihp-* flags to run Megatron-LM's loop without resilience")
    return cfg


def _refuse(message: str) -> None:
    import os

    if int(os.environ.get("RANK", "0")) == 0:  # every rank finds the same error; one says it
        print(f"pretrain_gpt_resilient.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def refuse_ignored_flags(argv: list[str]) -> None:
    """Exit 2 on a flag that megatron-core accepts but ignores (``REFUSED_FLAGS``), before anything starts."""
    for flag, fix in REFUSED_FLAGS.items():
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            print(f"pretrain_gpt_resilient.py: error: {flag}: {fix}", file=sys.stderr)
            sys.exit(2)


def refuse_missing_flags(args: argparse.Namespace) -> None:
    """Exit 2 on a flag megatron-core 0.19.2 needs and does not check for, before anything starts: without
    ``--eval-interval`` its data set-up divides by None on every rank (unless ``--full-validation`` or
    ``--skip-train``); on a GPU without apex, gradient accumulation fusion (on by default) fails as the
    model is built."""
    if args.eval_interval is None and not args.full_validation and not args.skip_train:
        _refuse("--eval-interval: Megatron-LM's loop sizes its validation data by it; pass --eval-interval N "
                "(with --eval-iters 0 to evaluate never)")
    if args.device == "cuda" and args.gradient_accumulation_fusion and not has_apex_wgrad_fusion():
        # Megatron's own error comes once the model is built, after the job's start-up.
        _refuse("--no-gradient-accumulation-fusion: Megatron fuses weight-gradient accumulation by default, "
                "with apex's fused_weight_gradient_mlp_cuda extension, which is not installed; pass "
                "--no-gradient-accumulation-fusion, or install apex with its --cpp_ext --cuda_ext extensions")


def has_apex_wgrad_fusion() -> bool:
    """Whether apex's weight-gradient fusion kernel, which Megatron's own linear layers call, is installed."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def failed_check(error: AssertionError) -> str:
    """One line for an assertion Megatron's argument validation failed: its message, or its source line
    when it has none, where it stands, and the flags that line reads (``args.save_interval`` is
    ``--save-interval``)."""
    import os
    import re
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    line = (frame.line or "").strip()
    flags = sorted({"--" + name.replace("_", "-") for name in re.findall(r"\bargs\.([a-z0-9_]+)", line)})
    reads = f"; the flags it reads: {', '.join(flags)}" if flags else ""
    return (f"Megatron-LM's check of its arguments failed ({os.path.basename(frame.filename)}:{frame.lineno}): "
            f"{str(error).strip() or line}{reads}")


def device_of(argv: list[str]) -> str:
    """The ``--device`` the command line asks for (``cuda`` when absent); argparse reports bad values later."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--device", default="cuda")
    known, _ = probe.parse_known_args(argv)
    return known.device


def _run_as_a_device() -> None:
    """A CPU rank keeps the memory it frees (``host_memory``), runs ``RESIHP_CPU_THREADS`` torch
    threads (default 1) and, where the host has a core for every rank, on a core of its own
    (``cpu_affinity``): what its ops take then varies as a device's would, not with page faults or
    the cores the scheduler moves it between."""
    import os

    from megatron.resihp import cpu_affinity, host_memory

    host_memory.keep_freed_memory()
    threads = os.environ.get("RESIHP_CPU_THREADS", "1")
    if not threads.isdigit() or int(threads) < 1:
        _refuse(f"RESIHP_CPU_THREADS must be a whole number >= 1 (torch threads per CPU rank), got {threads!r}")
    torch.set_num_threads(int(threads))
    try:
        cpu_affinity.pin_this_rank()
    except ValueError as error:
        _refuse(str(error))


def _process_start() -> float:
    """When this process started, in ``time.time()``'s clock, to the kernel's clock tick (10 ms) on
    Linux (psutil's ``create_time`` adds the boot time, which Linux gives in whole seconds)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        import psutil

        return psutil.Process().create_time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def count_time_from_process_start() -> None:
    """Make Megatron count the job's time (``--exit-duration-in-mins``, "time to initialize megatron")
    from this process's start.

    Megatron takes the moment ``megatron.training.training`` was imported as the start. This module
    imports it at its top, so in a rank forked from a fork server that moment is the server's, which
    may have imported it long before (a shared server serves many launches): a job would count that
    wait against its time limit. A forked process's start is its fork.
    """
    from megatron.training import training

    start = _process_start()
    training.set_startup_timestamps(program_start=start, main_entry=time.time())
    training._LEGACY_TRAIN_START_TIME = start  # what Megatron's "time to initialize megatron" counts from


def main(argv: list[str] | None = None) -> None:
    """Run Megatron-LM's ``pretrain()`` for GPT with the command line ``argv`` (``sys.argv[1:]`` if None)."""
    count_time_from_process_start()
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = [sys.argv[0], *argv]
    refuse_ignored_flags(argv)
    from megatron.resihp import reshardable_save_offsets, training_compat

    training_compat.install()  # a GPU job without Transformer Engine or apex needs these fixes too
    reshardable_save_offsets.install()
    if device_of(argv) == "cpu":
        from megatron.resihp import cpu_training

        cpu_training.enable()
        _run_as_a_device()
        # First, so that a flag the user passes again takes precedence (argparse keeps the last).
        argv = cpu_training.implied_flags() + argv
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from megatron.resihp.megatron_inputs import refuse_bad_inputs, with_data_cache_path

    # --help lists the --resihp-* flags too.
    resilient = any(a.startswith("--resihp-") or a in ("-h", "--help") for a in argv)
    add_flags = add_resilient_args if resilient else add_device_args
    extra_args = lambda parser: _escape_percent_signs(add_flags(parser))  # noqa: E731
    sys.argv = [sys.argv[0], *argv]  # Megatron's parser reads sys.argv
    # The files the job reads are checked on the flags as parsed, before Megatron validates them:
    # validation already reads a checkpoint (--use-checkpoint-args) and builds the tokenizer.
    parsed = parse_args(extra_args_provider=extra_args)
    refuse_missing_flags(parsed)
    from megatron.resihp import packed_documents

    if (packed := packed_documents.refusal(parsed)) is not None:
        _refuse(packed)
    refuse_bad_inputs(parsed, ARGS_DEFAULTS)
    sys.argv = [sys.argv[0], *with_data_cache_path(parsed, argv)]
    try:
        args = parse_and_validate_args(extra_args_provider=extra_args, args_defaults=ARGS_DEFAULTS)
    except AssertionError as error:  # megatron-core checks many flags with bare asserts
        _refuse(failed_check(error))
    sys.argv = command_line  # parsed; a printed resume command repeats the user's flags, not the implied ones
    packed_documents.install(args)
    sync_save_results.install(args)  # what a save writes is the same; a spawned process per rank is not
    loop = None
    if resilient:
        from megatron.resihp import heartbeat_beacon
        from megatron.resihp.megatron_loop_resilience import ResilientMegatronLoop
        from megatron.resihp.megatron_loop_setup import leave_before_training

        cfg = resilience_config(args)
        if cfg.detection_on:
            # Forked before anything starts a thread (process groups do): see heartbeat_beacon.
            heartbeat_beacon.start_beacon(cfg.heartbeat_interval_s, stopped_after_s=cfg.heartbeat_timeout_s)
        loop = ResilientMegatronLoop(cfg, model_provider, ModelType.encoder_or_decoder)
        loop.install()
    provider = datasets_provider
    if loop is not None and loop.shrinks_tp(args):
        provider = partial(datasets_provider, every_tp_rank=True)
        provider.is_distributed = True
    try:
        pretrain(pretrain_cfg_container_from_args(args), provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
    except RuntimeError as error:
        if loop is not None:
            leave_before_training(loop, error)  # a rank lost during the set-up: leaves with the command to run again
        raise
    if loop is not None:
        loop.close()
