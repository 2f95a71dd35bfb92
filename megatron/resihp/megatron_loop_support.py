"""What resilience on Megatron-LM's own loop can carry, checked before a job starts.

Responsible for one answer, ``unsupported_flags``: the Megatron flags and ``--resihp-*`` settings of
a job that ``megatron_loop_resilience`` cannot carry through a re-form or a re-plan yet, each with
its reason, so that the job exits 2 naming them instead of running with a request dropped.
"""

from __future__ import annotations

import argparse

from megatron.resihp.megatron_loop_stages import layer_moves_refused, tp_shrink_refused

# Megatron flags (as parsed) whose jobs the fail-stop path cannot yet carry through a re-form, and why.
_UNSUPPORTED = {
    "context_parallel_size": ("--context-parallel-size", "context-parallel groups are not re-formed"),
    "expert_model_parallel_size": ("--expert-model-parallel-size", "expert-parallel groups are not re-formed"),
    "use_megatron_fsdp": ("--use-megatron-fsdp", "sharded parameters are not re-formed"),
    "use_torch_fsdp2": ("--use-torch-fsdp2", "sharded parameters are not re-formed"),
}
# Megatron flags that place ranks otherwise than the launch Layout this loop builds. (Layers may be
# placed by any of Megatron's flags: ``megatron_loop_stages.launch_split`` reads where they went.)
_OTHER_PLACEMENT = {
    "use_tp_pp_dp_mapping": "--use-tp-pp-dp-mapping",
}
# Phases a kill can wait for on this loop: a recovery's re-form and its rendezvous, the world its
# state moves run in once formed (moves), a fail-slow re-plan's rebuilt objects before its state
# moves (replan), a readmission's grown world once its groups are formed,
# this rank's optimizer step, the iteration's log, an evaluation, the ranks' agreement whether
# --exit-duration-in-mins has passed, a save as it begins, once this rank's files are written and
# (on rank 0, which writes it) before the tracker names it (Megatron's save has no rename); under
# --async-save once this rank's save is handed to its writer, and as Megatron finalizes a save at a
# later step's top; the job's end, as ``pretrain()`` returns, and Megatron's set-up, as it builds the data loaders. Under
# the distributed optimizer also once it has updated this rank's parameters, before the update's
# copies go out.
_PHASES = (None, "reform", "rendezvous", "moves", "replan", "readmission", "update", "optimizer", "log", "eval", "exit-check", "save", "save-write",
           "save-tracker", "save-scheduled", "finalize", "shutdown", "setup")
# Megatron flags whose collectives between steps a failure is not survived in yet (with --resihp-enable).
_UNSURVIVED_BETWEEN_STEPS = {
    "check_weight_hash_across_dp_replicas_interval": ("--check-weight-hash-across-dp-replicas-interval",
                                                      "its all-gather of weight hashes and barrier"),
    "log_straggler": ("--log-straggler", "the straggler report's gathers"),
}


def unsupported_flags(args: argparse.Namespace, cfg, layers_per_stage: tuple[int, ...] | None = None) -> list[str]:
    """What this job asks for that resilience on Megatron's loop cannot carry yet, one reason per
    item (empty: the job may run). ``args`` are Megatron's validated arguments, ``cfg`` the
    ``ResiHPConfig`` of its ``--resihp-*`` flags, ``layers_per_stage`` the transformer layers
    megatron-core puts on each pipeline stage (``megatron_loop_stages.launch_split``), when known."""
    found = []
    for dest, (flag, why) in _UNSUPPORTED.items():
        value = getattr(args, dest, None)
        if value is True or (type(value) is int and value > 1):  # a switch that is on, a size above 1
            found.append(f"{flag} ({why})")
    for dest, flag in _OTHER_PLACEMENT.items():
        if getattr(args, dest, None) not in (None, False):
            found.append(f"{flag} (the groups are rebuilt in megatron-core's default rank order)")
    if layers_per_stage is not None and 0 in layers_per_stage:
        found.append(f"a pipeline stage without transformer layers (layers per stage {list(layers_per_stage)}: "
                     f"every stage of a re-planned pipeline holds at least one; place one on each)")
    if cfg.enable and args.use_distributed_optimizer and getattr(args, "optimizer", "adam") != "adam":
        found.append(f"--optimizer {args.optimizer} with --use-distributed-optimizer (the copies that let a dead "
                     f"rank's part of the optimizer state survive carry Adam's state only)")
    if cfg.enable and args.use_distributed_optimizer and getattr(args, "use_precision_aware_optimizer", False):
        found.append("--use-precision-aware-optimizer with --use-distributed-optimizer (the copies of the optimizer's "
                     "parts read the fp32 main parameters Megatron keeps, which this optimizer keeps in its own form)")
    if cfg.enable and getattr(args, "async_save", False) and getattr(args, "async_strategy", "mcore") != "mcore":
        found.append(f"--async-strategy {args.async_strategy} with --async-save (its writer processes are "
                     f"nvidia-resiliency-ext's, which a change of world does not reach yet: pass --async-strategy mcore)")
    for dest, (flag, what) in _UNSURVIVED_BETWEEN_STEPS.items():
        if cfg.enable and getattr(args, dest, None) not in (None, False):
            found.append(f"{flag} ({what} between steps are not survived when a rank fails there)")
    if cfg.device_memory_gb is not None:
        # It sizes the layers a stage may take, the smaller TP degree a stage group may go on at, and,
        # under the distributed optimizer, the share of its state each rank of fewer replicas holds.
        narrower, moves = tp_shrink_refused(args), layer_moves_refused(args)
        kept = "--resihp-enable is off" if not cfg.enable else (
            None if narrower is None or moves is None or args.use_distributed_optimizer
            else f"every replica keeps its launch degree ({narrower}) and layers stay on their stages ({moves})")
        if kept is not None:
            found.append(f"--resihp-device-memory-gb (it sizes the layers a stage may take and the smaller TP degree "
                         f"a stage group that lost ranks may go on at, and this job changes neither: {kept})")
    if getattr(args, "dataloader_type", "single") != "single":
        found.append(f"--dataloader-type {args.dataloader_type} (loaders are rebuilt for the 'single' type only)")
    # Every kind of injected fault runs on this loop. A ``link:`` slowdown slows its pipeline transfers
    # (the hook wraps megatron-core's p2p functions), and the detector names it from the gaps in
    # Megatron's schedule where ranks have devices of their own (``--cpu-device-time-scale`` on a CPU
    # host: ranks sharing cores stretch every transfer, and links are then not judged).
    for fault in cfg.faults:
        if fault.kind.value == "kill" and fault.during not in _PHASES:
            found.append(f"--resihp-inject {fault.spec()} (on this loop a kill can wait for the phases "
                         f"{', '.join(p for p in _PHASES if p)} only)")
        elif fault.during == "save-tracker" and fault.rank != 0:
            found.append(f"--resihp-inject {fault.spec()} (rank 0 alone writes Megatron's tracker file: "
                         f"use rank=0)")
        elif fault.during in ("save-scheduled", "finalize") and not getattr(args, "async_save", False):
            found.append(f"--resihp-inject {fault.spec()} (a phase of asynchronous saves: pass --async-save "
                         f"--use-persistent-ckpt-worker --async-strategy mcore)")
        elif fault.kind.value == "stall" and not getattr(args, "save", None):
            found.append(f"--resihp-inject {fault.spec()} (a stall holds a checkpoint save's writes back, and "
                         f"this job saves none: pass --save DIR --save-interval N)")
        elif fault.kind.value == "slow" and fault.during == "replan" and not (
                cfg.enable and getattr(args, "pipeline_model_parallel_size", 1) > 1):
            found.append(f"--resihp-inject {fault.spec()} (it waits for a re-plan that moves layers between "
                         f"stages: pass --resihp-enable, with --pipeline-model-parallel-size above 1)")
        elif fault.during == "update" and not (cfg.enable and args.use_distributed_optimizer):
            found.append(f"--resihp-inject {fault.spec()} (the update phase is the distributed optimizer's, "
                         f"with --resihp-enable: pass --use-distributed-optimizer)")
    return found
