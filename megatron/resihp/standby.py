"""Standby ranks: a rank a plan leaves out keeps its process, and comes back when it is wanted.

A rank a fail-slow plan leaves out (a slow device) comes back once healthy, when that pays; a rank
a fail-stop plan leaves out (a spare: healthy, but the new layout does not use it) comes back at a
later fail-stop, in the place of a rank that died. Responsible for both sides of both, executed at
iteration boundaries:

* the **standby** (``stand_by``): out of every group, it times the validation GEMM probe on its
  own device every ``--resihp-standby-probe-interval-s`` and reports its slowdown (the least of
  its latest few: ``resihp_ext.detection.standby_reports``) through the job's store; it follows
  the job's iteration (so injected faults end on time) and waits to be called. The job's end, or
  no progress for long, lets it exit 0.
* the **working ranks** (``check_standbys``): while standbys exist, rank 0 reads their reports at
  the start of every iteration and broadcasts them, so every working rank sees the same reports
  at the same iteration. When the set of healthy-looking standbys changes, every rank runs the same
  pure plan (``resihp_ext.planner.readmission``). To take standbys back, rank 0 calls them with
  everything a stateless process needs (layouts, iteration, consumed samples, LR schedule, Adam's
  step, known slowdowns) and says go only once every one has answered, or calls it off.
* the **recovery** (``call_spares``, on the survivor that plans a fail-stop recovery): it calls
  the spares, and the plan (``resihp_ext.planner.survivors``) may give those that answered the
  places of dead ranks; the published plan carries what a stateless process needs. A spare taken
  back joins the survivors' SHRINK change (``reconfigure.apply``) as one of its members: it
  receives its state through the plan's transfers from live holders, like a stage group the plan
  moves. A spare the plan does not take stands by again. Only recoveries that redo their
  iteration call spares (the spare rejoins the loop at an iteration's start).
* both: a GROW change (``reconfigure.apply``): a grown world through a fresh store prefix, in which
  working ranks keep their numbers and joiners follow; new groups; rebuilt model, DDP and
  optimizer; the joiners' shards, weights and Adam moments sent point-to-point from their holders,
  never read from a checkpoint. A member that fails before every member has its state sends the
  working ranks back to the old layout and the joiners back to standing by.

This is the readmission driver: it decides when to call whom, and asks the life cycle for the
change; it never builds a group, a model or a world itself. ``StandingBy`` leaves the training
loop on the standby; ``stand_by`` brings it back with what the loop needs to continue at the same
iteration as everyone else.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.resihp import recovery, standby_keys
from megatron.resihp.data_samplers import even_quotas
from megatron.resihp.detection import gemm_probe_s
from megatron.resihp.logging_utils import log_line, rank_name, ranks_name
from megatron.resihp.reconfigure import ChangeFailed, LayoutChange, World, apply
from megatron.resihp.reshard import adam_template_of, loss_scale_state
from megatron.resihp.run_state import StopTraining
from resihp_ext.detection.standby_reports import StandbySlowdown
from resihp_ext.layout import Layout
from resihp_ext.planner.calibration import ComputeCosts
from resihp_ext.planner.health import Health
from resihp_ext.planner.readmission import plan_readmission
from resihp_ext.planner.survivors import SurvivorPlan, continuing_layout
from resihp_ext.shard_map import Transfer

# A standby that sees no iteration start for this long gives up (the job died without saying so).
_ABANDONED_S = 600.0


class StandingBy(StopTraining):
    """This rank left every group to stand by; ``Readmission.stand_by`` waits for its call."""

    def __init__(self, message: str):
        super().__init__(0, message)


@dataclass
class Rejoined:
    """What the training loop of a readmitted rank continues from."""

    objects: object
    quotas: list[int]
    iteration: int
    consumed_samples: int


class Readmission:
    """Both sides of readmission; ``host`` is the process's ``ResilienceHooks`` (its run state,
    store, heartbeats, detector and injected faults)."""

    def __init__(self, host):
        self.host = host
        self.standbys: set[int] = set()  # launch ranks standing by
        # Those of them a fail-stop plan left out (healthy): they come back at a later fail-stop,
        # never through ``check_standbys``, whose launch-replica rule they could not meet anyway.
        self.spares: set[int] = set()
        self._report_seen: dict[int, tuple[int, float]] = {}  # launch rank -> (report seq, first seen)
        # On a standby: the latest world it was called into. Its reports carry it, and a call is
        # recorded in the store (``_called_key``), so a report counts only once the standby is back
        # from its latest call; a joiner that died in a world that never formed sends none, however
        # late its last report before the call was written, and whichever rank reads the reports.
        self._back_from = 0
        self._last_ready: set[int] = set()  # healthy-looking standbys the last plan was made for
        self._admitted_at: int | None = None  # iteration this rank rejoined at (planned already)
        self._standby_reference_s = 0.0
        self._standby_since = 0
        # Whether this rank, standing by, times its device for ``check_standbys``: a rank a fail-slow
        # plan left out does; a spare (back at a fail-stop, never through those reports) does not.
        self._probing = False

    # ------------------------------------------------------------------ the standby
    def standing_by(self, old_rank: int, message: str | None = None, probe: bool = True) -> StandingBy:
        """Leave every group to stand by, timing this rank's device while it does when ``probe`` (a
        spare does not). The reference probe time is taken now, while this rank's slowdown is
        known: the healthy ranks' latest probes, or this rank's own over its slowdown."""
        host = self.host
        rounds = [p for p in host.live.probe_rounds if p.rank_s] if host.live is not None else []
        slow = host.known_health.slow_factors
        healthy = [s for r, s in rounds[-1].rank_s.items() if r not in slow] if rounds else []
        self._probing = probe
        if probe:
            own = gemm_probe_s(host.device())
            self._standby_reference_s = statistics.median(healthy) if healthy else own / slow.get(old_rank, 1.0)
        self._standby_since = host.iteration
        if dist.is_initialized():
            dist.destroy_process_group()
        return StandingBy(message or f"{rank_name(old_rank, host.run.identity)} stands by after the re-plan; its "
                                     f"shards were handed over")

    def stand_by(self) -> Rejoined:
        """Probe, report and wait on the standby until called into a grown world, then join it.

        Raises:
            StopTraining: the job finished (or went silent) while this rank stood by.
        """
        host = self.host
        me = host.run.launch_rank
        store, interval = host.store, host.cfg.standby_probe_interval_s
        probing = (f", probing every {interval:g} s (healthy probe {self._standby_reference_s * 1e3:.2f} ms)"
                   if self._probing else " for a later failure")
        log_line(f" resihp: launch rank {me} stands by from iteration {self._standby_since}{probing}")
        standby_keys.beat_as_standby(me)
        host.events.emit("standby", self._standby_since, launch_rank=me,
                         reference_probe_s=self._standby_reference_s)
        applied, next_probe, seq = self._standby_since, 0.0, 0
        slowdown = StandbySlowdown()
        progress, last_progress = applied, time.monotonic()
        abandoned_s = max(_ABANDONED_S, 10 * host.cfg.collective_timeout_s)
        while True:
            try:
                done = store.check([standby_keys.DONE])
                progress_key = standby_keys.PROGRESS
                now_at = int(store.get(progress_key)) if store.check([progress_key]) else progress
                call_key = standby_keys.call_key(me)
                call = json.loads(store.get(call_key)) if store.check([call_key]) else None
                if call is not None:
                    store.delete_key(call_key)
            except (RuntimeError, TimeoutError) as error:  # torch's store reports a lost server so
                raise StopTraining(0, f"the job's store stopped answering while launch rank {me} stood by "
                                      f"({str(error).splitlines()[0][:120]}); the working ranks leave with the "
                                      f"cause, and this rank held nothing they need") from error
            if done:
                raise StopTraining(0, f"the job finished while launch rank {me} stood by")
            if now_at != progress:
                progress, last_progress = now_at, time.monotonic()
                # Faults follow the job's iterations; the one it is starting is applied on joining.
                for iteration in range(applied + 1, progress):
                    host.apply_faults(iteration, standing_by=True)
                    applied = iteration
            if time.monotonic() - last_progress > abandoned_s:
                raise StopTraining(0, f"no iteration started for {abandoned_s:.0f} s while launch rank {me} stood by")
            if call is not None:
                self._back_from = max(self._back_from, call["generation"])
                rejoined = self._answer_recovery(call) if call.get("kind") == "recovery" else self._answer_call(call)
                if rejoined is not None:
                    return rejoined
                next_probe = 0.0
            if self._probing and time.monotonic() >= next_probe:
                factor = slowdown.add(gemm_probe_s(host.device()) / self._standby_reference_s)
                seq += 1
                store.set(standby_keys.report_key(me), json.dumps({"factor": round(factor, 4), "seq": seq,
                                                       "back_from": self._back_from}))
                next_probe = time.monotonic() + interval
            time.sleep(0.05)

    def _answer_call(self, call: dict) -> Rejoined | None:
        """Say this rank is here, wait for go, and join; None when the call was called off."""
        host = self.host
        me = host.run.launch_rank
        generation, new_rank, size = call["generation"], call["new_rank"], call["world_size"]
        host.store.set(standby_keys.joining_key(generation, new_rank), "1")
        try:
            recovery.wait_for_keys(host.store, [standby_keys.go_key(generation)], 3 * host.cfg.collective_timeout_s)
        except TimeoutError:  # rank 0 failed after calling: the working ranks recover without this rank
            log_line(f" resihp: launch rank {me}: no go for world {generation}; standing by again")
            return None
        if host.store.get(standby_keys.go_key(generation)) != b"1":
            log_line(f" resihp: launch rank {me}: the call to world {generation} was called off")
            return None
        host.known_health = Health(speed={int(r): v for r, v in call["speed"].items()},
                                   slow_links={(a, b): v for a, b, v in call["slow_links"]})
        self.standbys = {int(r) for r in call["standbys"]}
        # A joiner holds no state: every unit it needs comes from a holder.
        run = host.run.replace(generation=generation, objects=None, sync=None, messages=None)
        host.run = run
        change = LayoutChange(
            kind="readmission", world=World.GROW, iteration=call["iteration"],
            old_layout=Layout.from_dict(call["old_layout"]), new_layout=Layout.from_dict(call["new_layout"]),
            transfers=() if call.get("parts") else tuple(Transfer.from_dict(t) for t in call["transfers"]),
            identity=tuple(call["identity"]),
            joining_rank=new_rank, scheduler_state=call["scheduler"], adam_template=call["adam"],
            loss_scale=call.get("loss_scale", []), part_sources={} if call.get("parts") else None)
        try:
            new = apply(change, run, host)
        except ChangeFailed as error:
            # The working ranks go back to the old layout without this rank, which leaves the world.
            host.unwatch()
            if dist.is_initialized():
                dist.destroy_process_group()
            log_line(f" resihp: launch rank {me}: world {generation} failed before every member had its state "
                     f"({str(error.__cause__ or error).splitlines()[0][:120]}); standing by again")
            return None
        host.commit(new.replace(quotas=tuple(call["quotas"])), world_changed=True)
        self._admitted_at = call["iteration"]
        log_line(f" resihp: launch rank {me} rejoined as world rank {new.rank} of {size} at iteration "
                 f"{call['iteration']}")
        return Rejoined(new.objects, list(call["quotas"]), call["iteration"], call["consumed_samples"])

    def _answer_recovery(self, call: dict) -> Rejoined | None:
        """Called by a fail-stop recovery: say this rank is here, read the plan, and join the
        survivors' change when the plan takes it back; None when it stays out."""
        host = self.host
        me = host.run.launch_rank
        generation = call["generation"]
        host.store.set(standby_keys.here_key(generation, me), "1")
        try:
            recovery.wait_for_keys(host.store, [recovery.plan_key(generation)], 3 * host.cfg.collective_timeout_s)
        except TimeoutError:  # the survivor planning failed: the others plan again, and may call again
            log_line(f" resihp: launch rank {me}: no plan for world {generation}; standing by again")
            return None
        published = json.loads(host.store.get(recovery.plan_key(generation)))
        plan = SurvivorPlan.from_dict(published["plan"])
        place = {launch: int(rank) for rank, launch in published.get("joiners", {}).items()}.get(me)
        if plan.action != "adapt" or place not in plan.joiners:
            log_line(f" resihp: launch rank {me}: the plan of world {generation} does not take it back; standing by")
            return None
        iteration, identity = published["iteration"], tuple(published["identity"])
        old_layout, failed = Layout.from_dict(published["layout"]), frozenset(published["failed"])
        dead = sorted(d for d, r in plan.filled.items() if r == place)
        # A spare holds nothing the job can use (its state is as old as the iteration it left at).
        run = host.run.replace(layout=old_layout, groups=None, rank=place, identity=identity, generation=generation,
                               objects=None, sync=None, messages=None)
        host.run = run
        host.iteration = iteration
        change = LayoutChange(
            kind="recovery", world=World.SHRINK, iteration=iteration, old_layout=old_layout,
            new_layout=continuing_layout(old_layout, plan), transfers=plan.transfers, new_rank=dict(plan.new_rank),
            move_world=tuple(sorted((set(old_layout.world_ranks) - failed) | set(plan.joiners))), failed=failed,
            watch_old_world=True, reload_own=True, identity=identity, joining_rank=place,
            scheduler_state=published["scheduler"], adam_template=published["adam"],
            loss_scale=published["loss_scale"], part_sources=plan.part_sources, filled=plan.filled)
        try:
            new = apply(change, run, host)
        except ChangeFailed as error:  # the survivors plan again, without whoever failed
            host.unwatch()
            if dist.is_initialized():
                dist.destroy_process_group()
            log_line(f" resihp: launch rank {me}: world {generation} failed before every member had its state "
                     f"({str(error.__cause__ or error).splitlines()[0][:120]}); standing by again")
            return None
        health = published["health"]
        host.known_health = Health(speed={int(r): v for r, v in health["speed"].items()},
                                   slow_links={(a, b): v for a, b, v in health["slow_links"]}).relabel(plan.new_rank)
        if published.get("costs") and host.live is not None:  # what the survivors plan with, from now on here too
            host.live.costs = ComputeCosts(**published["costs"])
        self.after_recovery(published)
        args = host.args
        quotas = list(plan.quotas) or even_quotas(args.global_batch_size // args.micro_batch_size,
                                                  new.data_parallel_size)
        host.commit(new.replace(quotas=tuple(quotas)), world_changed=True)
        host.forget_faults_before(iteration)
        log_line(f" resihp: launch rank {me} was taken back as world rank {new.rank} of {new.world_size} at iteration "
                 f"{iteration}, in the place of dead {ranks_name(dead, identity)}")
        return Rejoined(new.objects, quotas, iteration, published["consumed_samples"])

    # ------------------------------------------------------------------ the recovery
    def call_spares(self, generation: int, launch_ranks) -> list[int]:
        """On the survivor that plans a fail-stop recovery of world ``generation``: call the spares
        ``launch_ranks``; those that answer within a few heartbeat intervals may be taken back.

        Returns:
            The launch ranks that answered, sorted: the plan numbers them after the old world's ranks.
        """
        host = self.host
        order = sorted(launch_ranks)
        for launch in order:
            host.store.set(standby_keys.call_key(launch), json.dumps({"kind": "recovery", "generation": generation}))
        # A standby polls for calls every 50 ms; one its beacon marked dead or stopped, or that does
        # not answer in this time (its beacon went too: a lost node), is gone, and the plan is made
        # without it.
        deadline = time.monotonic() + max(2.0, 2 * host.cfg.heartbeat_timeout_s)
        here, gone, waiting = [], [], list(order)
        while waiting and time.monotonic() < deadline:
            for launch in list(waiting):
                if host.store.check([standby_keys.here_key(generation, launch)]):
                    here.append(launch)
                    waiting.remove(launch)
                elif standby_keys.marked_gone(host.store, launch):
                    gone.append(launch)
                    waiting.remove(launch)
            if waiting:
                time.sleep(0.02)
        if gone:
            log_line(f" resihp: spare launch ranks {sorted(gone)} called by world {generation}: dead or stopped "
                     f"by their heartbeat beacons; planning without them")
        for launch in set(order) - set(here):
            host.store.delete_key(standby_keys.call_key(launch))  # one that answers late reads the plan and stands by
        return sorted(here)

    def after_recovery(self, published: dict) -> None:
        """Every member of a recovered world, spares taken back included: who stands by now (the
        plan's published lists, so every member holds the same and ``check_standbys`` agrees)."""
        self.standbys = set(published["standbys"])
        self.spares = set(published["spares"])
        self._last_ready = set()

    # ------------------------------------------------------------------ the working ranks
    def check_standbys(self, iteration: int, consumed_samples: int) -> None:
        """At the start of ``iteration``: take standbys back when they report healthy and it pays.

        Collective over the working world while standbys exist (one small broadcast).
        """
        host = self.host
        if not self.standbys or self._admitted_at == iteration:
            return
        if host.run.rank == 0:
            try:
                host.store.set(standby_keys.PROGRESS, str(iteration))  # every standby follows the job's iteration
            except (RuntimeError, TimeoutError):
                # The store is failing: the heartbeats judge whether it is lost, which ends the job
                # with its cause (``leave_without_store``); a standby without progress waits that out.
                pass
        order = sorted(self.standbys - self.spares)  # spares come back at a fail-stop
        if not order:
            return
        factors = torch.full((len(order),), -1.0, dtype=torch.float64)
        if host.run.rank == 0:
            now = time.monotonic()
            for i, launch in enumerate(order):
                if not host.store.check([standby_keys.report_key(launch)]):
                    continue
                report = json.loads(host.store.get(standby_keys.report_key(launch)))
                if not standby_keys.report_counts(host.store, launch, report):
                    continue
                seen = self._report_seen.get(launch)
                if seen is None or seen[0] != report["seq"]:
                    self._report_seen[launch] = seen = (report["seq"], now)
                # A report that stopped changing comes from a standby that is gone.
                if now - seen[1] <= max(5 * host.cfg.standby_probe_interval_s, 3 * host.cfg.heartbeat_timeout_s):
                    factors[i] = report["factor"]
        device_factors = factors.to(host.device())
        dist.broadcast(device_factors, src=0)
        factors = device_factors.cpu()
        # A reading under the probe threshold is within what a probe cannot tell from a healthy
        # device (a working rank's probe is judged the same way), so the planner prices it healthy:
        # priced at its reading, a healthy standby read 1.9x by host noise came back with a smaller
        # share than its replica's launch share.
        readings = {launch: float(f) for launch, f in zip(order, factors.tolist())
                    if 0.0 <= f < host.cfg.probe_threshold}
        ready = dict.fromkeys(readings, 1.0)
        if set(ready) == self._last_ready or host.costs is None or host.costs.iteration <= host.layout_changed_at:
            # (The cost model is fitted to a measured iteration: wait for one on the current layout.)
            return
        self._last_ready = set(ready)
        if not ready:
            return
        start = time.perf_counter()
        run = host.run
        horizon = max(host.args.train_iters - iteration + 1, 1)
        decision = plan_readmission(run.layout, list(run.identity), host.launch_layout, ready, host.known_health,
                                    host.calibrated_hardware(), list(run.quotas), horizon,
                                    alike=not host.own_splits, tp_descending=host.shrinks_tp)
        plan = decision.plan
        if run.rank == 0:
            host.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), ready={str(k): v for k, v in sorted(readings.items())},
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after, compute_costs=host.costs_record(),
                             moves=[t.to_dict() for t in plan.moves])
            read = ", ".join(f"{k}: {v:.2f}x" for k, v in sorted(readings.items()))
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason} (standbys' probes read {read}; "
                     f"under --resihp-probe-threshold, priced healthy)")  # in launch ranks
        if plan.action != "adapt":
            return
        self._admit(iteration, decision, consumed_samples, start)

    def _admit(self, iteration: int, decision, consumed_samples: int, start: float) -> None:
        """Call the joiners, and grow the world with them once every one has answered.

        Raises:
            ChangeFailed: the grown world did not form, or a member failed before every member had
                its state: the working ranks are back on the old layout (``host.run``), and the
                fail-stop recovery re-forms them.
        """
        host = self.host
        run = host.run
        objects = run.objects
        plan = decision.plan
        generation, size = run.generation + 1, plan.layout.world_size
        identity = [*run.identity, *decision.joiners]
        parts = run.part_copies is not None  # the distributed optimizer's parts fill the joiners (``reconfigure``)
        go = standby_keys.go_key(generation)
        if run.rank == 0:
            shared = {"generation": generation, "world_size": size, "iteration": iteration,
                      "consumed_samples": consumed_samples, "quotas": list(plan.quotas),
                      "old_layout": run.layout.to_dict(), "new_layout": plan.layout.to_dict(),
                      "transfers": [t.to_dict() for t in plan.transfers],
                      "identity": identity, "speed": {str(r): v for r, v in host.known_health.speed.items()},
                      "slow_links": [[a, b, v] for (a, b), v in host.known_health.slow_links.items()],
                      "standbys": sorted(self.standbys - set(decision.joiners)),
                      "scheduler": objects.scheduler.state_dict(), "adam": adam_template_of(objects),
                      "loss_scale": loss_scale_state(objects.optimizer), "parts": parts}
            new_rank = {launch: decision.new_rank_of(launch, len(run.identity)) for launch in decision.joiners}
            for launch, rank in new_rank.items():
                standby_keys.record_call(host.store, launch, generation)
                host.store.set(standby_keys.call_key(launch), json.dumps({**shared, "new_rank": rank}))
            joining = [standby_keys.joining_key(generation, rank) for rank in new_rank.values()]
            try:
                recovery.wait_for_keys(host.store, joining, 3 * host.cfg.standby_probe_interval_s
                                       + 2 * host.cfg.heartbeat_timeout_s)
                host.store.set(go, "1")
            except TimeoutError as error:
                host.store.set(go, "0")
                log_line(f" resihp: calling off standbys launch ranks {list(decision.joiners)}: {error}")
        recovery.wait_for_keys(host.store, [go], 3 * host.cfg.collective_timeout_s)
        run = run.replace(generation=generation)  # never reused: a joiner may have written under its prefix
        host.run = run
        self._last_ready = set()  # whatever happens next, plan again on the next reports
        if host.store.get(go) != b"1":
            return
        change = LayoutChange(kind="readmission", world=World.GROW, iteration=iteration, old_layout=run.layout,
                              new_layout=plan.layout, transfers=() if parts else tuple(plan.transfers),
                              identity=tuple(identity), scheduler_state=objects.scheduler.state_dict(),
                              part_sources={} if parts else None)
        try:
            new = apply(change, run, host)
        except ChangeFailed as error:
            # The old layout is still whole on every working rank. The joiners leave; the fail-stop
            # recovery re-forms the working ranks that are left (in the grown world, where they kept
            # their numbers, or from the old world's heartbeats when it never formed) and redoes the
            # iteration.
            host.run = error.run
            log_line(f" resihp: {rank_name(run.rank, run.identity)}: readmitting launch ranks {list(decision.joiners)} "
                     f"failed "
                     f"({str(error.__cause__ or error).splitlines()[0][:120]}); back on the old layout")
            raise
        host.commit(new.replace(quotas=tuple(plan.quotas)), world_changed=True)
        self.standbys -= set(decision.joiners)
        for launch in decision.joiners:  # a later stand-by starts its reports afresh
            self._report_seen.pop(launch, None)
        duration = time.perf_counter() - start
        if new.rank == 0:
            host.events.emit("adapted", iteration, world_size=size, quotas=list(plan.quotas),
                             joined_launch_ranks=list(decision.joiners), duration_s=duration,
                             layers_per_replica=[list(r.layers_per_stage) for r in new.layout.replicas])
            log_line(f" resihp: readmitted launch ranks {list(decision.joiners)} at iteration {iteration}: world "
                     f"{run.layout.world_size} -> {size}, micro-batch quotas {list(plan.quotas)} "
                     f"({duration * 1000:.0f} ms)")
