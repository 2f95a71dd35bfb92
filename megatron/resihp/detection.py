"""Live fail-slow detection: bring every rank's op timings to one rank, run validation probes, report.

Responsible for the collective side of detection: each rank turns its recorded ops into a
``RankObservation`` and sends it to the deciding rank (``decider_rank``), which runs the pure
``FailSlowDetector`` on all of them. A suspicion triggers a probe round (a fixed GEMM timed on the
suspects and their references, stretched like real compute when a slowdown is injected), which
the detector concludes. Decisions are never made here.

One rank decides, and the others do not wait for it. After iteration ``i`` every rank sends its
observation without waiting; the decider judges it and sends every rank a ``Command``: the probe
rounds to run after iteration ``i + 1`` and the compute costs fitted up to iteration ``i``. The
others read it after ``i + 1``, when it has long arrived. So a probe round runs one iteration
after the suspicion it tests, and a verdict comes one iteration later than if every rank
decided. What that buys: with every rank deciding, each iteration ended in an all-gather of
every rank's timings, which held every rank until the slowest arrived, and the same decision ran
on every rank; on 8 ranks sharing 2 cores the two cost 6-8% of each iteration. A probe step is a
collective anyway: after one, the decider broadcasts what it settled and its next command, so
every rank acts on a verdict at the same iteration and nothing is left in flight when a re-plan
changes the groups. The decider judges in its training thread: on a thread of its own it would
share the GIL with the training thread, and delays of its sends would read as slow links.

The decider is the first rank of replica 0's last pipeline stage. Every iteration ends in the
loss's all-reduce over the world, so all ranks start the next one together, and a last stage
waits for its first activations while the stages before it each run a forward: judging there costs
the job nothing until it takes longer than that. Judging on rank 0, the first stage, delays every
stage behind it by all of its time, which at 1,024 ranks is 2.3% of an iteration
(``scripts/bench/decider_scaling.py``). With one stage it is rank 0, as before. Each world chooses
its decider when its detectors are built; a re-plan within a world keeps it.

Messages travel on a gloo group of the whole world (the world group itself on CPU): a CPU control
plane that neither touches the accelerator nor opens a communicator per pair of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.resihp.link_faults import LINKS
from megatron.resihp.logging_utils import exit_with_error, log_line, ranks_name, world_numbered
from megatron.resihp.object_messages import Outbox, PostedReceive
from megatron.resihp.schedules import RECORDER, wait_until
from resihp_ext.detection.confirmation import PendingVerdicts, ProbePlan
from resihp_ext.detection.detector import FailSlowDetector, RankObservation
from resihp_ext.detection.observations import Suspicion
from resihp_ext.detection.observation_wire import packed
from resihp_ext.detection.op_signals import op_tables
from resihp_ext.planner.calibration import FIT_WINDOW, ComputeCosts, fit_compute_costs, pooled_costs
from resihp_ext.detection.validation import Cleared, ProbeResults, Verdict, pass_normalised_times, undecided
from resihp_ext.schedule import Interleaving

_OBSERVATION_TAG, _COMMAND_TAG = 7301, 7302

# The probe GEMM's side per device type. On a GPU it must be compute-bound: 8 GEMMs of 256 took
# 0.2 ms on an H100, the time of their kernel launches, which a throttled GPU would barely change.
# 2048 is ~17 GFLOP per GEMM, a few ms for the eight in fp32.
_PROBE_SIZE = {"cpu": 256, "cuda": 2048}
_PROBE_REPEATS = 8
_PROBE_PASSES = 5  # samples per probed rank or link in a round, one per pass
_PROBE_EXTENSIONS = 2  # further sets of passes an undecided rank probe round may take
_BASELINE_ROUNDS = 7  # probe rounds behind a one-stage-group job's own baselines (see measure_probe_baselines)
# Link probes send what the pipeline sends (one micro-batch's activations), and at least this much,
# so bandwidth rather than per-message latency dominates their time.
_MIN_LINK_PROBE_BYTES = 64 << 10


@contextlib.contextmanager
def on_probe_core(device: torch.device):
    """On CPU, run the calling thread on the first core it may use for the duration: every unpinned
    rank's GEMM probe then runs on the same core, and probes compare ranks, not cores. A core of a
    shared host runs at speeds up to 1.6x apart for seconds at a time, each core on its own (two
    cores probed side by side: 2.6 ms on one while 4.0 on the other, and the other way round a
    second later). Two healthy ranks of four on two cores, probed in turn, by their fastest
    samples: unpinned, 25 of 75 rounds read them 1.2x apart or more; on one core, 6 of 75 (2 with
    ``pass_normalised_times``; ``scripts/bench/probe_noise.py``).
    A rank pinned to a core of its own (``cpu_affinity``) stays there: that core is its device.
    Elsewhere (a GPU per rank, or no affinity control) it changes nothing."""
    if device.type != "cpu" or not hasattr(os, "sched_setaffinity"):
        yield
        return
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cores)


def gemm_probe_s(device: torch.device, samples: int = 5, one_core: bool = True) -> float:
    """Busy seconds of a fixed GEMM workload on this rank, as slow as its real compute.

    Timed like the training ops (``RECORDER.run_timed``: busy clock, injected slowdown, emulated device).
    The minimum over ``samples`` runs: the work is fixed, so interference can only add time, and
    the fastest run is the device's own speed. Runs ``on_probe_core`` unless ``one_core`` is False
    (``scripts/bench/probe_noise.py`` measures what that changes).
    """
    size = _PROBE_SIZE.get(device.type, _PROBE_SIZE["cpu"])
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    times = []
    with on_probe_core(device) if one_core else contextlib.nullcontext():
        for _ in range(samples):
            a, _, busy = RECORDER.run_timed(_gemm_chain, a, b)
            times.append(busy)
    return min(times)


def _gemm_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    for _ in range(_PROBE_REPEATS):
        a = torch.tanh(a @ b)
    return a


def link_probe_bytes(args) -> int:
    """Bytes of the fixed link probe: one micro-batch's activations at a pipeline boundary.

    Sized like the traffic it stands for, a probe of a slowed link costs what one slowed transfer
    costs, however small the model (a fixed multi-MiB probe would take seconds on a slow link of a
    small model, and say nothing more).
    """
    element = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    activation = args.micro_batch_size * args.seq_length * args.hidden_size * element
    return max(activation, _MIN_LINK_PROBE_BYTES) // 4 * 4


def link_probe_s(src: int, dst: int, device: torch.device, num_bytes: int, samples: int = 5) -> float | None:
    """Seconds to send ``num_bytes`` from ``src`` to ``dst`` (called on both; others skip).

    ``src`` times the transfer up to a one-element acknowledgement from ``dst``, so the time is the
    link's, not when either side got round to it. The minimum over ``samples`` transfers, as for
    the GEMM probe. An injected slowdown of the link applies, as to every transfer on it.

    Returns:
        The seconds on ``src``; None on ``dst``.
    """
    me = dist.get_rank()
    payload = torch.zeros(num_bytes // 4, device=device)
    ack = torch.zeros(1, device=device)
    times = []
    for _ in range(samples):
        if me == src:
            start = time.perf_counter()
            LINKS.delay(dst, num_bytes)
            dist.send(payload, dst)
            dist.recv(ack, dst)
            times.append(time.perf_counter() - start)
        elif me == dst:
            dist.recv(payload, src)
            dist.send(ack, src)
    return min(times) if times else None


def link_seconds_per_byte(src: int, dst: int, device: torch.device, num_bytes: int) -> float | None:
    """The healthy link's seconds per byte from ``src`` to ``dst`` (on ``src``; None on ``dst``),
    which an injected link fault multiplies. The fastest of 20 transfers: it is taken once, and
    the fastest of 5 on a 2-core host whose other ranks were computing read 8.5 ms/MiB where it
    reads 1.0-2.5, so a 1000x fault ran 3,650x slow."""
    seconds = link_probe_s(src, dst, device, num_bytes, samples=20)
    return None if seconds is None else seconds / num_bytes


def healthy_link_bandwidth_Bps(probes: ProbeResults | None, slow: set[tuple[int, int]],
                               num_bytes: int) -> float | None:
    """Bytes/s of the links a probe round of ``num_bytes`` probes found healthy (their median), or
    None if it probed none."""
    if probes is None:
        return None
    seconds = sorted(s for link, s in probes.link_s.items() if link not in slow and s > 0)
    return num_bytes / seconds[len(seconds) // 2] if seconds else None


def decider_rank(layout) -> int:
    """The rank that judges: the first rank of replica 0's last pipeline stage (see the module's
    docstring for why there). ``RESIHP_DECIDER=first`` makes it rank 0 (measurement only:
    ``scripts/bench/decider_placement.py``)."""
    placement = os.environ.get("RESIHP_DECIDER", "last")
    if placement not in ("first", "last"):
        exit_with_error(f"RESIHP_DECIDER must be 'first' (rank 0) or 'last' (the first rank of replica 0's last "
                        f"stage, the default), got {placement!r}")
    return 0 if placement == "first" else layout.replicas[0].stages[-1].ranks[0]


PAD_PERIOD = 4  # RESIHP_JUDGING_PAD_S pads the judgement after every 4th iteration


def judging_pad_s() -> float:
    """``RESIHP_JUDGING_PAD_S``: the judgement after every 4th iteration lasts at least this many
    seconds, waited out in the decider's training thread, as judging a job of many more ranks
    would; the iterations between time the same run without it (measurement only:
    ``scripts/bench/decider_placement.py``). 0 when unset."""
    value = os.environ.get("RESIHP_JUDGING_PAD_S", "0")
    try:
        pad = float(value)
    except ValueError:
        pad = -1.0
    if not 0.0 <= pad < 60.0:
        exit_with_error(f"RESIHP_JUDGING_PAD_S must be seconds in [0, 60), got {value!r}")
    return pad


def job_clock_offset() -> float:
    """Offset turning this rank's ``perf_counter`` into seconds since a job-wide origin.

    Link gaps compare one rank's op end with another's op start, so all ranks' op times must share
    an origin. Wall clocks agree exactly on one host and to NTP precision across hosts; rank 0's
    wall time at start-up is the origin (collective).
    """
    origin = [time.time()]
    dist.broadcast_object_list(origin, src=0)
    return (time.time() - time.perf_counter()) - origin[0]


@dataclass(frozen=True)
class Command:
    """What the decider tells every rank after judging an iteration.

    Attributes:
        iteration: the iteration judged.
        probes: the suspicion behind each probe round to run at the next detection step, in order.
        costs: compute costs pooled over the latest fits, the iteration's included (None when its
            ops held no full op pair).
    """

    iteration: int
    probes: tuple[Suspicion, ...]
    costs: ComputeCosts | None


class LiveDetector:
    """One per rank; call ``observe`` on every rank after every iteration (``decider_rank`` decides; probe
    steps are collective over the world group)."""

    def __init__(self, config, rank: int, replica: int, stage: int, tp_rank: int, device: torch.device,
                 layout_getter, link_probe_bytes: int = _MIN_LINK_PROBE_BYTES, group=None,
                 interleaving: Interleaving = Interleaving()):
        self.config = config
        self.interleaving = interleaving
        self.link_probe_bytes = link_probe_bytes
        self.rank, self.replica, self.stage, self.tp_rank = rank, replica, stage, tp_rank
        self.device = device
        self.layout_getter = layout_getter

        def signature(replica: int, stage: int, tp_degree: int):
            # Stages that run the same number of layers at the same TP degree share one cost fit.
            return (stage, tp_degree, layout_getter().replicas[replica].stages[stage].num_layers)

        self.detector = FailSlowDetector(config, stage_signature=signature, interleaving=interleaving)
        # Time spent in the pure decision logic (for the overhead figures): wall and CPU.
        self.decision_s = self.decision_cpu_s = 0.0
        self.clock_offset_s = job_clock_offset()
        self.probe_rounds: list[ProbeResults] = []  # this iteration's, in the order they ran
        self.pending = PendingVerdicts.from_config(config)
        self.probe_baselines: dict[int, float] = {}
        self.refined_baselines: dict[int, float] | None = None  # set by the iteration that refined them
        self._baseline_ranks: list[int] = []
        self._baseline_rounds_left = 0
        self._baseline_due = 0  # observed iterations until the next baseline round
        self._baseline_spacing = 1
        self.world_size = dist.get_world_size()
        self.decider = decider_rank(layout_getter())
        self.judging_pad_s = judging_pad_s()
        # The world's message group, made by the group builder (``parallel_state_patch.message_group``).
        self.group = group
        self.outbox = Outbox()
        self.costs: ComputeCosts | None = None  # the latest command's: every rank holds the same
        self._fits: deque[ComputeCosts] = deque(maxlen=FIT_WINDOW)  # decider: the latest fits, pooled
        self._next: Command | None = None  # delivered: its probes run at the next step
        self._in_flight: Command | None = None  # decider: sent point-to-point, delivered at the next step
        # The others: the receive of a command sent point-to-point, to be read at the next step.
        self._awaiting: PostedReceive | None = None
        self._posted: list[PostedReceive] | None = None  # decider: receives of the next observations
        self._plan: ProbePlan | None = None  # decider: the plan behind the next step's probes
        self._lost: RuntimeError | None = None  # a receive that failed, left to the next iteration

    def measure_probe_baselines(self, rounds: int = _BASELINE_ROUNDS) -> dict[int, float]:
        """Time each rank's GEMM probe, one rank at a time (collective), when the layout has no
        second stage group to probe beside a suspect (one stage, one replica): the detector then
        compares a suspect's probe with the rank's own healthy time. Call before training: the
        first round runs now, the others after iterations 1, 2, 4, 8, ... (``rounds`` in all), and
        each rank's baseline is its fastest. One round at start-up is not enough on a shared host:
        one came out 27% above the device's speed, and a 1.5x slowdown then probed 1.19x and was
        cleared four times. Nor are rounds on consecutive iterations: a core of a shared host runs
        at one of two speeds 1.6x apart for seconds at a time, and five rounds within one second
        all fell in its slow spell (a 4x slowdown then probed 2.4x against them, a 2x one 2.05x).
        Spread out, they span that long. Returns the baselines ({} when not needed)."""
        layout = self.layout_getter()
        groups = [stage.ranks for replica in layout.replicas for stage in replica.stages]
        if not self.detector.needs_probe_baselines(groups):
            return {}
        self._baseline_ranks = sorted(r for g in groups for r in g)
        self._baseline_rounds_left = rounds
        self._baseline_due = self._baseline_spacing = 1
        return self._refine_probe_baselines()

    def _refine_probe_baselines(self) -> dict[int, float]:
        times = self._probe_ranks(self._baseline_ranks)
        self.probe_baselines = {r: min(t, self.probe_baselines.get(r, t)) for r, t in times.items()}
        self.detector.set_probe_baselines(self.probe_baselines)
        self._baseline_rounds_left -= 1
        return dict(self.probe_baselines)

    def _baseline_round_due(self) -> dict[int, float] | None:
        """After an observed iteration: a baseline round's baselines if one is due, else None (collective)."""
        if self._baseline_rounds_left <= 0:
            return None
        self._baseline_due -= 1
        if self._baseline_due > 0:
            return None
        self._baseline_due = self._baseline_spacing
        self._baseline_spacing *= 2
        return self._refine_probe_baselines()

    def observation(self, iteration_s: float, ops, features, busy=()) -> RankObservation:
        shift = self.clock_offset_s
        return RankObservation(
            rank=self.rank, replica=self.replica, stage=self.stage, tp_rank=self.tp_rank,
            ops=tuple((k, mb, s + shift, e + shift) for k, mb, s, e in ops),
            features=tuple(tuple(f) for f in features), iteration_s=iteration_s, busy=tuple(busy),
        )

    def observe(self, iteration: int, mine: RankObservation) -> tuple[list[RankObservation] | None, list]:
        """Send this iteration's observation to the decider, run the probe rounds the last command
        asked for, and (on the decider) judge this iteration.

        Returns:
            (every rank's observation on the decider, None elsewhere; the ``(suspicion, Verdict |
            Cleared)`` pairs settled at this iteration, the same on every rank: confirmed or
            dropped verdicts, and outcomes that need no confirmation).
        """
        if self._lost is not None:  # a whole iteration ran since, and nothing failed: not a lost peer
            raise self._lost
        mine = packed(mine)  # as it travels, and as the decider reads every rank's op tables
        deciding = self.deciding
        gathered = None
        try:
            if deciding:
                posted = self._posted or self._post_observation_receives()
                gathered = [receive.take() for receive in posted]
                gathered.insert(self.decider, mine)  # every rank's, in rank order
                # Next iteration's observations can arrive while this rank computes.
                self._posted = self._post_observation_receives()
            else:
                self.outbox.send(mine, [self.decider], _OBSERVATION_TAG, self.group)
                if self._awaiting is not None:
                    self._deliver(self._awaiting.take())
                    self._awaiting = None
        except RuntimeError as error:
            # A peer that finished its iteration, sent its message and then died (or a decider that
            # died after sending its command) fails this receive before anyone runs the next
            # iteration. Its failure is left to the next iteration's collectives, where every rank
            # meets it before its optimizer step, as when every iteration ended in a collective:
            # all ranks then redo the same iteration. This iteration is not judged.
            self._lost = error
            return None, []
        if deciding and self._in_flight is not None:
            self._deliver(self._in_flight)
            self._in_flight = None
        command, self._next = self._next, None
        self.probe_rounds = []
        # Every rank holds the same command, so all of them probe and wait alike.
        rounds = [self._probe(iteration, s) for s in (command.probes if command is not None else ())]
        settled: list = []
        if deciding and rounds:
            settled = self.pending.settle_probed(self.detector, iteration, self._plan, rounds)
        self.refined_baselines = self._baseline_round_due()
        if rounds:
            # The probes held every rank here anyway: decide now, and hand out the outcome and the
            # next command at once.
            following = self._decide(iteration, gathered) if deciding else None
            shared = [(settled, following)]
            dist.broadcast_object_list(shared, src=self.decider, group=self.group)
            settled, following = shared[0]
            self._deliver(following)
        else:
            try:
                if deciding:
                    following = self._decide(iteration, gathered)
                    self._in_flight = following
                    self.outbox.send(following, self._others(), _COMMAND_TAG, self.group)
                else:
                    self._awaiting = PostedReceive(self.decider, _COMMAND_TAG, self.group)
            except RuntimeError as error:  # a peer that died since it sent: as above
                self._lost = error
        return gathered, settled

    @property
    def deciding(self) -> bool:
        """Whether this rank is the one that judges (and holds every rank's observations)."""
        return self.rank == self.decider

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.decider]

    def _post_observation_receives(self) -> list[PostedReceive]:
        return [PostedReceive(r, _OBSERVATION_TAG, self.group) for r in self._others()]

    def _decide(self, iteration: int, gathered: list[RankObservation]) -> Command:
        start, cpu_start = time.perf_counter(), time.thread_time()
        tables = op_tables(gathered)  # built once, for the detector and the cost fit
        suspicion = self.detector.observe(iteration, gathered, tables)
        self._plan = self.pending.plan_probes(iteration + 1, suspicion)
        fit = fit_compute_costs(iteration, gathered, self.layout_getter(), tables, self.interleaving,
                                self.detector.known_slowdowns)
        if fit is not None:
            if not self._fits and self.costs is not None:  # a new decider starts from what it was handed
                self._fits.append(self.costs)
            self._fits.append(fit)
        command = Command(iteration, tuple(self._plan.subjects), pooled_costs(self._fits) if fit else None)
        if self.judging_pad_s and iteration % PAD_PERIOD == 0:
            wait_until(start + self.judging_pad_s)
        self.decision_s += time.perf_counter() - start
        self.decision_cpu_s += time.thread_time() - cpu_start
        return command

    def _deliver(self, command: Command) -> None:
        self._next = command
        if command.costs is not None:
            self.costs = command.costs

    def start_over(self) -> None:
        """After a re-plan (or its roll-back) in this world: the detector starts over on the new
        layout, priced by the planner's costs (``price_plan``), and the probe rounds planned on the
        old one are dropped (call on every rank). The cost models are kept: each is a stage shape's
        (stage, TP degree, layers), in a healthy device's time (a known slowdown divided out), so a
        shape the re-plan keeps is judged on its fit at once, and a new one learns its own."""
        self.detector.reset(forget_predictor=False)
        self.price_plan()
        self.drop_planned_probes()

    def price_plan(self) -> None:
        """Hand the detector what the pooled costs price each stage group of the current layout at:
        a group is judged on that price until its own cost model fits (none before the first fit)."""
        if self.costs is not None:
            self.detector.plan(self.costs.group_microbatch_s(self.layout_getter()))

    def drop_planned_probes(self) -> None:
        """Forget the probe rounds planned for the next step, on the layout a re-plan just replaced
        (call on every rank; a re-plan follows a probe step, so every rank holds the command).
        Verdicts that were due wait for the step after."""
        if self._next is not None:
            self._next = dataclasses.replace(self._next, probes=())
        if self._plan is not None:
            self.pending.put_back(self._plan)
            self._plan = None

    def _probe(self, iteration: int, suspicion) -> ProbeResults:
        probes = ProbeResults(iteration=iteration, rank_s=self._probe_ranks(suspicion.probe_ranks, suspicion.ranks),
                              link_s=self._probe_links(suspicion.probe_links))
        self.probe_rounds.append(probes)
        return probes

    def _probe_ranks(self, ranks, suspects=()) -> dict[int, float]:
        """GEMM probe on each listed rank (collective; see ``_samples_in_passes``): each rank's
        seconds relative to the others' in the same passes (``pass_normalised_times``).

        A round that is ``undecided`` (no probe slow against the round, yet the slowest well above
        the fastest) takes more passes, up to ``_PROBE_EXTENSIONS`` times, and is judged on all of
        them: a host's slow spell that held some references back passes, a slow device does not.
        Every rank sees the same gathered samples, so all decide alike.
        """
        subjects, own = sorted(ranks), []
        for extension in range(_PROBE_EXTENSIONS + 1):
            mine = self._samples_in_passes(subjects, lambda rank: gemm_probe_s(self.device, samples=1)
                                           if rank == self.rank else None)
            own.extend(mine.get(self.rank, ()))
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, own)
            chosen = pass_normalised_times({r: gathered[r] for r in subjects})
            round_s = {r: chosen.get(r, 0.0) for r in subjects}
            if not undecided(round_s, self.config.probe_threshold, suspects):
                break
            if self.deciding and extension < _PROBE_EXTENSIONS:
                readings = ", ".join(f"{r}: {t * 1e3:.2f}" for r, t in round_s.items())
                log_line(f" resihp: probes undecided (ms: {readings}), probing ranks {subjects} again")
        return round_s

    def _probe_links(self, links) -> dict[tuple[int, int], float]:
        """p2p probe on each listed link (collective; see ``_samples_in_passes``): each link's fastest sample."""
        mine = self._samples_in_passes(links, lambda link: link_probe_s(*link, self.device, self.link_probe_bytes,
                                                                        samples=1) if self.rank in link else None)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {link: min(seconds) for link, seconds in mine.items()})
        return {link: seconds for table in gathered for link, seconds in table.items()}

    @staticmethod
    def _samples_in_passes(subjects, sample) -> dict[object, list[float]]:
        """Each subject's ``_PROBE_PASSES`` samples, in pass order, one subject at a time (collective).

        ``sample(subject)`` returns this rank's seconds for it, or None where this rank takes no
        part (such subjects are absent from the result). One at a time because ranks may share
        cores or a power budget (always on CPU): probing concurrently would measure contention
        between them, not each device's speed. In passes, one sample of each subject per pass, so
        the suspects' samples and their references' spread over the same span: a host busy for
        part of the round slows both alike, where each subject's samples back to back could all
        fall in the busy part for the suspect alone.
        """
        samples: dict = {}
        for _ in range(_PROBE_PASSES):
            for subject in subjects:
                seconds = sample(subject)
                if seconds is not None:
                    samples.setdefault(subject, []).append(seconds)
                dist.barrier()
        return samples


def describe(outcome: Verdict | Cleared, identity=None) -> str:
    """A verdict or clearance for the log: its ranks as launch ranks (``identity``: the current
    world's ``RunState.identity``), its reason as the detector wrote it, in world ranks."""
    if isinstance(outcome, Verdict):
        factor = "" if outcome.factor is None else f" factor {outcome.factor:.2f}x"
        return (f"verdict {outcome.kind} {ranks_name(outcome.ranks, identity)}{factor}: "
                f"{world_numbered(outcome.reason, identity)}")
    return f"cleared {ranks_name(outcome.ranks, identity)}: {world_numbered(outcome.reason, identity)}"
