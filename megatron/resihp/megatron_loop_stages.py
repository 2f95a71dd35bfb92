"""Replica shapes on Megatron-LM's own loop: layer splits between pipeline stages and TP degrees.

Responsible for building Megatron's own training objects for a split and TP degree
(``build_objects``), for the launch's split as megatron-core places it from the flags
(``launch_split``: even, or uneven through ``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split`` or ``--pipeline-model-parallel-layout``), and
for what a re-plan may change there:

- ``split_config``: the model configuration Megatron's ``get_model`` builds a rank's chunk from
  for a split other than the launch's (megatron-core places layers by
  ``pipeline_model_parallel_layout``); each rank builds its replica's split. Under the interleaved
  schedule a stage's layers sit in its model chunks; a split's chunks are sized from the launch's
  (``resihp_ext.interleaved_split.chunk_layers``), so a layer moves across the border of two
  chunks next to each other in megatron-core's order.
- ``own_splits_refused``: why a job's replicas must keep one split between them (the planner's
  ``stages_alike``), or None: then each replica may take its own (``ranks_fixed``), and where
  replicas differ their gradients are summed layer by layer (``layer_sync.LayoutGradSync``) in
  place of megatron-core's DDP, which sums equal gradient buffers.
- ``tp_shrink_refused``: why a job's fail-stop plans keep every replica at the launch's TP degree,
  or None: then a stage group that lost ranks may run its replica at a smaller degree
  (``split_config`` sets it), its gradients summed by the layer-wise sync; where replicas must
  stay alike (``own_splits_refused``: the distributed optimizer), every replica at once.
- ``layer_moves_refused``: why a job's re-plans must keep every layer on its stage, or None.
  Megatron saves what each stage holds: a save in the torch format numbers a stage's layers from
  0, and the distributed optimizer's default ``torch_dist`` format lays its state out by the
  stage's gradient buffer, so a checkpoint saved after layers moved would not load in a stock
  run. A ``torch_dist`` checkpoint addresses every layer by its number in the whole model (with
  the distributed optimizer, under ``--dist-ckpt-optim-fully-reshardable``), and loads whatever
  split saved it.

Megatron's global arguments are never changed: a checkpoint records the launch's split and degree.
"""

from __future__ import annotations

import argparse

from resihp_ext.schedule import Interleaving


def launch_split(args: argparse.Namespace) -> tuple[int, ...]:
    """The transformer layers of each pipeline stage as megatron-core builds them from the flags.

    Raises:
        AssertionError or ValueError: megatron-core's own, for flags it cannot place layers by.
    """
    from megatron.training.argument_utils import core_transformer_config_from_args

    return tuple(map(sum, _chunk_counts(core_transformer_config_from_args(args), args.pipeline_model_parallel_size)))


def interleaving(args: argparse.Namespace) -> Interleaving:
    """The job's pipeline schedule as the detector and the planner read it: its model chunks per
    stage (megatron-core's group size is its default, the pipeline's size: Megatron-LM's loop sets
    no other)."""
    return Interleaving(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


def _virtual_stages(config) -> range | tuple[None]:
    """The virtual stages of every pipeline stage (the model chunks of each rank), as megatron-core's
    layer-placing functions take them: None without the interleaved schedule."""
    vp = config.virtual_pipeline_model_parallel_size
    return (None,) if vp is None else range(vp)


def _chunk_counts(config, pp: int) -> tuple[tuple[int, ...], ...]:
    """The transformer layers of each model chunk of each of the ``pp`` stages as megatron-core
    builds them from ``config`` (one chunk per stage without the interleaved schedule)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if config.pipeline_model_parallel_layout is not None:  # read per stage, not from this rank's groups
        stages = config.pipeline_model_parallel_layout.layout
        return tuple(tuple(chunk.count(LayerType.decoder) for chunk in stages[p]) for p in range(pp))
    return tuple(tuple(get_num_layers_to_build(config, vp_stage=v, pp_rank=p) for v in _virtual_stages(config))
                 for p in range(pp))


def launch_chunks(args: argparse.Namespace) -> tuple[tuple[int, ...], ...] | None:
    """Under the interleaved schedule, the transformer layers of each model chunk of each stage as
    megatron-core builds them from the flags (``resihp_ext.interleaved_split``); None without it."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if config.virtual_pipeline_model_parallel_size is None:
        return None
    return _chunk_counts(config, args.pipeline_model_parallel_size)


def split_config(args: argparse.Namespace, layers_per_stage: tuple[int, ...], tp_degree: int | None = None):
    """The ``TransformerConfig`` for ``layers_per_stage`` at ``tp_degree`` (None: the launch's), or
    None for the launch's split and degree (the model provider then builds it from the flags, as
    stock Megatron-LM does)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.training.argument_utils import core_transformer_config_from_args

    from resihp_ext.interleaved_split import chunk_layers

    from megatron.resihp.training_objects import pipeline_layout

    config = core_transformer_config_from_args(args)
    launch = _chunk_counts(config, args.pipeline_model_parallel_size)
    degree = args.tensor_model_parallel_size if tp_degree is None else tp_degree
    moved = tuple(layers_per_stage) != tuple(map(sum, launch))
    if not moved and degree == args.tensor_model_parallel_size:
        return None
    if degree != args.tensor_model_parallel_size:
        # A replica at a smaller TP degree than the launch's (a group that lost ranks): megatron-core
        # sizes each shard by its TP group, which the installed layout gives; its configuration
        # checks read the degree, and sequence parallelism needs a TP group of two or more.
        config.tensor_model_parallel_size = degree
        config.sequence_parallel = config.sequence_parallel and degree > 1
    if not moved:
        return config
    # Set after the configuration checked the flags: they ask for the launch's split, which this
    # replaces whole (the layout is what megatron-core's layer offsets and counts read first). Under
    # the interleaved schedule the chunks are sized from the launch's, as the Layout's items are.
    interleaved = config.virtual_pipeline_model_parallel_size is not None
    chunks = chunk_layers(launch, tuple(layers_per_stage)) if interleaved else None
    layout = PipelineParallelLayerLayout(pipeline_layout(tuple(layers_per_stage), chunks),
                                         args.pipeline_model_parallel_size)
    layout.validate_layer_layout(num_layers=args.num_layers, mtp_num_layers=config.mtp_num_layers)
    config.pipeline_model_parallel_layout = layout
    return config


def layer_moves_refused(args: argparse.Namespace) -> str | None:
    """Why this job's fail-slow re-plans keep every layer on its stage (None: layers may move)."""
    if args.pipeline_model_parallel_size == 1:
        return "one pipeline stage"
    if args.save is None:
        return None
    if args.ckpt_format != "torch_dist":
        return (f"--ckpt-format {args.ckpt_format} saves each stage's layers numbered from 0, so a checkpoint "
                f"saved after layers moved would not load in a stock run (--ckpt-format torch_dist numbers them "
                f"in the whole model)")
    if args.use_distributed_optimizer and not getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        return ("the distributed optimizer's torch_dist state is laid out by each stage's gradient buffer "
                "(--dist-ckpt-optim-fully-reshardable lays it out by parameter, whatever the split)")
    return None


def own_splits_refused(args: argparse.Namespace) -> str | None:
    """Why this job's replicas must share one layer split when layers move (None: each replica may
    take its own). The layer-wise gradient sync replaces megatron-core's whole data-parallel sync
    for replicas that differ; what it does not carry keeps them alike."""
    if args.use_distributed_optimizer:
        return ("--use-distributed-optimizer splits each stage's optimizer state over the replicas by their "
                "gradient buffers, which must then hold the same layers")
    return _synced_by_megatron_alone(args)


def _synced_by_megatron_alone(args: argparse.Namespace) -> str | None:
    """Why some gradients of this job are summed by megatron-core alone, never layer by layer."""
    if getattr(args, "num_experts", None):
        return "--num-experts: expert and router gradients are synced by megatron-core alone"
    if getattr(args, "mtp_num_layers", None):
        return "--mtp-num-layers: multi-token prediction layers are synced by megatron-core alone"
    return None


def tp_shrink_refused(args: argparse.Namespace) -> str | None:
    """Why this job's fail-stop plans keep every replica at the launch's TP degree (None: a stage
    group that lost ranks may go on at a smaller degree beside the whole replicas, or, where the
    replicas must stay alike (``own_splits_refused``), every replica at one smaller degree). A save
    must load in a stock run at the launch's degree."""
    if args.tensor_model_parallel_size == 1:
        return "TP 1"
    unsynced = _synced_by_megatron_alone(args)
    if unsynced is not None:
        return unsynced
    if args.save is not None and args.ckpt_format != "torch_dist":
        return (f"--ckpt-format {args.ckpt_format} saves each TP shard as the rank that holds it, so a save from a "
                f"smaller-TP replica would not load at the launch's degree (--ckpt-format torch_dist reshards)")
    if args.save is not None and args.use_distributed_optimizer and \
            not getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        return ("the distributed optimizer's torch_dist state is laid out by each stage's gradient buffer, so a save "
                "at a smaller TP degree would not load at the launch's (--dist-ckpt-optim-fully-reshardable lays "
                "it out by parameter)")
    return None


def build_objects(model_provider, model_type, args: argparse.Namespace, layers_per_stage: tuple[int, ...],
                  ddp_syncs: bool = True, tp_degree: int | None = None):
    """Megatron's own model chunks, optimizer and LR schedule for ``layers_per_stage`` at
    ``tp_degree`` (None: the launch's) on the installed groups, as a
    ``model_builder.TrainingObjects``. Without ``ddp_syncs`` (replicas that differ, whose gradients
    another sync sums) the chunks' DDP never starts its own sync: no ``--overlap-grad-reduce``
    during the backward pass."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_timers
    from megatron.training.training import get_megatron_optimizer_config, get_model, get_optimizer_param_scheduler

    from megatron.resihp.training_objects import TrainingObjects

    overlap = args.overlap_grad_reduce
    args.overlap_grad_reduce = overlap and ddp_syncs  # what get_model configures DDP from
    try:
        chunks = get_model(model_provider, model_type, config=split_config(args, layers_per_stage, tp_degree))
    finally:
        args.overlap_grad_reduce = overlap
    config, overrides = get_megatron_optimizer_config(args)
    config.timers = get_timers()
    optimizer = get_megatron_optimizer(config, chunks, config_overrides=overrides,
                                       use_gloo_process_groups=args.use_gloo_process_groups)
    return TrainingObjects(get_model_config(chunks[0]), tuple(chunks), optimizer,
                           _scheduler(get_optimizer_param_scheduler, optimizer, args), tuple(layers_per_stage))


def _scheduler(build, optimizer, args: argparse.Namespace):
    """Megatron's LR schedule for ``optimizer``, asked for as the launch asked for it. Under
    ``--train-samples`` Megatron's builder sets ``train_iters`` on its first call, so a second call
    would take its iteration branch and count warm-up and decay in iterations that are not given
    (0 warm-up steps against the launch's ``--lr-warmup-samples``)."""
    if not args.train_samples:
        return build(optimizer)
    train_iters, args.train_iters = args.train_iters, None
    try:
        return build(optimizer)  # sets train_iters from the samples again, as at launch
    finally:
        args.train_iters = train_iters
