"""Megatron-compatible command line for ``pretrain_gpt_resilient.py``.

Responsible for turning argv into one validated ``argparse.Namespace``: the Megatron-LM flags we
implement, the Megatron flags whose request it already meets (accepted), the ones it does not
implement (refused, never dropped), ``--device``, and the ``--resihp-*`` group generated from ``ResiHPConfig``. Every
error names the flag and the fix and exits with code 2 before anything is written. It must never
touch torch.distributed: the world size comes from the launcher's environment.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import typing

from resihp_ext.config import ResiHPConfig
from resihp_ext.faults import MEGATRON_LOOP_PHASES, FaultKind, check_ranks_exist

# Megatron-LM flags whose request this front end already meets, so a launch script may keep them:
# (name, takes_value). It always builds megatron-core models, never fuses kernels on these paths,
# keeps softmax and (in half precision) gradient reduction in fp32, and builds no attention mask.
_FULFILLED_FLAGS: tuple[tuple[str, bool], ...] = (
    ("--use-mcore-models", False), ("--no-gradient-accumulation-fusion", False),
    ("--no-masked-softmax-fusion", False), ("--no-bias-gelu-fusion", False), ("--no-bias-swiglu-fusion", False),
    ("--no-bias-dropout-fusion", False), ("--no-rope-fusion", False), ("--no-persist-layer-norm", False),
    ("--attention-softmax-in-fp32", False), ("--accumulate-allreduce-grads-in-fp32", False),
    ("--no-async-tensor-model-parallel-allreduce", False), ("--no-create-attention-mask-in-dataloader", False),
    ("--distributed-backend", True), ("--transformer-impl", True),
)

# Megatron-LM flags the resilient front end does not implement. Each is refused (exit 2) rather
# than dropped: a job would otherwise run with another shape, memory footprint or output than its
# script asks for. Without --resihp-* flags, pretrain_gpt_resilient.py runs Megatron-LM's own loop,
# which implements every one of them.
_UNSUPPORTED_FLAGS: tuple[tuple[str, bool], ...] = (
    ("--use-flash-attn", False), ("--sequence-parallel", False),
    ("--use-distributed-optimizer", False), ("--overlap-grad-reduce", False),
    ("--overlap-param-gather", False),
    ("--log-throughput", False), ("--log-timers-to-tensorboard", False),
    ("--log-validation-ppl-to-tensorboard", False), ("--log-memory-to-tensorboard", False),
    ("--log-num-zeros-in-grad", False), ("--log-params-norm", False), ("--use-checkpoint-args", False),
    ("--no-save-optim", False), ("--no-save-rng", False),
    ("--attention-backend", True), ("--timing-log-level", True), ("--timing-log-option", True),
    ("--tensorboard-log-interval", True), ("--tensorboard-queue-size", True), ("--wandb-project", True),
    ("--wandb-exp-name", True), ("--wandb-save-dir", True), ("--ckpt-format", True), ("--num-workers", True),
    ("--recompute-activations", False), ("--recompute-granularity", True),
    ("--recompute-method", True), ("--recompute-num-layers", True),
    ("--exit-duration-in-mins", True), ("--exit-interval", True),
    ("--context-parallel-size", True), ("--expert-model-parallel-size", True),
    ("--virtual-pipeline-model-parallel-size", True), ("--num-layers-per-virtual-pipeline-stage", True),
)


def _compat_dest(flag: str) -> str:
    return "compat_" + flag[2:].replace("-", "_")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default seq length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x DP")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    scaling = parser.add_argument_group("fp16 loss scaling (Megatron's names and defaults)")
    scaling.add_argument("--loss-scale", type=float, default=None, help="static loss scale; default: dynamic")
    scaling.add_argument("--initial-loss-scale", type=float, default=2**32)
    scaling.add_argument("--min-loss-scale", type=float, default=1.0)
    scaling.add_argument("--loss-scale-window", type=float, default=1000)
    scaling.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collection off during training, so no rank "
                        "pauses inside an op at a moment of its own")
    g.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="with --manual-gc, collect every N iterations, on every rank at once (0: never)")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="per-stage layers, Megatron syntax: stages split by '|', 'E' embedding, "
                        "'t' transformer layer, 'L' loss, 't*3' repeats; e.g. 'Ettt|tL'")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default cuda when available; cpu runs on gloo (see README, CPU mode)")
    g.add_argument("--cpu-device-time-scale", type=float, default=0.0, metavar="K",
                   help="CPU mode: every rank acts as a dedicated device K times slower than one core "
                        "(each forward/backward is padded with sleep to K x its CPU time), so ranks that "
                        "share cores stop slowing each other down; timing only, numerics unchanged. "
                        "Use K >= ranks per core; 0 (default) is off")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="folder for the datasets' index caches (default: ~/.cache/resihp-megatron/data-cache, or "
                        "under $XDG_CACHE_HOME; never beside the data, which may be read-only or shared)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--mock-doc-lengths", type=str, default=None,
                   help="mock documents of variable length, e.g. lognormal:median=48,sigma=1.0,min=8,max=1024")
    g.add_argument("--tokenizer-type", type=str, default="NullTokenizer")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--packed-seq-layout", choices=["auto", "sbhd", "thd"], default="auto",
                   help="with --reset-attention-mask: how a micro-batch of packed documents reaches "
                        "attention. sbhd keeps samples as [s, b]; thd flattens each micro-batch to one "
                        "sequence [b*s] through every pipeline stage and the loss, the layout Transformer "
                        "Engine's attention reads document boundaries in. auto: thd on CUDA with "
                        "Transformer Engine installed and --bf16/--fp16, sbhd otherwise")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--tensorboard-dir", type=str, default=None)


def _field_help(cls: type) -> dict[str, str]:
    """The first paragraph of the docstring under each dataclass field (attribute docstrings), on one line."""
    tree = ast.parse(inspect.getsource(cls)).body[0]
    docs, previous = {}, None
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            previous = node.target.id
        elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs[previous] = " ".join(str(node.value.value).strip().split("\n\n")[0].split())
            previous = None
    return docs


def add_resihp_args(parser: argparse.ArgumentParser) -> None:
    """The ``--resihp-*`` group, one flag per ``ResiHPConfig`` field (dest ``resihp_<field>``)."""
    g = parser.add_argument_group("resihp", "resilience: detection, planning, in-place adaptation")
    helps = _field_help(ResiHPConfig)
    hints = typing.get_type_hints(ResiHPConfig)
    for f in dataclasses.fields(ResiHPConfig):
        flag = "--resihp-" + f.name.replace("_", "-")
        kind = hints[f.name]
        dest = "resihp_" + f.name
        help_text = helps.get(f.name, "").replace("%", "%%")  # argparse %-formats help strings
        if kind is bool:
            g.add_argument(flag, dest=dest, action="store_true", help=help_text)
        elif typing.get_origin(kind) is list:
            g.add_argument(flag, dest=dest, action="append", default=[], help=help_text + " (repeatable)")
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            default = f.default if f.default is not dataclasses.MISSING else None
            g.add_argument(flag, dest=dest, type=base, default=default, help=f"{help_text} (default {default})")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        # One line a person can act on; the full usage is a --help away. Every rank parses the
        # same flags and finds the same error, so only the first rank says it.
        if int(os.environ.get("RANK", "0")) != 0:
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help to list every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt_resilient.py",
        description="Resilient GPT pretraining on megatron-core (Megatron-LM compatible flags).",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_training_args(parser)
    _add_parallel_args(parser)
    _add_data_args(parser)
    _add_logging_args(parser)
    add_resihp_args(parser)
    compat = parser.add_argument_group("Megatron-LM flags this front end meets or refuses")
    for flag, takes_value in (*_FULFILLED_FLAGS, *_UNSUPPORTED_FLAGS):
        if takes_value:
            compat.add_argument(flag, dest=_compat_dest(flag), default=None, help=argparse.SUPPRESS)
        else:
            compat.add_argument(flag, dest=_compat_dest(flag), action="store_true", default=None, help=argparse.SUPPRESS)
    return parser


def _check_compat_flags(args: argparse.Namespace) -> None:
    """Refuse the Megatron-LM flags this front end would otherwise have to drop."""
    used = [flag for flag, _ in _UNSUPPORTED_FLAGS if getattr(args, _compat_dest(flag)) is not None]
    if used:
        raise ValueError(
            f"{' '.join(used)}: not supported together with --resihp-* flags yet; remove "
            f"{'it' if len(used) == 1 else 'them'}, or drop the --resihp-* flags to run Megatron-LM's own training loop"
        )
    from megatron.resihp.initialize import world_backend
    from megatron.resihp.model_builder import uses_te_layers

    backend = args.compat_distributed_backend
    if backend is not None and backend not in world_backend(args.device):
        raise ValueError(
            f"--distributed-backend {backend} does not match --device {args.device}, which runs on "
            f"{world_backend(args.device)}; drop --distributed-backend"
        )
    impl = args.compat_transformer_impl
    wanted = "transformer_engine" if uses_te_layers(args) else "local"
    if impl is not None and impl != wanted:
        raise ValueError(
            f"--transformer-impl {impl}: with --device {args.device} this front end builds the {wanted} "
            f"layers; pass --transformer-impl {wanted} or drop the flag"
        )


def parse_layers_per_stage(layout: str, num_stages: int) -> tuple[int, ...]:
    """Count transformer layers per stage in a Megatron ``--pipeline-model-parallel-layout``.

    Accepts stages separated by ``|``, ``E`` (embedding), ``t`` (transformer layer), ``L``
    (loss) and repetition ``X*n`` or ``(...)*n``, as megatron-core does. Only one model chunk per
    stage is supported (no virtual pipeline).
    """
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except Exception as exc:  # megatron-core raises assertion errors with terse text
        raise ValueError(f"--pipeline-model-parallel-layout {layout!r} does not parse: {exc}") from None
    if len(stages) != num_stages:
        raise ValueError(
            f"--pipeline-model-parallel-layout {layout!r} has {len(stages)} stages but "
            f"--pipeline-model-parallel-size is {num_stages}; give one '|'-separated group per stage"
        )
    counts = []
    for i, stage in enumerate(stages):
        kinds = [getattr(x, "name", str(x)).strip().lower() for x in stage]
        bad = [k for k in kinds if k not in ("embedding", "decoder", "loss")]
        if bad:
            raise ValueError(f"--pipeline-model-parallel-layout: stage {i} has unsupported layer types {bad}")
        if ("embedding" in kinds) != (i == 0) or ("loss" in kinds) != (i == num_stages - 1):
            raise ValueError("--pipeline-model-parallel-layout: 'E' must open the first stage and 'L' close the last")
        counts.append(kinds.count("decoder"))
    return tuple(counts)


def _layers_per_stage(args: argparse.Namespace) -> tuple[int, ...]:
    pp, n = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if args.pipeline_model_parallel_layout:
        if first is not None or last is not None:
            raise ValueError("--pipeline-model-parallel-layout excludes --decoder-first/last-pipeline-num-layers; pass one")
        counts = parse_layers_per_stage(args.pipeline_model_parallel_layout, pp)
        if sum(counts) != n:
            raise ValueError(
                f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} holds {sum(counts)} "
                f"transformer layers but --num-layers is {n}; make them agree"
            )
        return counts
    if first is None and last is None:
        if n % pp:
            raise ValueError(
                f"--num-layers {n} is not divisible by --pipeline-model-parallel-size {pp}; use "
                "--pipeline-model-parallel-layout or --decoder-first/last-pipeline-num-layers for an uneven split"
            )
        return (n // pp,) * pp
    middle_stages = pp - (first is not None) - (last is not None)
    rest = n - (first or 0) - (last or 0)
    if middle_stages < 0 or rest < 0 or (middle_stages == 0 and rest) or (middle_stages and rest % middle_stages):
        raise ValueError(
            f"--decoder-first/last-pipeline-num-layers ({first}, {last}) leave {rest} layers that do not split "
            f"evenly over {max(middle_stages, 0)} middle stages of --num-layers {n}"
        )
    even = rest // middle_stages if middle_stages else 0
    counts = [even] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _packed_seq_layout(args: argparse.Namespace) -> str:
    """``--packed-seq-layout`` resolved to sbhd or thd (``args.device`` already resolved).

    Transformer Engine runs THD attention only in flash or fused kernels, which take fp16/bf16;
    an fp32 job on TE keeps samples as [s, b] with our document attention inside TE's layers.
    """
    import importlib.util

    half = args.bf16 or args.fp16
    te_attention = args.device == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    if args.packed_seq_layout == "thd":
        if not args.reset_attention_mask:
            raise ValueError("--packed-seq-layout thd needs --reset-attention-mask (documents to attend "
                             "within); add it or drop --packed-seq-layout")
        if te_attention and not half:
            raise ValueError("--packed-seq-layout thd on CUDA with Transformer Engine needs --bf16 or --fp16 "
                             "(TE's THD attention kernels take half precision); add one or use "
                             "--packed-seq-layout sbhd")
    if args.packed_seq_layout != "auto":
        return args.packed_seq_layout
    return "thd" if args.reset_attention_mask and te_attention and half else "sbhd"


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Fill derived values and check consistency; raise ``ValueError`` naming the flag and the fix."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} processes"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    if args.num_attention_heads % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} does not divide --num-attention-heads "
            f"{args.num_attention_heads}; choose a TP size that divides the head count"
        )
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    if args.ffn_hidden_size % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide --ffn-hidden-size {args.ffn_hidden_size}")
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.max_position_embeddings < args.seq_length:
        raise ValueError(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length {args.seq_length}")
    args.layers_per_stage = _layers_per_stage(args)
    if min(args.layers_per_stage) < 1:
        raise ValueError(f"every pipeline stage needs at least one layer; got {args.layers_per_stage}")
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    args.global_batch_size = args.global_batch_size or mbs * dp
    if args.global_batch_size % (mbs * dp):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size {mbs} x "
            f"data-parallel size {dp} (= world {world_size} / (TP {tp} x PP {pp})); pick a multiple of {mbs * dp}"
        )
    if args.train_iters < 1:
        raise ValueError(f"--train-iters must be >= 1, got {args.train_iters}")
    if args.manual_gc_interval < 0:
        raise ValueError(f"--manual-gc-interval must be >= 0 (0: never collect), got {args.manual_gc_interval}")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters exclude each other; pass one")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if not args.mock_data and not args.data_path:
        raise ValueError("no training data: pass --data-path PREFIX (see tools/preprocess_data.py) or --mock-data")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cpu_device_time_scale and (args.device != "cpu" or args.cpu_device_time_scale < 1):
        raise ValueError(f"--cpu-device-time-scale {args.cpu_device_time_scale:g} needs --device cpu and a "
                         "value >= 1 (0 turns it off)")
    args.packed_seq_layout = _packed_seq_layout(args)
    if args.save_interval is not None and not args.save:
        raise ValueError("--save-interval needs --save DIR")
    for flag, value in (("--loss-scale", args.loss_scale), ("--initial-loss-scale", args.initial_loss_scale),
                        ("--min-loss-scale", args.min_loss_scale), ("--loss-scale-window", args.loss_scale_window)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}; omit it for Megatron's default")
    if args.hysteresis < 1:
        raise ValueError(f"--hysteresis must be >= 1, got {args.hysteresis}")
    from megatron.resihp.data.tokenizer import build_tokenizer, padded_vocab_size

    args.tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size, args.vocab_file, args.merge_file)
    # Padded as for TP 8 (or the TP degree, if larger) rather than Megatron's 128 x TP: every
    # layout with TP <= 8 of the same model then has the same embedding shape, so a re-plan that
    # changes TP never changes a parameter, and runs of different shapes are comparable exactly.
    args.padded_vocab_size = padded_vocab_size(args.tokenizer, args.make_vocab_size_divisible_by, max(tp, 8))
    args.resihp = ResiHPConfig(**{f.name: getattr(args, "resihp_" + f.name) for f in dataclasses.fields(ResiHPConfig)})
    check_ranks_exist(args.resihp.faults, world_size)
    for fault in args.resihp.faults:
        if fault.kind is FaultKind.RAISE or fault.during in MEGATRON_LOOP_PHASES:
            raise ValueError(f"--resihp-inject {fault.spec()}: a {fault.kind.value} during={fault.during} is survived "
                             "on Megatron-LM's loop only (the default: drop --resihp-loop resihp); this loop would not strike it")
    _check_inputs(args)


def _check_inputs(args: argparse.Namespace) -> None:
    """The files the job reads are whole, and every split gets documents: every rank checks them before any
    group or file exists."""
    from megatron.resihp.checkpoint_files import check_checkpoint
    from megatron.resihp.data.datasets import default_data_cache_path, parse_data_path
    from megatron.resihp.data.indexed_files import check_indexed_dataset
    from megatron.resihp.data.splits import check_split_documents

    prefixes: list[str] = []
    if args.data_path:
        prefixes, _ = parse_data_path(args.data_path)
        if args.data_cache_path is None:
            args.data_cache_path = default_data_cache_path()
    if args.load:
        check_checkpoint(args.load)
    if prefixes:
        check_split_documents(args.split, {p: check_indexed_dataset(p) for p in prefixes})


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate; on bad input print the reason and exit with code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        _check_compat_flags(args)
        validate_args(args, world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args
