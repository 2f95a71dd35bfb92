"""The fail-stop driver: after a collective failed, decide which layout change the survivors make.

Responsible for the decision half of an in-place fail-stop recovery, at the iteration that
failed: wait for the heartbeats to name who failed, agree on one ``SurvivorPlan``
(``recovery.agree_on_plan``: the lowest survivor decides), and ask the life cycle
(``reconfigure.apply``) for the SHRINK change it describes; when a member fails while the
survivors re-form, plan again without it. Surviving ranks the plan leaves out (spares) stand by
(``standby.py``) when standbys are on, and a later recovery that redoes its iteration calls them:
the plan may give them the places of dead ranks, and they join the change, receiving their state
from live holders, so a job survives as many failures as it has ranks to hold every shard. With
no in-place plan, survivors save a checkpoint assembled from whoever holds each shard (or point
to the last periodic one) and leave. It never builds a group, a model or a world itself.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import sys
import time
import traceback

import torch.distributed as dist

from megatron.resihp import recovery
from megatron.resihp.checkpoint_files import latest_iteration
from megatron.resihp.data_samplers import even_quotas
from megatron.resihp.failure_origin import PeerFailed, is_peer_failure
from megatron.resihp.heartbeat import STORE_LOSS_TIMEOUTS, STORE_OP_TIMEOUT_S
from megatron.resihp.logging_utils import log_line, rank_name, ranks_name, world_numbered
from megatron.resihp.optimizer_parts import OptimizerPartsStale
from megatron.resihp.reconfigure import ChangeFailed, LayoutChange, World, apply
from megatron.resihp.reshard import adam_template_of, loss_scale_state
from megatron.resihp.run_state import StopTraining
from megatron.resihp.standby_keys import mark_job_done
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.survivors import SurvivorPlan, continuing_layout

# Exit code of a survivor that saved a checkpoint because no in-place plan existed.
EXIT_NEEDS_RESTART = 3
# Exit code of a rank that raised an error of its own and left, so that the others could go on
# without it (the launcher counts it as a failed rank, like one killed by a signal).
EXIT_RANK_FAILED = 4
# Worlds a recovery tries to form before giving up: each failed attempt means another rank left
# while the survivors were re-forming, and each retry plans without it.
REFORM_ATTEMPTS = 3


def resume_command(argv: list[str], nproc: int, checkpoint_root: str | None) -> str:
    """The launch that resumes this job of ``nproc`` ranks from ``checkpoint_root`` (None: from
    scratch), through the launcher it ran under: same flags, minus any earlier ``--load`` and any
    injected faults (those were tests of this run, not part of the job)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--load", "--resihp-inject"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    load = [] if checkpoint_root is None else ["--load", checkpoint_root]
    return shlex.join([*_launch(nproc), *kept, *load])


def _launch(nproc: int) -> list[str]:
    """The command that starts ``nproc`` ranks as this job's were started: under Slurm
    (``scripts/slurm/slurm_rank.py`` says so in ``RESIHP_LAUNCHER``) a batch job of its batch script
    on as many nodes, else the local launcher (torchrun's ranks included: it hosts the store in
    a process that outlives none of them)."""
    if os.environ.get("RESIHP_LAUNCHER") == "slurm":
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        tasks = f"--ntasks-per-node={nproc // nodes}" if nproc % nodes == 0 else f"--ntasks={nproc}"
        return ["sbatch", f"--nodes={nodes}", tasks, "scripts/slurm/pretrain_resilient.sbatch"]
    return ["python", "scripts/launch_local.py", "--nproc-per-node", str(nproc)]


class FailStopRecovery:
    """Decides the survivors' change; ``host`` is the process's ``ResilienceHooks`` (its run state,
    heartbeats, store and event log)."""

    def __init__(self, host):
        self.host = host
        self._unfailed_at: int | None = None  # the iteration last re-formed with no rank failed

    def _unfailed(self, iteration: int, old_rank: int, error: Exception, everyone_here: bool) -> None:
        """A collective failed and the heartbeats name no failed or hung rank: a peer only outlasted
        ``--resihp-collective-timeout-s``, e.g. compiling a ``torch.compile`` fusion in its first
        iteration (``--cross-entropy-loss-fusion`` on the last stage) while the others waited. Once
        every rank of the world has reached its recovery alive (``everyone_here``), the world
        re-forms as it was and redoes the iteration, whose compiled code is now cached; a second
        such failure at the same iteration, or a rank that never arrives, stops this rank with the
        error and the flag to raise."""
        cfg, run = self.host.cfg, self.host.run
        who = rank_name(old_rank, run.identity)
        if everyone_here and self._unfailed_at != iteration:
            self._unfailed_at = iteration
            log_line(f" resihp: {who}: iteration {iteration}: a collective outlasted --resihp-collective-timeout-s "
                     f"({cfg.collective_timeout_s:g} s) while every rank stayed alive (a peer was slow, e.g. "
                     f"compiling a torch.compile fusion in its first iteration); the world re-forms as it was "
                     f"and redoes the iteration")
            return
        log_line(f" resihp: {who}: iteration {iteration}: a collective failed and the heartbeats name no failed or "
                 f"hung rank{', again at this iteration after the world re-formed' if everyone_here else ''}, so "
                 f"there is nothing to recover from and this rank stops; if a peer was only slow, raise "
                 f"--resihp-collective-timeout-s ({cfg.collective_timeout_s:g} s) above its longest step")
        raise error

    def recover(self, iteration: int, error: Exception, consumed_samples: int, completed: int | None = None):
        """A collective failed: find who died, agree on a plan, continue in place or leave.

        Ranks of this world outside the layout are leaving it (the joiners of a readmission that
        failed before every member had its state): they are planned without, like the dead. With
        no world at all (a readmission whose rendezvous failed), the layout's ranks re-form.
        The running quotas are kept when no rank of the layout failed.

        ``completed``: the iterations finished when the failure surfaced, which a fallback checkpoint
        saves with ``consumed_samples``: ``iteration - 1`` (the default) when ``iteration`` is
        redone, ``iteration`` when it had stepped (a failure during detection or a checkpoint save).

        Returns:
            The new ``RunState`` (committed on ``host``), to redo ``iteration`` on (or go on after it).

        Raises:
            StopTraining: this process is a spare (``StandingBy`` when it stands by), or no in-place
                plan exists (after saving), or ``error`` was this rank's own (it leaves:
                ``EXIT_RANK_FAILED``).
            The original error, when the heartbeats name no failed rank and the world cannot
                re-form as it was (``_unfailed``).
        """
        host, cfg = self.host, self.host.cfg
        start = time.perf_counter()
        run = host.run
        old_rank = run.rank  # also when a grown world's rendezvous failed and no world is left
        resume_at = iteration if completed is None else completed + 1  # the first iteration not done
        if self._store_gone():
            self.leave_without_store(iteration, resume_at)
        # An error that torch.distributed did not raise is this rank's own, unless the heartbeats
        # name a failed peer soon (a dead peer is named within a heartbeat timeout): a rank that
        # left on a healthy peer's error would cost the job a replica.
        if (dist.is_initialized() and not is_peer_failure(error)
                and not recovery.await_failed_ranks(host.monitor, wait_s=cfg.heartbeat_timeout_s)):
            self._leave_failed(iteration, error)
        log_line(f" resihp: {rank_name(old_rank, run.identity)}: iteration {iteration} failed: "
                 f"{str(error).splitlines()[0][:160]}")
        host.monitor.mark_recovering()
        if dist.is_initialized():
            # This rank has left its collective; peers still blocked on it must leave theirs too.
            # Shutting its connections ends only collectives this rank belongs to, which cannot
            # finish without it; what it sent before still arrives first.
            host.abandon_world()
        failed = left = frozenset()  # left: spares of an earlier attempt's plan, gone or about to go
        stood_aside = frozenset()  # survivors an update behind, planned out as spares (``_behind``)
        # Spares come back at an iteration's start: only a recovery that redoes its iteration calls them.
        take_back = host.standby_on and completed is None
        has_world = dist.is_initialized()
        outside = frozenset(range(dist.get_world_size()) if has_world else ()) - frozenset(run.layout.world_ranks)
        for attempt in range(1, REFORM_ATTEMPTS + 1):
            # A hung peer is only named once its stall passes the hang timeout. With ranks leaving
            # anyway, or no world left, a re-form is due whoever failed, and one that meets a hung
            # rank fails and comes back here to wait for its name.
            leaving = attempt == 1 and (bool(outside) or not has_world)
            wait_s = (2 * cfg.heartbeat_timeout_s if leaving
                      else cfg.effective_hang_timeout_s + 4 * cfg.heartbeat_timeout_s)
            # On a first attempt, the world's ranks all in their recovery alive ends the wait: nobody failed.
            world = frozenset(run.layout.world_ranks) if attempt == 1 and has_world else None
            named = recovery.await_failed_ranks(host.monitor, wait_s=wait_s, settle_s=2 * cfg.heartbeat_interval_s,
                                                recovering=world) - outside
            if host.monitor.store_lost:
                self.leave_without_store(iteration, resume_at)
            if not named - failed and not leaving:
                self._unfailed(iteration, old_rank, error,
                               everyone_here=world is not None and world <= host.monitor.recovering_ranks)
            run = run.replace(generation=run.generation + 1)
            host.run = run
            answered: list[int] = []  # launch ranks of the spares that answered the leader's call

            # An earlier attempt's spare is called only once it stands by (its heartbeat says it left
            # cleanly): one that died, or that is still in this recovery (the attempt failed before it
            # left), would not answer, and the plan would wait for it in vain.
            standing = (left & host.monitor.exited_ranks) - named

            def standbys(run=run, left=standing, answered=answered) -> tuple[int, ...]:
                if take_back:
                    calling = host.readmission.spares | {run.identity[r] for r in left}
                    answered.extend(host.readmission.call_spares(run.generation, calling))
                return tuple(range(len(run.identity), len(run.identity) + len(answered)))

            behind = self._behind(run, old_rank, resume_at, named | failed | left)
            stood_aside |= behind
            plan, failed, published = recovery.agree_on_plan(
                host.store, run.generation, old_rank, run.layout, named | failed | left | behind, self._preferred_plan,
                wait_s=3 * cfg.collective_timeout_s, move_state=host.recovery_keeps_shape,
                keep_tp=host.recovery_keeps_shape and not host.shrinks_tp, tp_descending=host.shrinks_tp,
                replica_counts=host.replica_counts, hw=host.calibrated_hardware(),
                health=host.known_health, sharded_optimizer=host.sharded_optimizer,
                part_copies=run.part_copies is not None, uniform_tp=host.shrinks_every_replica,
                standbys=standbys, shared=lambda plan, run=run, aside=left | behind, answered=answered: self._shared(
                    run, plan, answered, aside, iteration, consumed_samples))
            identity = tuple(published["identity"])  # this world's launch ranks, then the spares called
            taken = [identity[r] for r in plan.joiners]
            host.planned_out = set(run.layout.world_ranks) - set(plan.new_rank) | outside
            leader = old_rank == min(set(run.layout.world_ranks) - failed)
            if leader:
                # A hung rank among them fences itself; the spares of an earlier attempt are not
                # hung but left, and may be standing by.
                host.monitor.evict(failed - left - behind)
                host.events.emit("plan", iteration, action=plan.action, reason=plan.reason, executed=plan.to_dict(),
                                 preferred=published["preferred"], attempt=attempt,
                                 compute_costs=host.costs_record(), taken_back_launch_ranks=taken)
            # The planner numbers ranks as this world does; the failed are named by launch rank too.
            after = f" after {ranks_name(failed - behind, identity)} failed" if failed - behind else ""
            log_line(f" resihp: plan ({plan.action}){after}: {world_numbered(plan.reason, identity)}")
            if plan.action != "adapt":
                host.monitor.stop()
                self._fallback_checkpoint(old_rank, iteration, plan, consumed_samples, failed,
                                          iteration - 1 if completed is None else completed)
            left = frozenset(plan.spares) | behind
            change = LayoutChange(
                kind="recovery", world=World.SHRINK, iteration=iteration, old_layout=run.layout,
                new_layout=continuing_layout(run.layout, plan),
                transfers=plan.transfers,  # what the plan priced, in old ranks: exactly what runs
                new_rank=dict(plan.new_rank),
                move_world=tuple(sorted((set(run.layout.world_ranks) - failed) | set(plan.joiners))),
                failed=failed, watch_old_world=True, reload_own=True, identity=identity if taken else None,
                leave=functools.partial(self._leave_as_spare, plan=plan, retry=attempt < REFORM_ATTEMPTS),
                part_sources=plan.part_sources, filled=plan.filled)
            try:
                new = apply(change, run, host)
                break
            except OptimizerPartsStale as stale:
                host.monitor.stop()
                lost = dataclasses.replace(plan, action="checkpoint-restart", reason=f"{plan.reason}; but {stale}",
                                           missing_shards=plan.missing_shards or tuple(sorted(
                                               {(run.layout.stage_of(r)[1], run.layout.tp_rank_of(r)) for r in failed})))
                self._fallback_checkpoint(old_rank, iteration, lost, consumed_samples, failed,
                                          iteration - 1 if completed is None else completed)
            except ChangeFailed as exc:
                # The old world's heartbeats are still watched, so a rank that died while the new
                # world formed is named like the first; the next attempt plans without it.
                if dist.is_initialized():
                    # This rank left the world the change ran in (its moves, the optimizer's
                    # parts): a peer still blocked on it there would wait out the collective timeout.
                    host.abandon_world()
                if attempt == REFORM_ATTEMPTS:
                    raise
                if recovery.spares_stay(host.store, run.generation):
                    left = behind  # the plan's spares held on to their state and plan again with us
                run = exc.run
                log_line(f" resihp: {rank_name(old_rank, run.identity)}: re-forming world {run.generation} failed "
                         f"({str(exc.__cause__ or exc).splitlines()[0][:120]}); planning again with the ranks "
                         f"the heartbeats name")
        if completed is not None and run.part_copies is not None and new.part_copies is not None \
                and new.part_copies.updates < run.part_copies.updates:
            completed = None  # this rank's update was taken back with the others' (``agree_on_update``)
            log_line(f" resihp: {rank_name(old_rank, run.identity, new.rank)}: the optimizer's parts went back to "
                     f"update {new.part_copies.updates}, where every part stood; iteration {iteration} runs again")
        host.known_health = host.known_health.relabel(plan.new_rank)
        host.readmission.after_recovery(published)
        quotas = run.quotas
        if failed or not quotas or len(quotas) != new.data_parallel_size:
            args = host.args
            quotas = plan.quotas or even_quotas(args.global_batch_size // args.micro_batch_size,
                                                new.data_parallel_size)
        new = new.replace(quotas=tuple(quotas))
        host.commit(new, world_changed=True)
        host.forget_faults_before(iteration)
        duration = time.perf_counter() - start
        if new.rank == 0:
            host.events.emit("adapted", iteration, world_size=dist.get_world_size(), duration_s=duration,
                             data_parallel_size=new.data_parallel_size, quotas=list(quotas),
                             failed_ranks=sorted(failed - stood_aside),
                             failed_launch_ranks=[identity[r] for r in sorted(failed - stood_aside)],
                             taken_back_launch_ranks=taken,
                             layers_per_replica=[list(r.layers_per_stage) for r in new.layout.replicas])
        how = "redoing" if completed is None else "going on after"
        log_line(f" resihp: {rank_name(old_rank, run.identity, new.rank)}: adapted in place, world "
                 f"{dist.get_world_size()}, DP {new.data_parallel_size}, {how} iteration {iteration} "
                 f"({duration:.2f} s since the failure surfaced)")
        return new

    def _behind(self, run, old_rank: int, resume_at: int, gone: frozenset[int]) -> frozenset[int]:
        """The survivors an optimizer update behind the furthest (``agree_on_progress``), which the
        plan leaves out as spares. A replica that stepped holds every shard of that update; one
        that did not cannot catch up on its own, and redoing its iteration while the others go on
        would pair collectives of different iterations. Optimizer part copies settle it instead:
        the recovery takes every survivor's update back to where all parts stand
        (``agree_on_update``)."""
        if run.part_copies is not None:
            return frozenset()
        survivors = sorted(set(run.layout.world_ranks) - gone)
        try:
            progress = recovery.agree_on_progress(self.host.store, run.generation, old_rank, survivors, resume_at,
                                                  wait_s=3 * self.host.cfg.collective_timeout_s,
                                                  stop=self.host.failure_among(survivors))
        except (PeerFailed, TimeoutError):
            # A survivor failed before it said: the world this plan re-forms meets that failure, and
            # the next attempt, planned without it, asks again.
            return frozenset()
        furthest = max(progress.values())
        behind = frozenset(r for r, at in progress.items() if at < furthest)
        if old_rank in behind:
            log_line(f" resihp: {rank_name(old_rank, run.identity)} did not step iteration {resume_at}, which "
                     f"{ranks_name(set(progress) - behind, run.identity)} stepped: with no copy of that update it "
                     f"stands aside as a spare")
        return behind

    def _store_gone(self) -> bool:
        """Whether the job's store is lost, waiting for the heartbeats to decide while it fails (a
        peer that left on losing it makes this rank's collective fail first)."""
        monitor = self.host.monitor
        deadline = time.monotonic() + (STORE_LOSS_TIMEOUTS + 2) * monitor.timeout_s + STORE_OP_TIMEOUT_S
        while monitor.store_failing and not monitor.store_lost and time.monotonic() < deadline:
            time.sleep(monitor.interval_s)
        return monitor.store_lost

    def leave_without_store(self, iteration: int, resume_at: int) -> None:
        """The job's store is gone: without it no failure can be named and no world re-formed, so
        this rank leaves, naming the last checkpoint under ``--save`` to resume from.

        ``resume_at``: the first iteration not done.

        Raises:
            StopTraining: always; ``EXIT_NEEDS_RESTART`` when a checkpoint exists to resume from.
        """
        host, args, run = self.host, self.host.args, self.host.run
        last = latest_iteration(args.save) if args.save else None
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        cause = (f"the job's store at {address} stopped answering (the process or node that hosts it is gone): "
                 f"no failure can be named or survived without it, so {rank_name(run.rank, run.identity)} leaves "
                 f"at iteration {resume_at}")
        if last is None:
            then = "; no checkpoint was saved (--save DIR --save-interval N make one to resume from)"
        else:
            redo = resume_at - 1 - last
            then = (f"; resume from the last checkpoint, iteration {last} under {args.save}"
                    + (f": iteration {last + 1} is trained again" if redo == 1 else
                       f": iterations {last + 1}-{resume_at - 1} are trained again" if redo > 1 else ""))
        if last is not None and run.rank == 0:
            log_line(f" resihp: resume with: {resume_command(sys.argv, len(host.launch_layout.world_ranks), args.save)}")
        host.events.emit("store_lost", resume_at, address=address, last_checkpoint=last)
        raise StopTraining(1 if last is None else EXIT_NEEDS_RESTART, cause + then)

    def _leave_failed(self, iteration: int, error: Exception) -> None:
        """This rank raised an error of its own (no peer failed): it leaves as a dead rank would, at
        once, so that the heartbeats name it and the others recover without it.

        Raises:
            StopTraining: always (``EXIT_RANK_FAILED``).
        """
        host = self.host
        me = rank_name(host.run.rank, host.run.identity)
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
        log_line(f" resihp: {me}: iteration {iteration} raised an error of this rank's own, not a peer's: "
                 f"{str(error).splitlines()[0][:160]}; it leaves so that the other ranks go on without it")
        # Its peers wait on it in their next collective: shutting its connections ends that wait now.
        host.abandon_world()
        raise StopTraining(EXIT_RANK_FAILED, f"iteration {iteration} raised on this rank: "
                                             f"{str(error).splitlines()[0][:160]}")

    def _shared(self, run, plan: SurvivorPlan, answered: list[int], left: frozenset[int], iteration: int,
                consumed_samples: int) -> dict:
        """What the leader publishes beside the plan: who stands by after it (every member keeps
        the same lists), and what a spare taken back needs to join the change and go on at
        ``iteration``: the old layout, the LR schedule, Adam's step, the loss scale, the batch's
        position, the known slowdowns and the fitted costs."""
        host = self.host
        identity = [*run.identity, *answered]
        taken = {identity[r] for r in plan.joiners}
        spares = set()
        if host.standby_on and plan.action == "adapt":
            spares = (host.readmission.spares | {run.identity[r] for r in left} | {identity[r] for r in plan.spares}) \
                - taken
        shared = {"identity": identity, "joiners": {str(len(run.identity) + i): l for i, l in enumerate(answered)},
                  "spares": sorted(spares), "standbys": sorted((host.readmission.standbys - taken) | spares)}
        if taken:
            objects, health = run.objects, host.known_health
            shared.update(iteration=iteration, consumed_samples=consumed_samples, layout=run.layout.to_dict(),
                          scheduler=objects.scheduler.state_dict(), adam=adam_template_of(objects),
                          loss_scale=loss_scale_state(objects.optimizer), costs=host.costs_record(),
                          health={"speed": {str(r): v for r, v in health.speed.items()},
                                  "slow_links": [[a, b, v] for (a, b), v in health.slow_links.items()]})
        return shared

    def _leave_as_spare(self, old_rank: int, plan: SurvivorPlan, retry: bool) -> None:
        """Leave the re-formed world's members once their world formed, standing by where standbys
        are on. With another attempt to come (``retry``), a member lost before that world formed
        sends this spare back into the recovery as a survivor, its state as the failure left it
        (``ChangeFailed``): the next plan may need its shard, which no other survivor may hold."""
        host = self.host
        cfg = host.cfg
        if retry and not recovery.spares_may_go(
                host.store, host.run.generation, len(plan.new_rank), host.failure_among(plan.new_rank),
                wait_s=3 * cfg.collective_timeout_s + cfg.rendezvous_timeout_s + 2 * cfg.heartbeat_timeout_s):
            raise ChangeFailed(f"world {host.run.generation} did not form; "
                               f"{rank_name(old_rank, host.run.identity)} stays to plan again", host.run)
        host.monitor.stop()
        me = rank_name(old_rank, host.run.identity)
        if host.standby_on:  # back at a later failure, in the place of a rank that died
            raise host.readmission.standing_by(
                old_rank, f"{me} is a spare after the adaptation (the new layout does not use it); it stands by "
                          f"for a later failure", probe=False)
        if dist.is_initialized():  # not after a failed re-form
            dist.destroy_process_group()
        raise StopTraining(0, f"{me} is a spare after the adaptation (the new layout does not use it)")

    def _preferred_plan(self, failed) -> dict:
        """What the joint planner would do with unrestricted execution (logged for comparison)."""
        plan = plan_adaptation(self.host.layout, self.host.known_health.updated(Health(dead=frozenset(failed))))
        return {"action": plan.action, "policy": plan.policy, "reason": plan.reason}

    def _fallback_checkpoint(self, old_rank, iteration, plan, consumed_samples, failed, completed):
        """No replica can go on: the survivors stop, naming the last periodic checkpoint under
        ``--save`` (if any) to resume from; the iterations after it are trained again."""
        host, args, run = self.host, self.host.args, self.host.run
        survivors = sorted(set(run.layout.world_ranks) - failed)
        # The event keeps the planner's reason as it wrote it; what people read says its numbering.
        told = world_numbered(plan.reason, run.identity)
        root = args.save or os.path.abspath("resihp_fallback_checkpoint")
        saved = None
        last = latest_iteration(args.save) if args.save else None
        if last is not None:
            saved = os.path.join(root, f"iter_{last:07d}")
            redo = (f"iteration {completed} is" if completed == last + 1
                    else f"iterations {last + 1}-{completed} are") if completed > last else "no iteration is"
            then = (f"; nothing could be saved now, so resume from the last checkpoint, iteration "
                    f"{last} ({saved}): {redo} trained again")
        else:
            then = ("; nothing saved, and no earlier checkpoint exists: pass --save DIR "
                    "--save-interval N so that a failure of every holder of a shard can resume")
        resume = resume_command(sys.argv, len(host.launch_layout.world_ranks), root) if saved else None
        if old_rank == survivors[0]:
            mark_job_done(host.store, host.launch_layout.world_ranks)
            host.events.emit("fallback_checkpoint", iteration, reason=plan.reason + then, resume_command=resume,
                             path=saved)
            after = f" after {ranks_name(failed, run.identity)} failed" if failed else ""
            log_line(f" resihp: no in-place plan{after}: {told}{then}")
            if resume:
                log_line(f" resihp: resume with: {resume}")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise StopTraining(EXIT_NEEDS_RESTART, told + then)
