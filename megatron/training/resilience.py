"""The training loop's resilience hooks: fault injection, detection, adaptation.

Responsible for executing what ``resihp_ext`` decides, at iteration boundaries: applying
injected faults to this process (stretching compute, SIGKILL, hanging), feeding op timings to the
detector, logging its suspicions and verdicts, and applying plans that need no regrouping
(micro-batch quotas across DP replicas) in place. ``build_resilience`` returns ``None`` when no
``--resihp-*`` feature is on, so the loop then runs exactly like stock Megatron.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.training.detection import LiveDetector, describe
from megatron.training.logging_utils import EventLog, log_line
from megatron.training.schedules import RECORDER
from resihp_ext.faults import FaultKind
from resihp_ext.layout import Layout, ModelSpec
from resihp_ext.planner.baselines import dp_only
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.traces import observation_to_dict
from resihp_ext.validation import Verdict


def current_layout(args: argparse.Namespace) -> Layout:
    model = ModelSpec(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
    )
    return Layout.uniform(model, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          args.data_parallel_size, tuple(args.layers_per_stage))


class ResilienceHooks:
    def __init__(self, args: argparse.Namespace, events: EventLog):
        self.args = args
        self.cfg = args.resihp
        self.events = events
        self.rank = dist.get_rank()
        self.replica_index = parallel_state.get_data_parallel_rank()
        self.faults = [f for f in self.cfg.faults if f.rank == self.rank]
        self.layout = current_layout(args)
        self.live = None
        if self.cfg.detection_on:
            device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
            self.live = LiveDetector(
                self.cfg, self.rank, self.replica_index, parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank(), device,
            )
        self.trace = None
        if self.cfg.trace and self.rank == 0:
            self.trace = open(self.cfg.trace, "w", encoding="utf-8")
            header = {"format": "resihp-trace", "version": 1, "source": "live", "tp": args.tensor_model_parallel_size,
                      "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size,
                      "faults": [f.spec() for f in self.cfg.faults]}
            self.trace.write(json.dumps(header) + "\n")

    def _apply_faults(self, iteration: int) -> None:
        for fault in self.faults:
            if fault.at_iteration != iteration:
                continue
            self.events.emit("inject", iteration, fault=fault.spec())
            log_line(f" rank {self.rank}: injecting {fault.spec()}")
            if fault.kind is FaultKind.SLOW:
                RECORDER.slowdown_factor = fault.factor
            elif fault.kind is FaultKind.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind is FaultKind.HANG:
                while True:  # a hung rank: alive, holding its sockets, making no progress
                    time.sleep(3600)

    def before_iteration(self, iteration: int, objects, quotas):
        self._apply_faults(iteration)
        return objects, quotas

    def after_iteration(self, iteration: int, elapsed_s: float, result, objects, quotas):
        if self.live is None:
            return objects, quotas
        mine = self.live.observation(result.iteration_s, result.ops, result.features)
        gathered, found = self.live.observe(iteration, mine)
        if self.trace is not None:
            for obs in gathered:
                self.trace.write(json.dumps(observation_to_dict(iteration, obs)) + "\n")
        if found is None:
            return objects, quotas
        suspicion, outcome = found
        if self.rank == 0:
            self._emit(suspicion.to_event())
            self._emit(outcome.to_event())
            log_line(f" resihp: suspicion at iteration {iteration}: {suspicion.reason}")
            log_line(f" resihp: {describe(outcome)}")
        if isinstance(outcome, Verdict) and self.cfg.enable:
            quotas = self._replan_quotas(iteration, outcome, quotas)
        return objects, quotas

    def _emit(self, event: dict) -> None:
        event = dict(event)
        self.events.emit(event.pop("event"), event.pop("iteration"), **event)

    def _replan_quotas(self, iteration: int, verdict: Verdict, quotas):
        """Apply the part of a plan that needs no regrouping: micro-batch quotas per replica.

        Every rank computes the same plan from the same verdict (pure, deterministic), so no
        agreement round is needed for it.
        """
        start = time.perf_counter()
        health = Health(speed={r: 1.0 / max(verdict.factor or 1.0, 1.0) for r in verdict.ranks})
        plan = plan_adaptation(self.layout, health, current_quotas=tuple(quotas))
        if plan.action == "adapt" and plan.layout != self.layout:
            # Layout changes (TP exclusion, PP repartition) need regrouping and resharding,
            # which this loop does not execute yet: apply the quota-only plan instead.
            plan = dp_only(self.layout, health, current_quotas=tuple(quotas))
        new_quotas = list(plan.quotas) if plan.action == "adapt" else list(quotas)
        duration = time.perf_counter() - start
        if self.rank == 0:
            self.events.emit("plan", iteration, action=plan.action, policy=plan.policy, reason=plan.reason,
                             quotas=new_quotas, predicted_iteration_s_before=plan.iteration_s_before,
                             predicted_iteration_s_after=plan.iteration_s_after)
            log_line(f" resihp: plan ({plan.policy}, {plan.action}): {plan.reason}")
        if new_quotas != list(quotas):
            if self.rank == 0:
                self.events.emit("adapted", iteration, world_size=dist.get_world_size(), quotas=new_quotas,
                                 duration_s=duration)
                log_line(f" resihp: adapted in place at iteration {iteration}: micro-batch quotas "
                         f"{list(quotas)} -> {new_quotas} ({duration * 1000:.1f} ms)")
            self.live.detector.reset(forget_predictor=False)
        return new_quotas

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.live is not None and self.rank == 0:
            self.events.emit("detector_overhead", -1, decision_s=self.live.decision_s)


def build_resilience(args: argparse.Namespace, events: EventLog, objects) -> ResilienceHooks | None:
    cfg = args.resihp
    if not (cfg.detection_on or cfg.inject):
        return None
    return ResilienceHooks(args, events)
