"""Variable-length workloads: document-length distributions, packing, micro-batch features.

Responsible for describing how long the documents of a training job are and how they fill
fixed-length samples. The same description drives the mock dataset of a live run
(``--mock-doc-lengths``) and the synthetic traces of the simulator, so both see the same
iteration-time swings that the detector must not mistake for a fail-slow.

The micro-batch cost model is ``T_mb ~= alpha * N + beta * sum_i(l_i^2)``; this module computes
the two features ``(N, sum_i l_i^2)`` from document lengths. It is pure: numpy only, no torch,
no files, and randomness comes from a ``numpy.random.Generator`` the caller passes in.

Spec grammar (``KIND:key=value,key=value``; keys may come in any order)::

    fixed:length=L
    uniform:min=A,max=B
    lognormal:median=M,sigma=S[,min=A][,max=B]
    pareto:alpha=K,min=A[,max=B]

Lengths are integers >= 1. ``min``/``max`` clip (they do not resample), so a heavy tail piles up
at ``max`` instead of producing documents longer than the job can hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

FLAG = "--mock-doc-lengths"

# Keys each kind requires and the keys it accepts on top of them.
_REQUIRED = {
    "fixed": ("length",),
    "uniform": ("min", "max"),
    "lognormal": ("median", "sigma"),
    "pareto": ("alpha", "min"),
}
_OPTIONAL = {
    "fixed": (),
    "uniform": (),
    "lognormal": ("min", "max"),
    "pareto": ("max",),
}
_EXAMPLE = "lognormal:median=48,sigma=1.0,min=8,max=1024"


@dataclass(frozen=True)
class LengthDistribution:
    """A distribution of document lengths (in tokens, EOD included).

    Attributes:
        kind: One of ``fixed``, ``uniform``, ``lognormal``, ``pareto``.
        params: Parameters of the kind, as parsed from the spec (all floats).
        min_length: Lower clip (inclusive), >= 1.
        max_length: Upper clip (inclusive), or None for no upper clip.
    """

    kind: str
    params: tuple[tuple[str, float], ...] = field(default=())
    min_length: int = 1
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _REQUIRED:
            raise ValueError(
                f"{FLAG}: unknown distribution {self.kind!r}; choose one of "
                f"{', '.join(sorted(_REQUIRED))} (e.g. {_EXAMPLE})"
            )
        if self.min_length < 1:
            raise ValueError(f"{FLAG}: min must be >= 1, got {self.min_length}")
        if self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(
                f"{FLAG}: max ({self.max_length}) must be >= min ({self.min_length})"
            )
        if self.kind == "uniform" and self.max_length is None:
            raise ValueError(f"{FLAG}: uniform needs max=..., e.g. uniform:min=8,max=512")
        p = dict(self.params)
        for key in _REQUIRED[self.kind]:
            if key not in p and key not in ("min", "max"):
                raise ValueError(f"{FLAG}: {self.kind} needs {key}=..., e.g. {_EXAMPLE}")
        if self.kind == "fixed" and p["length"] < 1:
            raise ValueError(f"{FLAG}: fixed length must be >= 1, got {p['length']:g}")
        if self.kind == "lognormal" and (p["median"] <= 0 or p["sigma"] < 0):
            raise ValueError(f"{FLAG}: lognormal needs median > 0 and sigma >= 0")
        if self.kind == "pareto" and p["alpha"] <= 0:
            raise ValueError(f"{FLAG}: pareto needs alpha > 0, got {p['alpha']:g}")

    def param(self, name: str) -> float:
        """Return parameter ``name`` of this distribution."""
        return dict(self.params)[name]

    @staticmethod
    def parse(spec: str) -> "LengthDistribution":
        """Parse a spec such as ``lognormal:median=48,sigma=1.0,min=8,max=1024``.

        Args:
            spec: The ``--mock-doc-lengths`` value.

        Returns:
            The distribution.

        Raises:
            ValueError: Naming ``--mock-doc-lengths`` and the expected grammar.
        """
        kind, sep, rest = spec.strip().partition(":")
        kind = kind.strip().lower()
        if kind not in _REQUIRED:
            raise ValueError(
                f"{FLAG}: unknown distribution {kind!r} in {spec!r}; choose one of "
                f"{', '.join(sorted(_REQUIRED))} (e.g. {_EXAMPLE})"
            )
        values: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip().lower()
            if not eq or key not in _REQUIRED[kind] + _OPTIONAL[kind]:
                allowed = ", ".join(_REQUIRED[kind] + _OPTIONAL[kind])
                raise ValueError(f"{FLAG}: bad item {item!r} in {spec!r}; {kind} takes {allowed}")
            if key in values:
                raise ValueError(f"{FLAG}: {key} given twice in {spec!r}")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ValueError(f"{FLAG}: {key}={raw!r} is not a number in {spec!r}") from None
        missing = [k for k in _REQUIRED[kind] if k not in values]
        if missing:
            raise ValueError(
                f"{FLAG}: {kind} needs {', '.join(k + '=...' for k in missing)} in {spec!r}"
            )
        for key in ("min", "max", "length"):
            if key in values and values[key] != int(values[key]):
                raise ValueError(f"{FLAG}: {key} must be an integer, got {values[key]:g}")
        if kind == "fixed":
            min_length = max_length = int(values["length"])
        else:
            min_length = int(values.get("min", 1))
            max_length = int(values["max"]) if "max" in values else None
        params = tuple(sorted((k, v) for k, v in values.items() if k not in ("min", "max")))
        return LengthDistribution(kind, params, min_length, max_length)

    def __str__(self) -> str:
        items = [f"{k}={v:g}" for k, v in self.params]
        if self.kind != "fixed":
            if self.min_length != 1 or self.kind in ("uniform", "pareto"):
                items.append(f"min={self.min_length}")
            if self.max_length is not None:
                items.append(f"max={self.max_length}")
        return f"{self.kind}:{','.join(items)}"


def sample_document_lengths(
    rng: np.random.Generator, dist: LengthDistribution, n: int
) -> np.ndarray:
    """Draw ``n`` document lengths.

    Args:
        rng: Source of randomness (the caller seeds it, so runs are reproducible).
        dist: The distribution.
        n: Number of documents, >= 0.

    Returns:
        int64 array of shape [n], every value in [dist.min_length, dist.max_length].
    """
    if n < 0:
        raise ValueError(f"number of documents must be >= 0, got {n}")
    if dist.kind == "fixed":
        raw = np.full(n, dist.param("length"))
    elif dist.kind == "uniform":
        raw = rng.integers(dist.min_length, dist.max_length + 1, size=n)
    elif dist.kind == "lognormal":
        raw = rng.lognormal(np.log(dist.param("median")), dist.param("sigma"), size=n)
    else:  # pareto: classic Pareto with scale ``min`` (numpy's is Lomax, shifted by one).
        raw = dist.min_length * (1.0 + rng.pareto(dist.param("alpha"), size=n))
    # Round rather than floor so a lognormal median stays the median after discretisation.
    lengths = np.rint(raw).astype(np.int64)
    upper = dist.max_length if dist.max_length is not None else np.iinfo(np.int64).max
    return np.clip(lengths, dist.min_length, upper)


def pack_documents(lengths: Sequence[int] | np.ndarray, seq_length: int) -> list[list[int]]:
    """Pack documents, in order, into samples of exactly ``seq_length`` tokens.

    A document that crosses a sample boundary is split: its head ends the sample and its tail
    starts the next one (as Megatron's GPT dataset does). Tokens left over after the last full
    sample are dropped, so every returned sample sums to ``seq_length``.

    Args:
        lengths: Document lengths, each >= 1.
        seq_length: Tokens per sample, >= 1.

    Returns:
        Per sample, the lengths of the document pieces it holds, in order.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    samples: list[list[int]] = []
    current: list[int] = []
    room = seq_length
    for length in lengths:
        length = int(length)
        if length < 1:
            raise ValueError(f"document lengths must be >= 1, got {length}")
        while length > 0:
            piece = min(length, room)
            current.append(piece)
            length -= piece
            room -= piece
            if room == 0:
                samples.append(current)
                current, room = [], seq_length
    return samples


def sample_packed_workload(
    rng: np.random.Generator, dist: LengthDistribution, num_samples: int, seq_length: int
) -> list[list[int]]:
    """Draw documents until ``num_samples`` full samples of ``seq_length`` tokens are packed.

    Args:
        rng: Source of randomness.
        dist: Document-length distribution.
        num_samples: Number of samples wanted, >= 0.
        seq_length: Tokens per sample.

    Returns:
        Exactly ``num_samples`` samples, as :func:`pack_documents` returns them.
    """
    if num_samples < 0:
        raise ValueError(f"number of samples must be >= 0, got {num_samples}")
    lengths: list[np.ndarray] = []
    total = 0
    drawn = 0
    need = num_samples * seq_length
    while total < need:
        # Size each draw from the running mean length, so long or heavy-tailed documents
        # neither cost many rounds nor a large overdraw.
        mean = total / drawn if drawn else float(dist.min_length)
        count = max(16, int(np.ceil((need - total) / max(mean, 1.0))))
        batch = sample_document_lengths(rng, dist, count)
        lengths.append(batch)
        total += int(batch.sum())
        drawn += count
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return pack_documents(all_lengths, seq_length)[:num_samples]


def microbatch_features(samples_doc_lengths: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """The cost-model features of one micro-batch.

    Args:
        samples_doc_lengths: Per sample of the micro-batch, the lengths of its documents.

    Returns:
        ``(num_tokens, sum_sq, num_docs)``: total tokens, the sum of squared document lengths,
        and the number of documents (attention runs once per document).
    """
    num_tokens = sum_sq = num_docs = 0
    for sample in samples_doc_lengths:
        for length in sample:
            num_tokens += int(length)
            sum_sq += int(length) * int(length)
            num_docs += 1
    return num_tokens, sum_sq, num_docs
