"""Detection traces: the JSONL format live runs record, and synthetic traces at cluster shapes.

Format (one JSON object per line, UTF-8):

    {"format": "resihp-trace", "version": 1, "layout": {"tp": 8, "pp": 4, "dp": 8},
     "num_microbatches": 8, "num_chunks": 1, "faults": ["slow:rank=3,factor=1.5,at=200"], ...}  <- header
    {"iteration": 17, "rank": 3, "replica": 0, "stage": 0, "tp_rank": 3,
     "ops": [["F", 0, 0.0012, 0.0523], ...], "features": [[8192, 2310412, 97], ...],
     "iteration_s": 1.734}                                                       <- one per rank

    {"event": "probe", "iteration": 19, "rank_s": {"3": 0.0151, "4": 0.0101},
     "link_s": [[3, 11, 0.0049]], "unresponsive": []}                            <- optional
    {"event": "probe_baselines", "rank_s": {"0": 0.0019}}          <- optional, the last one counts

``ops`` items are ``[kind, microbatch, start_s, end_s]`` (or objects with those keys; under the
interleaved schedule, ``num_chunks`` above 1, ``microbatch`` is the op's column: the k-th op of
its kind on the stage, one model chunk's),
``features`` items ``[num_tokens, sum_sq, num_docs]`` (or objects with those keys; traces without
the document count are read with 0 there); the optional ``busy``
holds each op's device seconds (see ``RankObservation.busy``). The loader is
tolerant: blank lines and lines starting with ``#`` are skipped, unknown keys are ignored, the
header is optional (the layout is then inferred from the rows), and malformed rows are counted in
``Trace.skipped`` instead of aborting the load.

The synthetic generator draws document lengths from ``resihp_ext.workload``, costs micro-batches
with a true ``alpha``/``beta``, adds multiplicative noise, walks the 1F1B schedule (or the
interleaved one, ``SyntheticSpec.num_chunks``) with
``resihp_ext.detection.simulator`` and injects ``resihp_ext.faults.Fault`` values. Ranks are numbered
Megatron's default way: ``rank = tp_rank + tp * (replica + dp * stage)``.

This module reads and writes files only in ``load_trace``/``save_trace``; it never decides.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from resihp_ext.detection.detector import RankObservation
from resihp_ext.faults import Fault, FaultKind, parse_fault
from resihp_ext.schedule import Interleaving, OpKind
from resihp_ext.detection.simulator import simulate_iteration
from resihp_ext.detection.validation import ProbeResults
from resihp_ext.workload import LengthDistribution, microbatch_features, sample_packed_workload

FORMAT = "resihp-trace"
VERSION = 1


@dataclass(frozen=True)
class Trace:
    """A loaded trace.

    Attributes:
        header: the header object (``{}`` if the file had none; ``layout`` is then inferred).
        iterations: iteration -> observations of that iteration, in file order.
        skipped: malformed lines that were skipped.
        probes: iteration -> the validation-probe rounds recorded after it, in the order they ran
            (live runs only; a step can run several: the second rounds of verdicts that are due,
            then a new suspicion's first).
        probe_baselines: rank -> healthy GEMM probe seconds (the last ``probe_baselines`` row;
            live one-stage-group jobs only).
    """

    header: dict
    iterations: dict[int, tuple[RankObservation, ...]]
    skipped: int = 0
    probes: dict[int, tuple[ProbeResults, ...]] = field(default_factory=dict)
    probe_baselines: dict[int, float] = field(default_factory=dict)

    def interleaving(self) -> Interleaving:
        """The schedule the trace's ops ran under (the header's ``num_chunks``; 1F1B without it)."""
        return Interleaving(int(self.header.get("num_chunks", 1)))

    def faults(self) -> tuple[Fault, ...]:
        """The faults the header says were injected (``--resihp-inject`` specs)."""
        return tuple(parse_fault(spec) for spec in self.header.get("faults", []))


def observation_to_dict(iteration: int, obs: RankObservation) -> dict:
    """One trace row."""
    return {
        "iteration": iteration,
        "rank": obs.rank,
        "replica": obs.replica,
        "stage": obs.stage,
        "tp_rank": obs.tp_rank,
        "ops": [[k, m, round(a, 7), round(b, 7)] for k, m, a, b in obs.ops],
        "features": [[int(x) for x in f] for f in obs.features],
        "iteration_s": obs.iteration_s,
        **({"busy": [round(b, 7) for b in obs.busy]} if obs.busy else {}),
    }


def observation_from_dict(row: dict) -> tuple[int, RankObservation]:
    """Parse one trace row; raise ``ValueError`` saying what is wrong."""
    try:
        ops = []
        for op in row["ops"]:
            if isinstance(op, dict):
                op = (op["kind"], op["microbatch"], op["start_s"], op["end_s"])
            kind = op[0].value if isinstance(op[0], OpKind) else str(op[0])
            ops.append((kind, int(op[1]), float(op[2]), float(op[3])))
        features = []
        for item in row["features"]:
            if isinstance(item, dict):
                item = (item["num_tokens"], item["sum_sq"], item.get("num_docs", 0))
            features.append(tuple(int(x) for x in item[:3]))
        obs = RankObservation(
            rank=int(row["rank"]),
            replica=int(row.get("replica", 0)),
            stage=int(row.get("stage", 0)),
            tp_rank=int(row.get("tp_rank", 0)),
            ops=tuple(ops),
            features=tuple(features),
            iteration_s=float(row["iteration_s"]),
            busy=tuple(float(b) for b in row.get("busy", ())),
        )
        return int(row["iteration"]), obs
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"trace row lacks or mistypes a field ({exc!r}); see resihp_ext/detection/traces.py for the format") from None


def probe_to_dict(probes: ProbeResults) -> dict:
    """One probe row."""
    return {
        "event": "probe",
        "iteration": probes.iteration,
        "rank_s": {str(r): t for r, t in probes.rank_s.items()},
        "link_s": [[a, b, t] for (a, b), t in probes.link_s.items()],
        "unresponsive": sorted(probes.unresponsive),
    }


def probe_baselines_to_dict(rank_s) -> dict:
    """A trace row with each rank's healthy GEMM probe seconds (a one-stage-group job's own
    references; the last such row of a trace holds the final ones)."""
    return {"event": "probe_baselines", "rank_s": {str(r): s for r, s in sorted(rank_s.items())}}


def probe_from_dict(row: dict) -> ProbeResults:
    """Parse one probe row."""
    return ProbeResults(
        iteration=int(row["iteration"]),
        rank_s={int(r): float(t) for r, t in row.get("rank_s", {}).items()},
        link_s={(int(a), int(b)): float(t) for a, b, t in row.get("link_s", [])},
        unresponsive=frozenset(int(r) for r in row.get("unresponsive", [])),
    )


def save_trace(
    path: str,
    header: dict,
    iterations: Iterable[tuple[int, Sequence[RankObservation]]],
    probes: Iterable[ProbeResults] = (),
) -> int:
    """Write a trace; returns the number of observation rows written."""
    rows = 0
    with open(path, "w", encoding="utf-8") as out:
        out.write(json.dumps({"format": FORMAT, "version": VERSION, **header}) + "\n")
        for iteration, observations in iterations:
            for obs in observations:
                out.write(json.dumps(observation_to_dict(iteration, obs)) + "\n")
                rows += 1
        for probe in probes:
            out.write(json.dumps(probe_to_dict(probe)) + "\n")
    return rows


def load_trace(path: str) -> Trace:
    """Read a trace written by ``save_trace`` or by a live run (tolerant; see module doc)."""
    header: dict = {}
    per_iter: dict[int, list[RankObservation]] = defaultdict(list)
    probes: dict[int, tuple[ProbeResults, ...]] = {}
    baselines: dict[int, float] = {}
    skipped = 0
    with open(path, encoding="utf-8") as src:
        for line in src:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if not isinstance(row, dict):
                skipped += 1
            elif row.get("format") == FORMAT or ("layout" in row and "ops" not in row):
                header = row
            elif row.get("event") == "probe_baselines":
                try:
                    baselines = {int(r): float(v) for r, v in row["rank_s"].items()}
                except (KeyError, TypeError, ValueError, AttributeError):
                    skipped += 1
            elif row.get("event") == "probe":
                try:
                    probe = probe_from_dict(row)
                    probes[probe.iteration] = (*probes.get(probe.iteration, ()), probe)
                except (KeyError, TypeError, ValueError, IndexError):
                    skipped += 1
            else:
                try:
                    iteration, obs = observation_from_dict(row)
                except ValueError:
                    skipped += 1
                    continue
                per_iter[iteration].append(obs)
    if "layout" not in header and per_iter:
        any_iter = next(iter(per_iter.values()))
        header = {**header, "layout": {
            "tp": 1 + max(o.tp_rank for o in any_iter),
            "pp": 1 + max(o.stage for o in any_iter),
            "dp": 1 + max(o.replica for o in any_iter),
        }}
    return Trace(header, {i: tuple(per_iter[i]) for i in sorted(per_iter)}, skipped, probes, baselines)


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape, workload and costs of a synthetic run.

    Iteration time swings come from the data: the job reads blocks of iterations from either a
    short-document or a long-document region of the corpus (``long_fraction`` of blocks, mean
    block length ``block_iters``), as unshuffled or length-clustered corpora do; each replica also
    deviates from the job's region for blocks of its own with probability ``replica_deviation``
    (its shard differs). So attention cost (``beta * sum l_i^2``) moves by tens of percent between
    blocks and between replicas, with healthy hardware throughout.

    ``per_document_s`` is a cost per packed document piece that the predictor's two-term model
    does not have (per-sequence kernel set-up in variable-length attention), so the predictor is
    judged on data it cannot fit exactly.
    """

    tp_degree: int = 8
    pp_degree: int = 4
    dp_degree: int = 8
    num_microbatches: int = 8
    micro_batch_size: int = 1
    seq_length: int = 8192
    short_docs: str = "lognormal:median=180,sigma=1.2,min=16,max=8192"
    long_docs: str = "lognormal:median=3000,sigma=0.8,min=256,max=8192"
    long_fraction: float = 0.35
    block_iters: float = 25.0
    replica_deviation: float = 0.2
    alpha_s: float = 5e-6
    beta_s: float = 6e-10
    per_document_s: float = 3e-5
    backward_factor: float = 2.0
    stage_cost: tuple[float, ...] = (1.1, 1.0, 1.0, 1.25)
    noise_cv: float = 0.025
    rank_jitter_s: float = 2e-4
    p2p_s: float = 0.004
    allreduce_s: float = 0.12
    optimizer_s: float = 0.04
    warmup_factor: float = 3.0
    gemm_probe_s: float = 0.010
    link_probe_s: float = 0.005
    probe_noise_cv: float = 0.01
    num_chunks: int = 1  # model chunks per stage: above 1, the interleaved schedule

    def __post_init__(self) -> None:
        if min(self.tp_degree, self.pp_degree, self.dp_degree) < 1 or self.num_microbatches < 1:
            raise ValueError("tp/pp/dp degrees and num_microbatches must be >= 1")
        if not self.stage_cost or min(self.stage_cost) <= 0:
            raise ValueError("stage_cost needs positive multipliers (one per stage, one for all, or first/../last)")
        if not (0 <= self.long_fraction <= 1 and 0 <= self.replica_deviation <= 1) or self.block_iters < 1:
            raise ValueError("long_fraction and replica_deviation must lie in [0, 1], block_iters be >= 1")

    def rank(self, replica: int, stage: int, tp_rank: int) -> int:
        return tp_rank + self.tp_degree * (replica + self.dp_degree * stage)

    def place(self, rank: int) -> tuple[int, int, int]:
        """``(replica, stage, tp_rank)`` of a rank."""
        tp_rank, rest = rank % self.tp_degree, rank // self.tp_degree
        return rest % self.dp_degree, rest // self.dp_degree, tp_rank

    def stage_multiplier(self, stage: int) -> float:
        costs = self.stage_cost
        if len(costs) == self.pp_degree:
            return costs[stage]
        if len(costs) == 1:
            return costs[0]
        # Default (4 entries) spread over another depth: first, middle, last.
        return costs[0] if stage == 0 else costs[-1] if stage == self.pp_degree - 1 else 1.0

    def header(self, faults: Sequence[Fault] = ()) -> dict:
        return {
            "layout": {"tp": self.tp_degree, "pp": self.pp_degree, "dp": self.dp_degree},
            "num_microbatches": self.num_microbatches,
            "num_chunks": self.num_chunks,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "faults": [f.spec() for f in faults],
            "source": "synthetic",
            "truth": {"alpha_s": self.alpha_s, "beta_s": self.beta_s, "per_document_s": self.per_document_s,
                      "noise_cv": self.noise_cv},
        }


def synthetic_trace(
    spec: SyntheticSpec, num_iterations: int, faults: Sequence[Fault] = (), seed: int = 0
) -> Iterator[tuple[int, tuple[RankObservation, ...]]]:
    """Generate ``(iteration, observations)`` for iterations ``1..num_iterations``.

    Args:
        spec: shape and costs.
        num_iterations: iterations to generate.
        faults: ``slow`` faults stretch the rank's ops (its TP siblings wait in collectives, so the
            whole group's ops stretch); ``link`` faults delay transfers between the two ranks (both
            directions: a slow cable); ``kill``/``hang`` ranks stop reporting.
        seed: randomness seed.

    Yields:
        One tuple of ``RankObservation`` per iteration (ranks in rank order).
    """
    rng = np.random.default_rng(seed)
    short = LengthDistribution.parse(spec.short_docs)
    long = LengthDistribution.parse(spec.long_docs)
    job_long = bool(rng.random() < spec.long_fraction)
    deviant = [bool(rng.random() < spec.replica_deviation) for _ in range(spec.dp_degree)]
    switch = 1.0 / spec.block_iters
    P, M = spec.pp_degree, spec.num_microbatches
    interleaving = Interleaving(spec.num_chunks)
    schedule = interleaving.schedule(P, M)
    # one feature row per op column: a micro-batch's under 1F1B, each chunk's op's when interleaved
    column_rows = list(interleaving.column_microbatch(P, M))
    for iteration in range(1, num_iterations + 1):
        active = [f for f in faults if f.active(iteration)]
        silent = {f.rank for f in active if f.kind in (FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG)}
        slow = defaultdict(lambda: 1.0)
        for f in active:
            if f.kind is FaultKind.SLOW:
                slow[f.rank] = max(slow[f.rank], f.factor)
        slow_links = {frozenset((f.rank, f.dst)): f.factor for f in active if f.kind is FaultKind.LINK}
        replicas = []
        if rng.random() < switch:
            job_long = bool(rng.random() < spec.long_fraction)
        for r in range(spec.dp_degree):
            if rng.random() < switch:
                deviant[r] = bool(rng.random() < spec.replica_deviation)
            dist = long if job_long != deviant[r] else short
            samples = sample_packed_workload(rng, dist, M * spec.micro_batch_size, spec.seq_length)
            per_mb = [samples[m * spec.micro_batch_size:(m + 1) * spec.micro_batch_size] for m in range(M)]
            feats = np.array([microbatch_features(mb) for mb in per_mb], dtype=float)
            feats = feats[column_rows]
            num_docs = feats[:, 2]
            replicas.append(_simulate_replica(spec, rng, r, feats, num_docs, schedule, slow, slow_links, iteration))
        iteration_s = max(span for span, _, _ in replicas) + spec.allreduce_s + spec.optimizer_s
        observations = []
        for r, (_, rank_ops, feats) in enumerate(replicas):
            features = tuple((int(n), int(s), int(d)) for n, s, d in feats)
            for (stage, tp_rank), ops in rank_ops.items():
                rank = spec.rank(r, stage, tp_rank)
                if rank in silent:
                    continue
                jitter = abs(rng.normal(0.0, spec.rank_jitter_s))
                observations.append(RankObservation(rank, r, stage, tp_rank, ops, features, iteration_s + jitter))
        observations.sort(key=lambda o: o.rank)
        yield iteration, tuple(observations)


def _simulate_replica(spec, rng, r, feats, num_docs, schedule, slow, slow_links, iteration):
    P, T, V = spec.pp_degree, spec.tp_degree, spec.num_chunks
    columns = len(feats)  # V per micro-batch, each a chunk's share of the stage's work
    base = (spec.alpha_s * feats[:, 0] + spec.beta_s * feats[:, 1] + spec.per_document_s * num_docs) / V
    warm = spec.warmup_factor if iteration == 1 else 1.0
    fwd = np.empty((P, columns))
    bwd = np.empty((P, columns))
    for s in range(P):
        group_slow = max(slow[spec.rank(r, s, t)] for t in range(T)) if slow else 1.0
        scale = spec.stage_multiplier(s) * group_slow * warm
        fwd[s] = base * scale * rng.lognormal(0.0, spec.noise_cv, columns)
        bwd[s] = base * scale * spec.backward_factor * rng.lognormal(0.0, spec.noise_cv, columns)
    # Per TP pair transfer time across each boundary; the group proceeds when its last rank has
    # its input, so the group-level walk uses the slowest pair. Under the interleaved schedule the
    # wrap from the last stage to the first takes the mean boundary's (as the simulator prices it).
    pair_p2p = np.full((max(P - 1, 0), T), spec.p2p_s)
    for s in range(P - 1):
        for t in range(T):
            key = frozenset((spec.rank(r, s, t), spec.rank(r, s + 1, t)))
            pair_p2p[s, t] *= slow_links.get(key, 1.0)
        pair_p2p[s] *= rng.lognormal(0.0, spec.noise_cv, T)
    group_p2p = pair_p2p.max(axis=1) if P > 1 else 0.0
    sim = simulate_iteration(schedule, fwd, bwd, group_p2p)
    wrap = float(np.mean(group_p2p)) if P > 1 else 0.0
    last = V * P - 1
    f_end, b_end = {}, {}
    for s in range(P):
        for op, end in zip(schedule[s], sim.op_finish_s[s]):
            (f_end if op.kind is OpKind.FORWARD else b_end)[(op.chunk * P + s, op.microbatch)] = end
    rank_ops = {}
    for s in range(P):
        for t in range(T):
            ops = []
            prev_end = 0.0
            column = {OpKind.FORWARD: 0, OpKind.BACKWARD: 0}
            for op, end in zip(schedule[s], sim.op_finish_s[s]):
                m, v, k = op.microbatch, op.chunk * P + s, column[op.kind]
                column[op.kind] += 1
                if op.kind is OpKind.FORWARD:
                    dur = fwd[s, k]
                    arrival = 0.0 if v == 0 else f_end[(v - 1, m)] + (pair_p2p[s - 1, t] if s > 0 else wrap)
                else:
                    dur = bwd[s, k]
                    arrival = f_end[(v, m)] if v == last else \
                        b_end[(v + 1, m)] + (pair_p2p[s, t] if s < P - 1 else wrap)
                # This rank starts once its own input is in and its previous op is done; it ends
                # with its TP group (collectives), i.e. at the group's finish time. Ops are
                # recorded by their column: the k-th forward (backward) of the stage.
                start = min(max(prev_end, arrival), end - dur)
                ops.append((op.kind.value, k, float(start), float(end)))
                prev_end = end
            rank_ops[(s, t)] = tuple(ops)
    return sim.total_s, rank_ops, feats


def synthetic_probes(
    spec: SyntheticSpec,
    faults: Sequence[Fault],
    iteration: int,
    probe_ranks: Sequence[int],
    probe_links: Sequence[tuple[int, int]],
    seed: int = 0,
) -> ProbeResults:
    """What validation probes would measure at ``iteration`` under ``faults`` (for simulation).

    A slow rank's GEMM probe takes ``factor`` times longer; a slow link's p2p probe (either
    direction) likewise; killed or hung ranks do not answer.
    """
    rng = np.random.default_rng(seed + 7919 * iteration)
    active = [f for f in faults if f.active(iteration)]
    silent = {f.rank for f in active if f.kind in (FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG)}
    rank_s = {}
    for rank in probe_ranks:
        if rank in silent:
            continue
        factor = max([f.factor for f in active if f.kind is FaultKind.SLOW and f.rank == rank], default=1.0)
        rank_s[rank] = spec.gemm_probe_s * factor * float(rng.lognormal(0.0, spec.probe_noise_cv))
    link_s = {}
    for a, b in probe_links:
        if a in silent or b in silent:
            continue
        factor = max([f.factor for f in active if f.kind is FaultKind.LINK and {f.rank, f.dst} == {a, b}], default=1.0)
        link_s[(a, b)] = spec.link_probe_s * factor * float(rng.lognormal(0.0, spec.probe_noise_cv))
    unresponsive = frozenset(r for r in list(probe_ranks) + [x for link in probe_links for x in link] if r in silent)
    return ProbeResults(iteration, rank_s, link_s, unresponsive)
