"""Layer splits between pipeline stages on Megatron-LM's own loop (``--resihp-loop megatron``).

Responsible for building Megatron's own training objects for a split (``build_objects``), and for
two answers about a fail-slow re-plan that moves layers between stages there:

- ``split_config``: the model configuration Megatron's ``get_model`` builds a rank's chunk from
  for a split other than the launch's even one. megatron-core places layers by
  ``pipeline_model_parallel_layout``, and every rank of the world reads the same configuration, so
  on this loop every replica runs one split (the planner's ``stages_alike``).
- ``layer_moves_refused``: why a job's re-plans must keep every layer on its stage, or None.
  Megatron saves what each stage holds: a save in the torch format numbers a stage's layers from
  0, and the distributed optimizer's default ``torch_dist`` format lays its state out by the
  stage's gradient buffer, so a checkpoint saved after layers moved would not load in a stock
  run. A ``torch_dist`` checkpoint addresses every layer by its number in the whole model (with
  the distributed optimizer, under ``--dist-ckpt-optim-fully-reshardable``), and loads whatever
  split saved it.

Megatron's global arguments are never changed: a checkpoint records the launch's even split.
"""

from __future__ import annotations

import argparse


def even_split(args: argparse.Namespace) -> tuple[int, ...]:
    """The launch's layers per stage (``megatron_loop_support`` refuses any other launch split)."""
    pp = args.pipeline_model_parallel_size
    return (args.num_layers // pp,) * pp


def split_config(args: argparse.Namespace, layers_per_stage: tuple[int, ...]):
    """The ``TransformerConfig`` for ``layers_per_stage``, or None for the launch's split (the model
    provider then builds it from the flags, as stock Megatron-LM does)."""
    if tuple(layers_per_stage) == even_split(args):
        return None
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.training.argument_utils import core_transformer_config_from_args

    from megatron.resihp.model_builder import pipeline_layout

    config = core_transformer_config_from_args(args)
    # Set after the configuration checked the flags: they ask for the even split, which this
    # replaces whole (the layout is what megatron-core's layer offsets and counts read first).
    layout = PipelineParallelLayerLayout(pipeline_layout(tuple(layers_per_stage)), args.pipeline_model_parallel_size)
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


def build_objects(model_provider, model_type, args: argparse.Namespace, layers_per_stage: tuple[int, ...]):
    """Megatron's own model chunks, optimizer and LR schedule for ``layers_per_stage`` on the
    installed groups, as a ``model_builder.TrainingObjects``."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_timers
    from megatron.training.training import get_megatron_optimizer_config, get_model, get_optimizer_param_scheduler

    from megatron.resihp.model_builder import TrainingObjects

    chunks = get_model(model_provider, model_type, config=split_config(args, layers_per_stage))
    config, overrides = get_megatron_optimizer_config(args)
    config.timers = get_timers()
    optimizer = get_megatron_optimizer(config, chunks, config_overrides=overrides,
                                       use_gloo_process_groups=args.use_gloo_process_groups)
    return TrainingObjects(get_model_config(chunks[0]), chunks[0], optimizer,
                           get_optimizer_param_scheduler(optimizer), tuple(layers_per_stage))
