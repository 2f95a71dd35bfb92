"""Time prediction from data: the micro-batch cost model and the iteration predictor built on it.

Responsible for learning, online, how long one forward or backward of one micro-batch takes on a
given stage configuration, ``T = alpha * N + beta * sum_i l_i^2 + gamma * D`` (``N`` tokens, ``l_i``
the lengths of the ``D`` documents packed into the micro-batch), and for turning an iteration's
micro-batch features into a predicted iteration time by walking the pipeline schedule
(``resihp_ext.detection.simulator``).

Why ``gamma * D``: attention runs once per document, and each run has a fixed cost. On a small
model it outweighs the quadratic term: measured on live CPU runs (hidden 64, sequence 64), op time
fell as ``sum l^2`` grew, because fewer, longer documents mean fewer attention runs.

Why no intercept: with fixed-length packing every micro-batch holds the same ``N`` tokens, so an
intercept and ``alpha * N`` are the same column and the fit would be singular; a fixed per-op cost
is absorbed by ``alpha`` instead. A tiny ridge term keeps the solve stable while a key has seen
only one ``N`` (or no document counts: callers that pass none fit ``gamma = 0``).

It must never read clocks, files or process groups; the caller decides which observations are
healthy enough to learn from (a fail-slow must not be learnt as the new normal).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from resihp_ext.schedule import Interleaving
from resihp_ext.detection.simulator import IterationPrediction, simulate_iteration

# Observations are rescaled before fitting so that the 2x2 normal equations are well conditioned
# whatever the units (N ~ 1e4 tokens, sum_sq ~ 1e8 tokens^2).
_N_SCALE = 1e-4
_S_SCALE = 1e-8
_D_SCALE = 1e-2
_SCALES = np.array([_N_SCALE, _S_SCALE, _D_SCALE])
# The robust first fit solves through subsets of samples; at most this many subsets are tried.
_MAX_SUBSETS = 512
# During the first fit a sample more than ~20% off the robust fit is treated as warm-up.
_TRIM_LOG_ERROR = 0.18
# Consecutive rejected samples (in multiples of ``min_samples``) after which a fit is rebuilt.
_REFIT_AFTER = 3


def as_feature_array(features) -> np.ndarray:
    """Micro-batch features as a float array ``[micro-batch, 3]``: (tokens, sum_sq, documents).

    Features given without a document count get 0 there.
    """
    feats = np.asarray(features, dtype=float)
    feats = feats.reshape(-1, feats.shape[-1] if feats.size else 3)
    if feats.shape[1] == 2:
        feats = np.column_stack([feats, np.zeros(len(feats))])
    if feats.shape[1] != 3:
        raise ValueError(f"micro-batch features are (num_tokens, sum_sq[, num_docs]), got {feats.shape[1]} values")
    return feats


@dataclass(frozen=True, slots=True)
class Coefficients:
    """A fitted micro-batch model: ``seconds = alpha * num_tokens + beta * sum_sq + gamma * num_docs``."""

    alpha: float
    beta: float
    num_samples: int
    gamma: float = 0.0

    def predict(self, num_tokens, sum_sq, num_docs=0.0):
        """Seconds for scalars or numpy arrays of features."""
        return self.alpha * num_tokens + self.beta * sum_sq + self.gamma * num_docs


class _KeyModel:
    """Sufficient statistics for one key, with a robust first fit and an outlier gate after it."""

    def __init__(self, min_samples: int, outlier_ratio: float, ridge: float) -> None:
        self.min_samples = min_samples
        self.outlier_ratio = outlier_ratio
        self.ridge = ridge
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.count = 0
        self.rejected = 0
        self.buffer: list[tuple[float, float, float, float]] = []  # (n, s, d, seconds)
        self.coef: Coefficients | None = None
        # Recent consecutive rejections: when there are many in a row the fit itself is stale
        # (e.g. it was made on warm-up samples only), so it is rebuilt from them.
        self.recent_rejected: list[tuple[float, float, float, float]] = []

    def _note_rejected(self, samples: list[tuple[float, float, float, float]]) -> None:
        self.rejected += len(samples)
        self.recent_rejected.extend(samples)
        if len(self.recent_rejected) >= _REFIT_AFTER * self.min_samples:
            recent = self.recent_rejected[-4 * self.min_samples:]
            self.__init__(self.min_samples, self.outlier_ratio, self.ridge)
            self.buffer = recent
            self._first_fit()

    def _solve(self) -> None:
        w = np.linalg.solve(self.xtx + self.ridge * np.eye(3), self.xty) * _SCALES
        self.coef = Coefficients(float(w[0]), float(w[1]), self.count, float(w[2]))

    def add(self, n: float, s: float, d: float, y: float) -> bool:
        if self.coef is None:
            self.buffer.append((n, s, d, y))
            if len(self.buffer) >= self.min_samples:
                self._first_fit()
            return True
        predicted = self.coef.predict(n, s, d)
        if predicted > 0 and not (1.0 / self.outlier_ratio <= y / predicted <= self.outlier_ratio):
            self._note_rejected([(n, s, d, y)])
            return False
        self.recent_rejected = []
        self._accumulate(np.array([[n, s, d]]), np.array([y]))
        self._solve()
        return True

    def _accumulate(self, features: np.ndarray, y: np.ndarray) -> None:
        x = features * _SCALES
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.count += len(y)

    def add_batch(self, n: np.ndarray, s: np.ndarray, d: np.ndarray, y: np.ndarray) -> int:
        """Vectorised ``add`` (one solve per batch); returns how many samples were learnt."""
        if self.coef is None:
            for row in zip(n, s, d, y):
                self.add(*map(float, row))
            return len(y)
        ratio = y / np.maximum(self.coef.predict(n, s, d), 1e-12)
        keep = (ratio >= 1.0 / self.outlier_ratio) & (ratio <= self.outlier_ratio)
        if not keep.any():
            self._note_rejected(list(zip(n.tolist(), s.tolist(), d.tolist(), y.tolist())))
            return 0
        self.recent_rejected = []
        self.rejected += int((~keep).sum())
        self._accumulate(np.stack([n[keep], s[keep], d[keep]], axis=1), y[keep])
        self._solve()
        return int(keep.sum())

    def _first_fit(self) -> None:
        # Least median of squares: solve exactly through subsets of as many samples as there are
        # features in use and keep the fit whose median error is smallest, so up to half the
        # buffer may be warm-up outliers (first iteration, allocator growth) without bending the
        # fit; then refit by least squares on the samples that fit agrees with.
        data = np.array(self.buffer)
        x_all = data[:, :3] * _SCALES
        y = np.maximum(data[:, 3], 1e-12)
        used = [c for c in range(3) if np.any(x_all[:, c] != 0)]  # no document counts: 2 features
        x = x_all[:, used]
        subsets = list(itertools.combinations(range(len(y)), len(used)))
        if len(subsets) > _MAX_SUBSETS:
            picks = np.random.default_rng(0).choice(len(subsets), _MAX_SUBSETS, replace=False)
            subsets = [subsets[i] for i in sorted(picks)]
        best, best_error = None, np.inf
        for rows in subsets:
            pick = x[list(rows)]
            if abs(np.linalg.det(pick)) < 1e-12:
                continue
            w = np.linalg.solve(pick, y[list(rows)])
            error = np.median(np.abs(np.log(np.maximum(x @ w, 1e-12) / y)))
            if error < best_error:
                best, best_error = w, error
        if best is None:  # every subset degenerate (too few distinct feature vectors): ridge fit
            best = np.linalg.solve(x.T @ x + self.ridge * np.eye(len(used)), x.T @ y)
        error = np.abs(np.log(np.maximum(x @ best, 1e-12) / y))
        keep = error <= max(_TRIM_LOG_ERROR, 3.0 * float(np.median(error)))
        self._accumulate(data[keep, :3], data[keep, 3])
        self.rejected += int((~keep).sum())
        self.buffer = []
        self._solve()


class MicrobatchPredictor:
    """Online least-squares micro-batch time model, one fit per key (stage configuration).

    A key is any hashable describing what determines an op's cost, e.g.
    ``(stage, tp_degree, num_layers, "F")``. Each ``observe`` first scores the current model on
    the new sample (a held-out, prequential error) and then learns from it.

    Args:
        min_samples: samples a key needs before its first fit (>= 2).
        outlier_ratio: after the first fit, samples whose observed/predicted ratio lies outside
            ``[1/outlier_ratio, outlier_ratio]`` are not learnt from (> 1).
        error_window: how many recent held-out predictions ``mape`` averages over.
        ridge: ridge penalty on the rescaled features (>= 0).
    """

    def __init__(
        self, min_samples: int = 8, outlier_ratio: float = 1.5, error_window: int = 512, ridge: float = 1e-9
    ) -> None:
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2 (two coefficients), got {min_samples}")
        if outlier_ratio <= 1.0:
            raise ValueError(f"outlier_ratio must be > 1.0, got {outlier_ratio}")
        if error_window < 1 or ridge < 0:
            raise ValueError("error_window must be >= 1 and ridge >= 0")
        self.min_samples = min_samples
        self.outlier_ratio = outlier_ratio
        self.ridge = ridge
        self._models: dict[Hashable, _KeyModel] = {}
        self._errors: deque[float] = deque(maxlen=error_window)

    def reset(self, keys: Sequence[Hashable] | None = None) -> None:
        """Forget fits, e.g. after a re-plan changed stage configurations.

        Args:
            keys: forget only these keys; ``None`` forgets everything (error history included).
        """
        if keys is None:
            self._models.clear()
            self._errors.clear()
        else:
            for key in keys:
                self._models.pop(key, None)

    def fitted(self, key: Hashable) -> bool:
        model = self._models.get(key)
        return model is not None and model.coef is not None

    def coefficients(self, key: Hashable) -> Coefficients | None:
        model = self._models.get(key)
        return None if model is None else model.coef

    def predict_ops(self, keys: Sequence[Hashable], features: np.ndarray,
                    scale: float = 1.0) -> tuple[np.ndarray, ...] | None:
        """Per key, the predicted seconds of each micro-batch of ``features`` (``as_feature_array``)
        times ``scale``; None while any key is unfitted."""
        coefs = [self.coefficients(key) for key in keys]
        if any(c is None for c in coefs):
            return None
        return tuple(scale * c.predict(features[:, 0], features[:, 1], features[:, 2]) for c in coefs)

    def predict(self, key: Hashable, num_tokens: float, sum_sq: float, num_docs: float = 0.0) -> float:
        """Predicted seconds of one op with these features.

        Raises:
            KeyError: if ``key`` has no fit yet (check ``fitted(key)`` first).
        """
        coef = self.coefficients(key)
        if coef is None:
            raise KeyError(f"no fit for key {key!r} yet; observe at least {self.min_samples} samples first")
        return coef.predict(num_tokens, sum_sq, num_docs)

    def observe(self, key: Hashable, num_tokens: float, sum_sq: float, seconds: float,
                num_docs: float = 0.0, scale: float = 1.0) -> bool:
        """Score the model on one measured op, then learn from it.

        Args:
            scale: the device's current speed level (``resihp_ext.detection.speed_level``): the op was
                predicted to take ``scale`` times the model, and the model learns from
                ``seconds / scale``, so a drifting device does not bend the fit.

        Returns:
            True if the sample was learnt from, False if rejected as an outlier.
        """
        if seconds <= 0 or num_tokens < 0 or sum_sq < 0 or num_docs < 0 or not scale > 0:
            raise ValueError(f"need seconds > 0, scale > 0 and non-negative features, got {seconds}, {scale}, "
                             f"{num_tokens}, {sum_sq}, {num_docs}")
        return self.observe_batch(key, [num_tokens], [sum_sq], [seconds], [num_docs], scale=scale) == 1

    def observe_batch(self, key: Hashable, num_tokens, sum_sq, seconds, num_docs=None, scale=1.0) -> int:
        """``observe`` for many samples of one key at once (same semantics, one solve).

        Args:
            scale: one speed level for all samples, or one per sample (see ``observe``).

        Returns:
            How many samples were learnt from.
        """
        n = np.asarray(num_tokens, dtype=float)
        s = np.asarray(sum_sq, dtype=float)
        y = np.asarray(seconds, dtype=float)
        d = np.zeros_like(n) if num_docs is None else np.asarray(num_docs, dtype=float)
        level = np.broadcast_to(np.asarray(scale, dtype=float), y.shape)
        if not (n.shape == s.shape == d.shape == y.shape) or (y <= 0).any() or (n < 0).any() or (s < 0).any() \
                or (d < 0).any() or not (level > 0).all():
            raise ValueError("need equal-length feature/time arrays with seconds > 0, scale > 0 and features >= 0")
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = _KeyModel(self.min_samples, self.outlier_ratio, self.ridge)
        if model.coef is not None:
            self._errors.extend((np.abs(level * model.coef.predict(n, s, d) - y) / y).tolist())
        return model.add_batch(n, s, d, y / level)

    def mape(self) -> float | None:
        """Mean absolute percentage error (in %) over recent held-out predictions, or None."""
        return 100.0 * float(np.mean(self._errors)) if self._errors else None


@dataclass(frozen=True, slots=True)
class ReplicaPrediction:
    """Predicted timing of one DP replica's iteration.

    Attributes:
        iteration: the simulated schedule (total and per-stage finish times).
        stage_busy_s: per stage, predicted compute seconds (sum of its op times).
        forward_s: per stage and micro-batch, predicted forward seconds.
        backward_s: per stage and micro-batch, predicted backward seconds.
    """

    iteration: IterationPrediction
    stage_busy_s: tuple[float, ...]
    forward_s: tuple[tuple[float, ...], ...]
    backward_s: tuple[tuple[float, ...], ...]

    @property
    def total_s(self) -> float:
        return self.iteration.total_s


def predict_replica(
    predictor: MicrobatchPredictor,
    stage_keys: Sequence[tuple[Hashable, Hashable]],
    features: Sequence[tuple[float, ...]],
    p2p_s: float | Sequence[float] = 0.0,
    allreduce_s: float | Sequence[float] = 0.0,
    overhead_s: float = 0.0,
    op_scale: float | Sequence[float] = 1.0,
    interleaving: Interleaving = Interleaving(),
) -> ReplicaPrediction:
    """Predict one replica's iteration from its micro-batch features under its schedule (1F1B, or
    the interleaved one).

    Args:
        predictor: fitted micro-batch predictor.
        stage_keys: per stage, ``(forward_key, backward_key)`` into ``predictor``.
        features: per op column ``(num_tokens, sum_sq[, num_docs])``, the same on every stage: one
            per micro-batch under 1F1B, one per virtual micro-batch under the interleaved schedule
            (``Interleaving``), each op then a model chunk's.
        p2p_s: one-way transfer seconds (float or per boundary).
        allreduce_s: gradient-sync seconds (float or per stage).
        overhead_s: seconds added to the total for work outside the schedule (optimizer step).
        op_scale: wall seconds per predicted op second (1 on a dedicated device; more when ranks
            share cores, so an op's wall time exceeds the busy time the predictor fits), one for
            all stages or one per stage (e.g. times each stage group's speed level).
        interleaving: the replica's schedule.

    Returns:
        A ``ReplicaPrediction``.
    """
    num_stages = len(stage_keys)
    feats = as_feature_array(features)
    fwd, bwd = [], []
    scales = [float(op_scale)] * num_stages if np.isscalar(op_scale) else [float(x) for x in op_scale]
    if len(scales) != num_stages:
        raise ValueError(f"op_scale needs one value per stage ({num_stages}), got {len(scales)}")
    for (fkey, bkey), scale in zip(stage_keys, scales):
        ops = predictor.predict_ops((fkey, bkey), feats, scale)
        if ops is None:
            raise KeyError(f"stage keys {fkey!r}/{bkey!r} are not fitted yet")
        fwd.append(tuple(ops[0]))
        bwd.append(tuple(ops[1]))
    schedule = interleaving.schedule(num_stages, interleaving.microbatches(len(feats)))
    sim = simulate_iteration(schedule, fwd, bwd, p2p_s, allreduce_s, keep_ops=False)
    if overhead_s:
        sim = IterationPrediction(sim.total_s + overhead_s, tuple(t + overhead_s for t in sim.stage_finish_s))
    busy = tuple(float(sum(f) + sum(b)) for f, b in zip(fwd, bwd))
    return ReplicaPrediction(sim, busy, tuple(fwd), tuple(bwd))


def stage_keys_for(
    num_stages: int, tp_degrees: Sequence[int] | int, signature: Mapping[int, Hashable] | None = None
) -> tuple[tuple[Hashable, Hashable], ...]:
    """Default keys ``(stage, tp_degree, extra, "F"/"B")`` for a replica's stages.

    Args:
        num_stages: pipeline degree.
        tp_degrees: TP degree per stage (or one for all).
        signature: optional extra per stage (e.g. its layer count), so two configurations that
            cost differently never share a fit.
    """
    tps = [tp_degrees] * num_stages if isinstance(tp_degrees, int) else list(tp_degrees)
    extra = signature or {}
    return tuple(
        ((s, tps[s], extra.get(s), "F"), (s, tps[s], extra.get(s), "B")) for s in range(num_stages)
    )
