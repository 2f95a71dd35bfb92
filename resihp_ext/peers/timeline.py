"""Failure timelines: failures arriving over a long run, and a policy's progress through them.

Responsible for drawing episodes (a GPU that fails stop until its node is repaired; a node whose
GPUs run slow for a while) as Poisson arrivals at per-GPU rates, cutting the run into segments of
constant health, and accounting a policy's work over them: iterations done, goodput (samples per
second of wall time) and the effective training time ratio (ETTR: wall time a failure-free run
would need for the same iterations, over the wall time taken). Pure: the seed is passed in.

Accounting, identical for every policy:
- At each change of health the policy answers for the health now, from the running layout as it
  was before any failure (a policy that already adapted is assumed to reach the same answer by
  its own path). A new answer's one-time cost is paid before work resumes; an unchanged answer
  costs nothing and keeps its clock (Greyhound's ski-rental keeps counting), the new health
  setting its pace.
- When an episode ends (a node repaired, a slowdown gone) the change back is planned: a restart
  writes a checkpoint first and loses no work, and an answer that would cost nothing (back to the
  original layout) costs a regroup plus one rank's state over a link for in-place policies, or a
  planned restart (``hw.restart_s`` plus one checkpoint write) after a checkpoint-restart.
- Every policy writes checkpoints at Daly's interval for the cluster's fail-stop rate and loses
  the same share of time to them; a restart also loses the work since the last checkpoint, on a
  fixed wall-clock checkpoint schedule (restarts do not shift it).
- Detection delay and the partial iteration a failure interrupts are charged to nobody.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Callable, Literal

from resihp_ext.layout import Layout
from resihp_ext.peers.checkpoint_restart import charge_lost_work, max_rank_state_bytes
from resihp_ext.peers.response import Response
from resihp_ext.planner.cost import equal_quotas, iteration_s
from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.restart import GPUS_PER_NODE

DAY_S = 86400.0
# Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024): 466 job interruptions in 54 days of
# pre-training on 16,384 H100 GPUs, 419 of them unexpected (failures) and 47 planned.
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_FAIL_STOP_PER_GPU_S = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_DAYS * DAY_S * LLAMA3_GPUS)


@dataclass(frozen=True)
class Rates:
    """How often failures start and how long they last.

    Attributes:
        fail_stop_per_gpu_s: fail-stops per GPU-second (default: Llama 3's unexpected interruptions).
        fail_slow_per_gpu_s: fail-slow onsets per GPU-second (an assumption: no comparable
            published rate; default equal to the fail-stop rate).
        repair_s: mean seconds until a failed GPU's node is back (exponential; an assumption).
        slow_s: mean seconds a fail-slow lasts (exponential; an assumption).
        max_slow_gpus: a fail-slow slows 1 to this many GPUs of one node.
    """

    fail_stop_per_gpu_s: float = LLAMA3_FAIL_STOP_PER_GPU_S
    fail_slow_per_gpu_s: float = LLAMA3_FAIL_STOP_PER_GPU_S
    repair_s: float = 4 * 3600.0
    slow_s: float = 3600.0
    max_slow_gpus: int = 8

    def __post_init__(self) -> None:
        for name in ("fail_stop_per_gpu_s", "fail_slow_per_gpu_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Rates.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("repair_s", "slow_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Rates.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Episode:
    """One failure: ``ranks`` dead (fail-stop) or at ``speed`` (fail-slow) from start to end."""

    kind: Literal["fail-stop", "fail-slow"]
    start_s: float
    end_s: float
    ranks: tuple[int, ...]
    speed: float = 0.0


def generate(world_ranks: tuple[int, ...], duration_s: float, rates: Rates, seed: int,
             gpus_per_node: int = GPUS_PER_NODE) -> tuple[Episode, ...]:
    """Episodes of a run of ``duration_s`` seconds on ``world_ranks``, sorted by start.

    Fail-stops and fail-slows arrive as independent Poisson processes at rate per GPU times GPUs.
    A fail-stop kills one GPU chosen uniformly; a fail-slow slows 1 to ``max_slow_gpus`` GPUs of
    one node to a speed drawn from [0.2, 0.8].
    """
    rng = random.Random(seed)
    ranks = list(world_ranks)
    out = []
    for kind, rate in (("fail-stop", rates.fail_stop_per_gpu_s), ("fail-slow", rates.fail_slow_per_gpu_s)):
        total = rate * len(ranks)
        t = 0.0
        while total > 0:
            t += rng.expovariate(total)
            if t >= duration_s:
                break
            if kind == "fail-stop":
                out.append(Episode(kind, t, t + rng.expovariate(1.0 / rates.repair_s), (rng.choice(ranks),)))
                continue
            node = rng.choice(ranks) // gpus_per_node
            pool = [r for r in ranks if r // gpus_per_node == node]
            slow = tuple(sorted(rng.sample(pool, rng.randint(1, min(rates.max_slow_gpus, len(pool))))))
            out.append(Episode(kind, t, t + rng.expovariate(1.0 / rates.slow_s), slow, round(rng.uniform(0.2, 0.8), 2)))
    return tuple(sorted(out, key=lambda e: e.start_s))


def segments(episodes: tuple[Episode, ...], duration_s: float) -> list[tuple[float, float, Health]]:
    """The run cut at every start and end of an episode: ``(start_s, end_s, health)``, gapless."""
    cuts = sorted({0.0, duration_s, *(t for e in episodes for t in (e.start_s, e.end_s) if t < duration_s)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        active = [e for e in episodes if e.start_s <= a < e.end_s]
        dead = frozenset(r for e in active if e.kind == "fail-stop" for r in e.ranks)
        speed: dict[int, float] = {}
        for e in active:
            if e.kind == "fail-slow":
                for r in e.ranks:
                    if r not in dead:
                        speed[r] = min(speed.get(r, 1.0), e.speed)
        out.append((a, b, Health(speed=speed, dead=dead)))
    return out


@dataclass(frozen=True)
class TimelineRun:
    """A policy's progress through a timeline.

    Attributes:
        policy: the policy's name.
        duration_s: wall seconds of the run.
        healthy_iteration_s: seconds per iteration of the failure-free run (checkpoints excluded).
        samples_per_iteration: samples in one global batch.
        pieces: per segment ``(start_s, end_s, iterations)``.
    """

    policy: str
    duration_s: float
    healthy_iteration_s: float
    samples_per_iteration: int
    pieces: tuple[tuple[float, float, float], ...]

    @property
    def iterations(self) -> float:
        return sum(p[2] for p in self.pieces)

    @property
    def goodput(self) -> float:
        """Samples per second of wall time."""
        return self.iterations * self.samples_per_iteration / self.duration_s

    @property
    def ettr(self) -> float:
        """Effective training time ratio: failure-free seconds for the same work over wall seconds."""
        return self.iterations * self.healthy_iteration_s / self.duration_s


def _signature(response: Response) -> tuple:
    plans = (response.first, response.then)
    return tuple((p.action, p.layout, p.quotas) if p is not None else None for p in plans)


def run(policy: Callable[..., Response], name: str, layout: Layout, episodes: tuple[Episode, ...], duration_s: float,
        hw: HardwareModel, *, checkpoint_interval_s: float, checkpoint_s: float, horizon_iters: int = 500,
        num_microbatches: int | None = None) -> TimelineRun:
    """Account ``policy``'s work over the timeline (see the module docstring for the rules).

    Args:
        policy: a ``resihp_ext.peers.POLICIES`` function.
        name: its name.
        layout: the layout the run starts with.
        episodes: the failures (``generate``).
        duration_s: wall seconds of the run.
        hw: cost constants.
        checkpoint_interval_s: seconds of work between checkpoints.
        checkpoint_s: seconds one checkpoint write blocks training.
        horizon_iters: passed to the policy.
        num_microbatches: micro-batches per global batch (default from the model).

    Returns:
        The TimelineRun.
    """
    num_mb = layout.model.num_microbatches if num_microbatches is None else num_microbatches
    healthy_s = iteration_s(layout, equal_quotas(layout.num_replicas, num_mb), Health(), hw)
    period_s = checkpoint_interval_s + checkpoint_s
    work_share = checkpoint_interval_s / period_s
    rejoin_in_place_s = hw.regroup_s + max_rank_state_bytes(layout, hw) / hw.link_bandwidth_Bps
    cache: dict[tuple, Response] = {}
    pieces, now, began, sig, before = [], None, 0.0, None, Health()
    for a, b, health in segments(episodes, duration_s):
        key = (tuple(sorted(health.dead)), tuple(sorted(health.speed.items())))
        if key not in cache:
            cache[key] = policy(layout, health, hw, num_microbatches=num_mb, horizon_iters=horizon_iters)
        answer = cache[key]
        if _signature(answer) != sig:
            # an episode ended: a restart is planned (checkpoint first, nothing lost); else one was forced
            better = health.dead <= before.dead and all(health.speed_of(r) >= before.speed_of(r) for r in before.speed)
            answer = charge_lost_work(answer, checkpoint_s if better else a % period_s)
            if better and now is not None and answer.first.one_time_cost_s == 0.0:
                rejoin_s = hw.restart_s + checkpoint_s if now.action == "checkpoint-restart" else rejoin_in_place_s
                answer = dataclasses.replace(answer, first=dataclasses.replace(answer.first, one_time_cost_s=rejoin_s))
            sig, began = _signature(answer), a
            current = answer
        else:
            # the same layout and quotas: nothing is paid again, but the new health sets the pace
            current = dataclasses.replace(answer, first=dataclasses.replace(
                answer.first, one_time_cost_s=current.first.one_time_cost_s), then=current.then and answer.then and
                dataclasses.replace(answer.then, one_time_cost_s=current.then.one_time_cost_s))
        now, before = current.final, health
        done = current.iterations_in(b - began) - current.iterations_in(a - began)
        pieces.append((a, b, done * work_share if math.isfinite(done) else 0.0))
    return TimelineRun(name, duration_s, healthy_s, num_mb * layout.model.micro_batch_size, tuple(pieces))
