"""Standby ranks: a rank a fail-slow plan leaves out keeps its process and rejoins once healthy.

Responsible for both sides of readmission, executed at iteration boundaries:

* the **standby** (``stand_by``): out of every group, it times the validation GEMM probe on its
  own device every ``--resihp-standby-probe-interval-s`` and reports its slowdown through the
  job's store; it follows the job's iteration (so injected faults end on time) and waits to be
  called. The job's end, or no progress for long, lets it exit 0.
* the **working ranks** (``check_standbys``): while standbys exist, rank 0 reads their reports at
  the start of every iteration and broadcasts them, so every working rank sees the same reports
  at the same iteration. When the set of healthy-looking standbys changes, every rank runs the same
  pure plan (``resihp_ext.planner.readmission``). To take standbys back, rank 0 calls them with
  everything a stateless process needs (layouts, iteration, consumed samples, LR schedule, Adam's
  step, known slowdowns) and says go only once every one has answered, or calls it off.
* both (``_grow``): a grown world through a fresh store prefix, in which working ranks keep their
  numbers and joiners follow; new groups; rebuilt model, DDP and optimizer; the joiners' shards,
  weights and Adam moments sent point-to-point from their holders, never read from a checkpoint.

``StandingBy`` leaves the training loop on the standby; ``stand_by`` brings it back with what the
loop needs to continue at the same iteration as everyone else.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.resihp import recovery
from megatron.resihp.detection import gemm_probe_s
from megatron.resihp.logging_utils import log_line
from megatron.resihp.parallel_state_patch import build_groups, install
from megatron.resihp.relayout import StopTraining
from megatron.resihp.reshard import adam_template_of, apply_transfers, load_loss_scale_state, loss_scale_state
from resihp_ext.layout import Layout
from resihp_ext.planner.health import Health
from resihp_ext.planner.readmission import plan_readmission
from resihp_ext.shard_map import Transfer

_PREFIX = "resihp/standby/"
_DONE = _PREFIX + "done"
_PROGRESS = _PREFIX + "progress"
# A standby that sees no iteration start for this long gives up (the job died without saying so).
_ABANDONED_S = 600.0


def mark_job_done(store) -> None:
    """Tell standbys the job has ended (finished, or saved for a restart): they exit 0."""
    store.set(_DONE, "1")


class StandingBy(StopTraining):
    """This rank left every group to stand by; ``ResilienceHooks.stand_by`` waits for its call."""

    def __init__(self, message: str):
        super().__init__(0, message)


@dataclass
class Rejoined:
    """What the training loop of a readmitted rank continues from."""

    objects: object
    quotas: list[int]
    iteration: int
    consumed_samples: int


def _report_key(launch_rank: int) -> str:
    return f"{_PREFIX}report/{launch_rank}"


def _call_key(launch_rank: int) -> str:
    return f"{_PREFIX}call/{launch_rank}"


def _go_key(generation: int) -> str:
    return f"{_PREFIX}go/{generation}"


class Readmissions:
    """Mixin for ``ResilienceHooks``: expects ``args``, ``cfg``, ``events``, ``rank``, ``layout``,
    ``store``, ``monitor``, ``generation``, ``known_health``, ``live``, ``iteration``, ``costs``, ``costs_record``,
    ``_layout_changed_at``, ``identity`` (this world's rank -> launch rank),
    ``launch_rank``, ``launch_layout``, ``standbys`` (their launch ranks), ``backend``, ``_device``,
    ``_adopt``, ``_rebuild``, ``_calibrated_hardware``, ``_failure_among`` and ``_apply_faults``,
    and the bookkeeping ``_init_readmissions`` sets up."""

    def _init_readmissions(self) -> None:
        self._report_seen: dict[int, tuple[int, float]] = {}  # launch rank -> (report seq, first seen)
        # Standbys called into a world that did not form or hold -> the report seq they were called on:
        # only a later report (the standby is back) makes them ready again; a dead one never sends it.
        self._called_on: dict[int, int] = {}
        self._last_ready: set[int] = set()  # healthy-looking standbys the last plan was made for
        self._admitted_at: int | None = None  # iteration this rank rejoined at (planned already)
        self._standby_reference_s = 0.0
        self._standby_since = 0

    # ------------------------------------------------------------------ the standby
    def _standing_by(self, old_rank: int) -> StandingBy:
        """Leave every group to stand by; the reference probe time is taken now, while this rank's
        slowdown is known: the healthy ranks' latest probes, or this rank's own over its slowdown."""
        rounds = [p for p in self.live.probe_rounds if p.rank_s] if self.live is not None else []
        slow = self.known_health.slow_factors
        healthy = [s for r, s in rounds[-1].rank_s.items() if r not in slow] if rounds else []
        own = gemm_probe_s(self._device())
        self._standby_reference_s = statistics.median(healthy) if healthy else own / slow.get(old_rank, 1.0)
        self._standby_since = self.iteration
        if dist.is_initialized():
            dist.destroy_process_group()
        return StandingBy(f"rank {old_rank} (launch rank {self.identity[old_rank]}) stands by after the re-plan; "
                          f"its shards were handed over")

    def stand_by(self) -> Rejoined:
        """Probe, report and wait on the standby until called into a grown world, then join it.

        Raises:
            StopTraining: the job finished (or went silent) while this rank stood by.
        """
        me = self.launch_rank
        store, interval = self.store, self.cfg.standby_probe_interval_s
        log_line(f" resihp: launch rank {me} stands by from iteration {self._standby_since}, "
                 f"probing every {interval:g} s (healthy probe {self._standby_reference_s * 1e3:.2f} ms)")
        self.events.emit("standby", self._standby_since, launch_rank=me,
                         reference_probe_s=self._standby_reference_s)
        applied, next_probe, seq = self._standby_since, 0.0, 0
        progress, last_progress = applied, time.monotonic()
        abandoned_s = max(_ABANDONED_S, 10 * self.cfg.collective_timeout_s)
        while True:
            if store.check([_DONE]):
                raise StopTraining(0, f"the job finished while launch rank {me} stood by")
            now_at = int(store.get(_PROGRESS)) if store.check([_PROGRESS]) else progress
            if now_at != progress:
                progress, last_progress = now_at, time.monotonic()
                # Faults follow the job's iterations; the one it is starting is applied on joining.
                for iteration in range(applied + 1, progress):
                    self._apply_faults(iteration, standing_by=True)
                    applied = iteration
            if time.monotonic() - last_progress > abandoned_s:
                raise StopTraining(0, f"no iteration started for {abandoned_s:.0f} s while launch rank {me} stood by")
            if store.check([_call_key(me)]):
                call = json.loads(store.get(_call_key(me)))
                store.delete_key(_call_key(me))
                rejoined = self._answer_call(call)
                if rejoined is not None:
                    return rejoined
                next_probe = 0.0
            if time.monotonic() >= next_probe:
                factor = gemm_probe_s(self._device()) / self._standby_reference_s
                seq += 1
                store.set(_report_key(me), json.dumps({"factor": round(factor, 4), "seq": seq}))
                next_probe = time.monotonic() + interval
            time.sleep(0.05)

    def _answer_call(self, call: dict) -> Rejoined | None:
        """Say this rank is here, wait for go, and join; None when the call was called off."""
        generation, new_rank, size = call["generation"], call["new_rank"], call["world_size"]
        self.store.set(f"resihp/gen{generation}/joining/{new_rank}", "1")
        try:
            recovery.wait_for_keys(self.store, [_go_key(generation)], 3 * self.cfg.collective_timeout_s)
        except TimeoutError:  # rank 0 failed after calling: the working ranks recover without this rank
            log_line(f" resihp: launch rank {self.launch_rank}: no go for world {generation}; standing by again")
            return None
        if self.store.get(_go_key(generation)) != b"1":
            log_line(f" resihp: launch rank {self.launch_rank}: the call to world {generation} was called off")
            return None
        old_layout, new_layout = Layout.from_dict(call["old_layout"]), Layout.from_dict(call["new_layout"])
        try:
            self._meet(generation, new_rank, size, call["iteration"], stop=lambda: None)
        except (RuntimeError, TimeoutError) as error:  # the working ranks failed first: stand by again
            log_line(f" resihp: launch rank {self.launch_rank}: world {generation} did not form ({error}); "
                     f"standing by again")
            return None
        self.known_health = Health(speed={int(r): v for r, v in call["speed"].items()},
                                   slow_links={(a, b): v for a, b, v in call["slow_links"]})
        self.standbys = {int(r) for r in call["standbys"]}
        try:
            new_objects = self._grow(call["iteration"], call["identity"], old_layout, new_layout,
                                     tuple(Transfer.from_dict(t) for t in call["transfers"]), None,
                                     call["scheduler"], adam_template=call["adam"],
                                     loss_scale=call.get("loss_scale", []))
        except RuntimeError as error:
            # The working ranks go back to the old layout without this rank, which leaves the world.
            self.monitor.stop()
            if dist.is_initialized():
                dist.destroy_process_group()
            self.sync = None
            log_line(f" resihp: launch rank {self.launch_rank}: world {generation} failed before every member "
                     f"had its state ({str(error).splitlines()[0][:120]}); standing by again")
            return None
        self._admitted_at = call["iteration"]
        log_line(f" resihp: launch rank {self.launch_rank} rejoined as rank {self.rank} of {size} "
                 f"at iteration {call['iteration']}")
        return Rejoined(new_objects, list(call["quotas"]), call["iteration"], call["consumed_samples"])

    # ------------------------------------------------------------------ the working ranks
    def check_standbys(self, iteration: int, objects, quotas, consumed_samples: int):
        """At the start of ``iteration``: take standbys back when they report healthy and it pays.

        Collective over the working world while standbys exist (one small broadcast).
        """
        if not self.standbys or self._admitted_at == iteration:
            return objects, quotas
        order = sorted(self.standbys)
        factors = torch.full((len(order),), -1.0, dtype=torch.float64)
        if self.rank == 0:
            self.store.set(_PROGRESS, str(iteration))
            now = time.monotonic()
            for i, launch in enumerate(order):
                if not self.store.check([_report_key(launch)]):
                    continue
                report = json.loads(self.store.get(_report_key(launch)))
                if self._called_on.get(launch) == report["seq"]:
                    continue
                self._called_on.pop(launch, None)
                seen = self._report_seen.get(launch)
                if seen is None or seen[0] != report["seq"]:
                    self._report_seen[launch] = seen = (report["seq"], now)
                # A report that stopped changing comes from a standby that is gone.
                if now - seen[1] <= max(5 * self.cfg.standby_probe_interval_s, 3 * self.cfg.heartbeat_timeout_s):
                    factors[i] = report["factor"]
        device_factors = factors.to(self._device())
        dist.broadcast(device_factors, src=0)
        factors = device_factors.cpu()
        ready = {launch: max(float(f), 1.0) for launch, f in zip(order, factors.tolist())
                 if 0.0 <= f < self.cfg.probe_threshold}
        if set(ready) == self._last_ready or self.costs is None or self.costs.iteration <= self._layout_changed_at:
            # (The cost model is fitted to a measured iteration: wait for one on the current layout.)
            return objects, quotas
        self._last_ready = set(ready)
        if not ready:
            return objects, quotas
        start = time.perf_counter()
        horizon = max(self.args.train_iters - iteration + 1, 1)
        decision = plan_readmission(self.layout, self.identity, self.launch_layout, ready, self.known_health,
                                    self._calibrated_hardware(), quotas, horizon)
        plan = decision.plan
        if self.rank == 0:
            self.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=list(plan.quotas), ready={str(k): v for k, v in sorted(ready.items())},
                             predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after, compute_costs=self.costs_record(),
                             moves=[t.to_dict() for t in plan.moves])
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason}")
        if plan.action != "adapt":
            return objects, quotas
        return self._admit(iteration, decision, objects, quotas, consumed_samples, start)

    def _admit(self, iteration: int, decision, objects, quotas, consumed_samples: int, start: float):
        """Call the joiners, and grow the world with them once every one has answered."""
        plan = decision.plan
        generation, size = self.generation + 1, plan.layout.world_size
        identity = [*self.identity, *decision.joiners]
        go = _go_key(generation)
        if self.rank == 0:
            shared = {"generation": generation, "world_size": size, "iteration": iteration,
                      "consumed_samples": consumed_samples, "quotas": list(plan.quotas),
                      "old_layout": self.layout.to_dict(), "new_layout": plan.layout.to_dict(),
                      "transfers": [t.to_dict() for t in plan.transfers],
                      "identity": identity, "speed": {str(r): v for r, v in self.known_health.speed.items()},
                      "slow_links": [[a, b, v] for (a, b), v in self.known_health.slow_links.items()],
                      "standbys": sorted(self.standbys - set(decision.joiners)),
                      "scheduler": objects.scheduler.state_dict(), "adam": adam_template_of(objects),
                      "loss_scale": loss_scale_state(objects.optimizer)}
            new_rank = {launch: decision.new_rank_of(launch, len(self.identity)) for launch in decision.joiners}
            for launch, rank in new_rank.items():
                self._called_on[launch] = self._report_seen[launch][0]
                self.store.set(_call_key(launch), json.dumps({**shared, "new_rank": rank}))
            joining = [f"resihp/gen{generation}/joining/{rank}" for rank in new_rank.values()]
            try:
                recovery.wait_for_keys(self.store, joining, 3 * self.cfg.standby_probe_interval_s
                                       + 2 * self.cfg.heartbeat_timeout_s)
                self.store.set(go, "1")
            except TimeoutError as error:
                self.store.set(go, "0")
                log_line(f" resihp: calling standbys {list(decision.joiners)} off: {error}")
        recovery.wait_for_keys(self.store, [go], 3 * self.cfg.collective_timeout_s)
        self.generation = generation  # never reused: a joiner may have written under its prefix
        self._last_ready = set()  # whatever happens next, plan again on the next reports
        if self.store.get(go) != b"1":
            return objects, quotas
        old_layout, old_identity = self.layout, self.identity
        # A working rank that fails while the world forms is named by the old world's heartbeats:
        # the RuntimeError sends every working rank into fail-stop recovery, on the old layout.
        try:
            self._meet(generation, self.rank, size, iteration, stop=self._failure_among(old_layout.world_ranks))
        except (RuntimeError, TimeoutError) as error:
            if not dist.is_initialized():
                # The rendezvous itself failed (a member died after saying it was there): the old
                # world is gone and the grown one never formed. The old world's heartbeats still
                # run, so the recovery re-forms the working ranks, without whoever failed.
                log_line(f" resihp: rank {self.rank}: world {generation} did not form "
                         f"({str(error).splitlines()[0][:120]}); re-forming the working ranks")
            raise RuntimeError(f"world {generation} did not form: {error}") from error
        try:
            new_objects = self._grow(iteration, identity, old_layout, plan.layout, plan.transfers, objects,
                                     objects.scheduler.state_dict())
        except RuntimeError as error:
            # The old layout is still whole on every working rank. The joiners leave; the fail-stop
            # recovery re-forms the working ranks that are left (in this world, where they kept
            # their numbers) and redoes the iteration.
            self.layout, self.identity, self.sync = old_layout, old_identity, None
            self.replica_index = self.args.replica_index = old_layout.stage_of(self.rank)[0]
            self.args.data_parallel_size = old_layout.num_replicas
            log_line(f" resihp: rank {self.rank}: readmitting launch ranks {list(decision.joiners)} failed before "
                     f"every member had its state ({str(error).splitlines()[0][:120]}); back on the old layout")
            raise
        self.standbys -= set(decision.joiners)
        for launch in decision.joiners:  # a later stand-by starts its reports afresh
            self._called_on.pop(launch, None)
            self._report_seen.pop(launch, None)
        duration = time.perf_counter() - start
        if self.rank == 0:
            self.events.emit("adapted", iteration, world_size=size, quotas=list(plan.quotas),
                             joined_launch_ranks=list(decision.joiners), duration_s=duration,
                             layers_per_replica=[list(r.layers_per_stage) for r in self.layout.replicas])
            log_line(f" resihp: readmitted launch ranks {list(decision.joiners)} at iteration {iteration}: world "
                     f"{old_layout.world_size} -> {size}, micro-batch quotas {list(plan.quotas)} "
                     f"({duration * 1000:.0f} ms)")
        return new_objects, list(plan.quotas)

    # ------------------------------------------------------------------ both
    def _meet(self, generation: int, new_rank: int, size: int, iteration: int, stop) -> None:
        """Form the grown world (the old one is left only once every member has arrived), and watch
        its heartbeats from the start: a member that fails while it is set up must be named."""
        recovery.meet_and_reform(self.store, str(generation), new_rank, size, self.backend,
                                 self.cfg.collective_timeout_s, stop,
                                 met=lambda: self._apply_recovery_faults(iteration, "rendezvous"))
        if self.monitor is not None:
            self.monitor.stop()
        self.generation = generation
        if self.store is not None:
            self._start_monitor()

    def _grow(self, iteration: int, identity: list[int], old_layout: Layout, new_layout: Layout, transfers,
              objects, scheduler_state: dict, adam_template: dict | None = None, loss_scale: list | None = None):
        """In the grown world: install its groups, rebuild, run the plan's ``transfers`` (a joiner
        passes no ``objects`` and the working ranks' ``adam_template``), then agree that every
        member did.

        Raises:
            RuntimeError: a member failed before every member had its state (``_all_done``). Moves
                only read the old objects, so the working ranks go back to ``old_layout`` whole,
                and the joiners stand by again. A failure after that point is recovered from the
                grown world, in the next collective.
        """
        self.identity = list(identity)
        self.sync = None  # its groups belonged to the old world
        failure = new_objects = None
        ran: list = []
        try:
            groups = build_groups(new_layout, dist.get_rank(), timeout=self.cfg.collective_timeout_s)
            install(groups)
            self._adopt(new_layout, groups, world_changed=True, start_monitor=False)
            new_objects = self._rebuild(new_layout)
            self._apply_recovery_faults(iteration, "readmission")
            apply_transfers(transfers, old_layout, new_layout, self.rank, objects, new_objects,
                            adam_template=adam_template, ran=ran)
            new_objects.scheduler.load_state_dict(scheduler_state)
            load_loss_scale_state(new_objects.optimizer,
                                  loss_scale_state(objects.optimizer) if objects is not None else loss_scale or [])
        except RuntimeError as error:
            failure = error
        if not self._all_done("grown", dist.get_world_size(), finished=failure is None):
            raise failure or RuntimeError(f"a member of world {self.generation} failed before every member had "
                                          f"its state")
        self._record_moved(iteration, self.rank, ran)
        return new_objects
