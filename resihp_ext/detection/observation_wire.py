"""The form in which a rank's observation travels to the decider and is judged there.

Responsible for ``PackedObservation``: a ``RankObservation`` whose ops stay packed (their kinds as
one string, micro-batches and times as arrays' bytes) from the sending rank to the decider's op
tables, and ``packed_op_columns``, which reads the ops of many packed observations in a few array
calls.

Why: the decider receives one observation per rank per iteration. Unpickled as tuples, one per op,
each took about 12 us at 1,024 ranks, and filling the op tables from those tuples another 6 us
(``scripts/bench/decider_scaling.py``); both grow with the job. Packed, the decider builds neither;
``ops`` is unpacked only where something reads it (a trace being written).
"""

from __future__ import annotations

from array import array

import numpy as np

from resihp_ext.detection.observations import RankObservation

# What travels, in order; ``ops`` and ``busy`` are unpacked from it where read.
_WIRE = ("rank", "replica", "stage", "tp_rank", "features", "iteration_s", "kinds", "microbatches", "times",
         "op_seconds", "busy_measured")
_COMPARED = ("rank", "replica", "stage", "tp_rank", "ops", "features", "iteration_s", "busy")


class PackedObservation(RankObservation):
    """A ``RankObservation`` with its ops packed; equal to (and hashed as) the one it packs.

    Made by ``packed`` on the sending rank, from an observation validated where it was made, and
    rebuilt by unpickling on the decider without validating again.
    """

    __slots__ = ("kinds", "microbatches", "times", "op_seconds", "busy_measured", "_ops")

    @property
    def ops(self):
        if self._ops is None:
            times = array("d", self.times)
            object.__setattr__(self, "_ops", tuple(zip(self.kinds, array("q", self.microbatches),
                                                       times[0::2], times[1::2])))
        return self._ops

    @property
    def busy(self):
        return self.op_busy() if self.busy_measured else ()

    def op_busy(self) -> tuple[float, ...]:
        return tuple(array("d", self.op_seconds))  # packed as measured, else as each op's wall time

    def __reduce__(self):
        return _rebuild, tuple(getattr(self, name) for name in _WIRE)

    def __eq__(self, other):
        if not isinstance(other, RankObservation):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _COMPARED)

    __hash__ = RankObservation.__hash__


def packed(obs: RankObservation) -> PackedObservation:
    """``obs`` in the form it travels in (itself if already packed)."""
    if isinstance(obs, PackedObservation):
        return obs
    return _rebuild(obs.rank, obs.replica, obs.stage, obs.tp_rank, obs.features, obs.iteration_s,
                    "".join(op[0] for op in obs.ops), array("q", [op[1] for op in obs.ops]).tobytes(),
                    array("d", [t for op in obs.ops for t in op[2:]]).tobytes(), array("d", obs.op_busy()).tobytes(),
                    bool(obs.busy))


def _slot_setter(name: str):
    """The slot's own setter: it writes past the frozen class's ``__setattr__``, at less cost than
    ``object.__setattr__`` (unpickling calls it 12 times per observation)."""
    for cls in PackedObservation.__mro__:
        slot = cls.__dict__.get(name)
        if slot is not None and not isinstance(slot, property):
            return slot.__set__
    raise AttributeError(name)


_SETTERS = tuple(_slot_setter(name) for name in _WIRE)
_SET_OPS = _slot_setter("_ops")


def _rebuild(*values) -> PackedObservation:
    obs = object.__new__(PackedObservation)
    for setter, value in zip(_SETTERS, values):
        setter(obs, value)
    _SET_OPS(obs, None)
    return obs


def packed_op_columns(observations) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every op of ``observations`` (all ``PackedObservation``), in order: ``(ops per observation,
    is it a backward, its micro-batch, start, end, device seconds)``, the last five as arrays."""
    counts = [len(o.kinds) for o in observations]
    backward = np.frombuffer("".join(o.kinds for o in observations).encode(), dtype=np.uint8) == ord("B")
    microbatches = np.frombuffer(b"".join(o.microbatches for o in observations), dtype=np.int64)
    times = np.frombuffer(b"".join(o.times for o in observations), dtype=np.float64)
    seconds = np.frombuffer(b"".join(o.op_seconds for o in observations), dtype=np.float64)
    return counts, backward, microbatches, times[0::2], times[1::2], seconds
