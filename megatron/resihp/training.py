"""pretrain(): initialise, build, and run the training loop with ResiHP's hooks.

Responsible for the order of things in a run (Megatron's ``pretrain`` shape): start-up, model and
optimizer, data, the iteration loop with logging, evaluation and checkpoints. Detection and
adaptation plug in through ``ResilienceHooks`` (``megatron/resihp/resilience.py``) so that a run
without ``--resihp-*`` behaves like stock Megatron.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.resihp import checkpointing, garbage_collection, heartbeat_beacon, resilient_save
from megatron.resihp.data_samplers import GlobalBatchSampler, even_quotas, microbatches
from megatron.resihp.initialize import initialize_distributed, set_random_seed
from megatron.resihp.logging_utils import EventLog, TensorBoard, exit_with_error, iteration_line, log_line
from megatron.resihp.model_builder import build_training_objects
from megatron.resihp.resilience import StopTraining
from megatron.resihp.run_state import leave_process
from megatron.resihp.schedules import RECORDER, install_hooks, train_step, uninstall_hooks
from megatron.resihp.standby import StandingBy


def _is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _reduce_loss(loss_sum: float, num_tokens: int) -> tuple[float, int]:
    """Sum loss and tokens over the whole job: each replica's last stage, TP rank 0, counts once.

    Over the world rather than a DP group, because after a re-plan replicas may differ and a DP
    group then no longer spans every replica.
    """
    counts = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    totals = torch.tensor([loss_sum, float(num_tokens)] if counts else [0.0, 0.0], dtype=torch.float64)
    dist.all_reduce(totals)
    return float(totals[0]), int(totals[1])


def _leave(stop: StopTraining, iteration: int, events: EventLog, board: TensorBoard) -> None:
    """This process leaves the job (spare, or saved for a restart) with the stop's exit code."""
    log_line(f" resihp: rank leaving at iteration {iteration}: {stop}")
    events.emit("exit", iteration, exit_code=stop.exit_code, reason=str(stop))
    events.close()
    board.close()
    leave_process(stop.exit_code)


def _save(args, iteration: int, consumed_samples: int, objects, quotas, resilience, events: EventLog,
          board: TensorBoard) -> tuple:
    """Save ``iteration`` through a rank's failure (``resilient_save``); this process leaves when
    the recovery falls back. Returns (objects, quotas), rebuilt if it recovered.

    Raises:
        StandingBy: the recovery left this rank out, and it stands by.
    """
    try:
        return resilient_save.save(args, iteration, consumed_samples, objects, quotas, resilience, events)
    except StandingBy:
        raise
    except StopTraining as stop:
        _leave(stop, iteration, events, board)


def _stand_by(stop: StandingBy, args, train_ds, resilience, iteration: int, events: EventLog,
              board: TensorBoard) -> tuple:
    """A plan left this rank out: stand by until a later change takes it back, or leave when the
    job ends. Returns (objects, quotas, sampler, iteration before the one it rejoins at)."""
    log_line(f" resihp: {stop}")
    try:
        rejoined = resilience.stand_by()
    except StopTraining as end:
        _leave(end, iteration, events, board)
    sampler = GlobalBatchSampler(len(train_ds), rejoined.consumed_samples, args.micro_batch_size,
                                 args.global_batch_size)
    return rejoined.objects, rejoined.quotas, sampler, rejoined.iteration - 1


def schedule_shape(args) -> tuple[int, int]:
    """(seq_length, micro_batch_size) of the activations the pipeline schedule sends between
    stages: a thd micro-batch is one sequence of micro_batch_size * seq_length tokens."""
    if args.reset_attention_mask and getattr(args, "packed_seq_layout", "sbhd") == "thd":
        return args.micro_batch_size * args.seq_length, 1
    return args.seq_length, args.micro_batch_size


def evaluate(args, forward_step_func, dataset, objects, iteration: int, num_replicas: int, dp_rank: int) -> float | None:
    """Mean per-token validation loss over --eval-iters global batches (forward only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sampler = GlobalBatchSampler(len(dataset), 0, args.micro_batch_size, args.global_batch_size)
    quotas = even_quotas(sampler.num_microbatches, num_replicas)
    objects.model.eval()
    loss_sum, num_tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            if sampler.consumed_samples + args.global_batch_size > len(dataset):
                break
            batches = microbatches(dataset, sampler.microbatch_indices(quotas, dp_rank))
            sampler.advance()
            seq_length, micro_batch_size = schedule_shape(args)
            out = get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=iter(batches), model=[objects.model],
                num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
                decoder_seq_length=seq_length, forward_only=True,
            )
            for item in out or []:
                loss_sum += float(item["lm loss"][0])
                num_tokens += int(item["lm loss"][1])
    objects.model.train()
    loss_sum, num_tokens = _reduce_loss(loss_sum, num_tokens)
    if not num_tokens:
        return None
    loss = loss_sum / num_tokens
    if _is_last_rank():
        log_line(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | "
                 f"lm loss PPL: {math.exp(min(loss, 20)):.6E} |")
    return loss


def _alternate_detection() -> tuple[int, int] | None:
    """``RESIHP_ALTERNATE_DETECTION=PERIOD:PHASE``, for measuring what detection costs: the op
    hooks and the per-iteration detection run only on iterations ``i`` with ``i % PERIOD == PHASE``,
    and each iteration event carries ``detecting``, ``step_s`` (the iteration's time including
    detection), ``probe_rounds`` (probe rounds its detection step ran), and over the same span
    ``cpu_s`` (the process's CPU time), ``gc_s`` (the cyclic collector's pauses) and ``gc_full``
    (its full collections), which tell host work and collections from waiting on the device. Two
    runs of different phases time iterations both ways. Returns ``(period, phase)``, or None when
    unset."""
    value = os.environ.get("RESIHP_ALTERNATE_DETECTION")
    if not value:
        return None
    period, _, phase = value.partition(":")
    if period.isdigit() and phase.isdigit() and 0 <= int(phase) < int(period):
        return int(period), int(phase)
    exit_with_error(f"RESIHP_ALTERNATE_DETECTION must be PERIOD:PHASE with 0 <= PHASE < PERIOD (4:0 detects on "
                    f"iterations 4, 8, ...), got {value!r}")


def pretrain(
    args: argparse.Namespace,
    datasets_provider: Callable[[argparse.Namespace, tuple[int, int, int]], tuple],
    forward_step_func: Callable,
    resilience_factory: Callable | None = None,
) -> dict:
    """Run training to ``--train-iters``. Returns a summary dict (last loss, iterations run)."""
    alternate = _alternate_detection()
    pauses = garbage_collection.PauseClock() if alternate is not None else None
    if args.resihp.detection_on:
        # Forked before anything starts a thread (process groups do): see heartbeat_beacon.
        heartbeat_beacon.start_beacon(args.resihp.heartbeat_interval_s,
                                      stopped_after_s=args.resihp.heartbeat_timeout_s)
    initialize_distributed(args)
    events = EventLog(args.resihp.event_log, args.rank)
    set_random_seed(args.seed)
    objects = build_training_objects(args, args.layers_per_stage)
    if not os.environ.get("RESIHP_DISABLE_OP_HOOKS"):  # only for measuring the hooks' own cost
        install_hooks()
    RECORDER.use_device("cuda" if args.device == "cuda" else "cpu", args.cpu_device_time_scale)
    iteration, consumed = checkpointing.load_checkpoint(args, objects) if args.load else (0, 0)
    if iteration and _is_last_rank():
        log_line(f" loaded checkpoint from {args.load} at iteration {iteration} (consumed samples {consumed})")

    num_evals = args.train_iters // args.eval_interval + 1 if args.eval_iters else 0
    train_ds, valid_ds, _ = datasets_provider(
        args, (args.train_iters * args.global_batch_size, num_evals * args.eval_iters * args.global_batch_size, 0)
    )
    sampler = GlobalBatchSampler(len(train_ds), consumed, args.micro_batch_size, args.global_batch_size)
    num_replicas = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    quotas = even_quotas(sampler.num_microbatches, num_replicas)
    resilience = resilience_factory(args, events, objects) if resilience_factory else None
    board = TensorBoard(args.tensorboard_dir if _is_last_rank() else None)
    if _is_last_rank():
        log_line(
            f" training: world {dist.get_world_size()} = TP {args.tensor_model_parallel_size} x PP "
            f"{args.pipeline_model_parallel_size} x DP {num_replicas}, layers per stage {list(args.layers_per_stage)}, "
            f"device {args.device}, {sampler.num_microbatches} micro-batches per iteration"
        )
    events.emit("start", iteration, world_size=dist.get_world_size(), layers_per_stage=list(args.layers_per_stage))

    garbage_collection.start(args)
    settled = objects
    skipped = nan = 0
    last_loss = None
    tokens_per_iter = args.global_batch_size * args.seq_length
    interval_start, interval_iters = time.perf_counter(), 0
    interval_losses: list[float] = []  # finite losses since the last line, averaged on it as Megatron does
    while iteration < args.train_iters:
        iteration += 1
        if resilience is not None:
            objects, quotas = resilience.before_iteration(iteration, objects, quotas)
            dp_rank = resilience.replica_index
        if objects is not settled:  # rebuilt by an adaptation: collect the old ones now, on every rank
            garbage_collection.settle()
            settled = objects
        # Measuring detection's cost: on alternate iterations hooks and detection are off.
        detecting = alternate is None or iteration % alternate[0] == alternate[1]
        if alternate is not None:
            (install_hooks if detecting else uninstall_hooks)()
        start, start_cpu_s = time.perf_counter(), time.process_time()
        start_pauses = pauses.read() if pauses is not None else None
        stepped = reduced = advanced = False
        try:
            if resilience is not None:
                objects, quotas = resilience.check_standbys(iteration, objects, quotas, sampler.consumed_samples)
                dp_rank, num_replicas = resilience.replica_index, parallel_state.get_data_parallel_world_size()
            batches = microbatches(train_ds, sampler.microbatch_indices(quotas, dp_rank))
            result = train_step(
                forward_step_func, iter(batches), objects, quotas[dp_rank],
                *schedule_shape(args), args.global_batch_size,
            )
            stepped = True
            loss_sum, num_tokens = _reduce_loss(result.loss_sum, result.num_tokens)
            reduced = True
            elapsed_s = time.perf_counter() - start
            if resilience is not None and detecting:
                try:
                    objects, quotas = resilience.after_iteration(iteration, elapsed_s, result, objects, quotas)
                except StandingBy as stop:  # left out by a re-plan: back when called, at the job's iteration
                    objects, quotas, sampler, iteration = _stand_by(stop, args, train_ds, resilience, iteration,
                                                                    events, board)
                    dp_rank, num_replicas = resilience.replica_index, parallel_state.get_data_parallel_world_size()
                    continue
                except StopTraining as stop:  # this rank became a spare of a re-plan
                    _leave(stop, iteration, events, board)
                dp_rank = resilience.replica_index
        except RuntimeError as error:  # torch.distributed reports a dead or stuck peer this way
            if resilience is None or not resilience.can_recover:
                raise
            if stepped:
                # Every rank's optimizer step needed its DP group's all-reduce, which the failed rank
                # joined: all ranks stepped, so this iteration is done and is not redone.
                sampler.advance()
                advanced = True
            try:
                objects, quotas = resilience.recover(iteration, error, objects, sampler.consumed_samples, quotas,
                                                     completed=iteration if stepped else None)
            except StandingBy as stop:  # a spare of the recovery: back at a later failure, at the job's iteration
                objects, quotas, sampler, iteration = _stand_by(stop, args, train_ds, resilience, iteration, events,
                                                                board)
                dp_rank, num_replicas = resilience.replica_index, parallel_state.get_data_parallel_world_size()
                continue
            except StopTraining as stop:
                _leave(stop, iteration, events, board)
            dp_rank, num_replicas = resilience.replica_index, parallel_state.get_data_parallel_world_size()
            if not stepped:
                iteration -= 1  # the same global batch again, on the new layout
                continue
            if not reduced:
                continue
            # The failure surfaced after the step and its loss were done (during detection or a
            # re-plan): the iteration is recorded like any other, by the new world's last rank.
        if not advanced:
            sampler.advance()
        skipped += result.skipped
        loss = loss_sum / max(num_tokens, 1)
        nan += not math.isfinite(loss)
        last_loss = loss
        interval_iters += 1
        if math.isfinite(loss):
            interval_losses.append(loss)
        if resilience is not None:
            resilience.inject(iteration, "log")
        if _is_last_rank():
            lr = objects.optimizer.param_groups[0]["lr"]
            measured = {}
            if alternate is not None:
                paused_s, full_collections = pauses.read()
                measured = {
                    "detecting": detecting, "step_s": time.perf_counter() - start,
                    "cpu_s": time.process_time() - start_cpu_s,
                    "gc_s": paused_s - start_pauses[0], "gc_full": full_collections - start_pauses[1],
                    "probe_rounds": resilience.probe_rounds_run() if resilience is not None and detecting else 0}
            events.emit("iteration", iteration, lm_loss=loss, grad_norm=result.grad_norm, elapsed_s=elapsed_s,
                        consumed_samples=sampler.consumed_samples, lr=lr, **measured)
            board.scalars(iteration, {"lm loss": loss, "learning-rate": lr, "grad-norm": result.grad_norm,
                                      "iteration-time": elapsed_s})
            if iteration % args.log_interval == 0:
                per_iter = (time.perf_counter() - interval_start) / interval_iters
                log_line(iteration_line(
                    iteration=iteration, train_iters=args.train_iters, consumed_samples=sampler.consumed_samples,
                    elapsed_ms=per_iter * 1000, lr=lr, global_batch_size=args.global_batch_size,
                    lm_loss=sum(interval_losses) / len(interval_losses) if interval_losses else loss,
                    grad_norm=result.grad_norm, tokens_per_s=tokens_per_iter / per_iter, skipped=skipped, nan=nan,
                    loss_scale=float(objects.optimizer.get_loss_scale()),
                ))
        if iteration % args.log_interval == 0:
            interval_start, interval_iters = time.perf_counter(), 0
            interval_losses = []
            skipped = nan = 0  # per interval, as Megatron counts them
        garbage_collection.after_iteration(args, iteration)
        if args.eval_iters and valid_ds is not None and iteration % args.eval_interval == 0:
            evaluate(args, forward_step_func, valid_ds, objects, iteration, num_replicas, dp_rank)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            try:
                objects, quotas = _save(args, iteration, sampler.consumed_samples, objects, quotas, resilience,
                                        events, board)
            except StandingBy as stop:  # a spare of a recovery during the save
                objects, quotas, sampler, iteration = _stand_by(stop, args, train_ds, resilience, iteration, events,
                                                                board)
            if resilience is not None:
                dp_rank, num_replicas = resilience.replica_index, parallel_state.get_data_parallel_world_size()
    if args.save and not (args.save_interval and iteration % args.save_interval == 0):
        try:
            objects, quotas = _save(args, iteration, sampler.consumed_samples, objects, quotas, resilience, events,
                                    board)
        except StandingBy as stop:  # training is over: nothing will call it back
            _leave(stop, iteration, events, board)
    garbage_collection.finish(args)
    if pauses is not None:
        pauses.stop()
    events.emit("finish", iteration, lm_loss=last_loss)
    if resilience is not None:
        resilience.close()
    board.close()
    resilient_save.leave_together(args, resilient_save.phase_faults(resilience, iteration))
    events.close()
    return {"iteration": iteration, "lm_loss": last_loss, "consumed_samples": sampler.consumed_samples}
