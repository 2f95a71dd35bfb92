"""Small Python objects sent from one rank to another without the sender waiting.

Responsible for ``send_object`` / ``recv_object`` over a gloo group, ``PostedReceive`` (a
receive posted ahead of its message), and ``Outbox``, which keeps sends alive until their
receivers take them.

torch's ``send_object_list`` sends a length and then the bytes, and returns once the receiver has
taken both: a gloo send completes only when the matching receive is posted. Detection sends one
object per rank per iteration to a rank that may still be computing, so the sender must not wait.
Here an object travels as one message of ``CAPACITY`` bytes whose first 8 hold its pickled
length, and, only when it does not fit, a second message with the rest; ``send_object`` returns
at once, and the receiver reads one message (two for a large object).
"""

from __future__ import annotations

import pickle
import struct

import torch
import torch.distributed as dist

CAPACITY = 16 << 10  # bytes of the first message: an 8-rank observation pickles to about 3 KiB
_HEADER = 8
_HEADER_FORMAT = "=q"  # the pickled length, native int64


def send_object(obj, dsts, tag: int, group=None) -> list:
    """Start sending ``obj`` to each rank of ``dsts`` (global ranks); returns ``(work, buffer)``
    pairs. Keep them (an ``Outbox`` does) until the sends complete: a buffer dropped early may be
    freed before it is sent."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    # Built as bytes, then one tensor over them: slicing into a tensor cost 70 us of CPU per send.
    head = min(len(data), CAPACITY - _HEADER)
    message = bytearray(CAPACITY)
    struct.pack_into(_HEADER_FORMAT, message, 0, len(data))
    message[_HEADER:_HEADER + head] = data[:head]
    first = torch.frombuffer(message, dtype=torch.uint8)  # shares (and keeps alive) the bytes
    rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8) if len(data) > head else None
    works = []
    for dst in dsts:
        works.append((dist.isend(first, dst, group=_group_arg(group), tag=tag), first))
        if rest is not None:
            works.append((dist.isend(rest, dst, group=_group_arg(group), tag=tag), rest))
    return works


def recv_object(src: int, tag: int, group=None):
    """Receive the next object ``src`` sent with ``tag`` (blocks until it arrives)."""
    return PostedReceive(src, tag, group).take()


class PostedReceive:
    """A receive posted before its message is sent: ``take`` returns the object.

    A gloo transfer needs both sides: a receive posted only when the object is wanted waits for
    the sender's process to be scheduled again, which on a host with more ranks than cores takes
    milliseconds. Posted ahead, the transfer happens whenever both are ready, and ``take`` finds
    it done.
    """

    def __init__(self, src: int, tag: int, group=None) -> None:
        self.src, self.tag, self.group = src, tag, group
        self._first = torch.empty(CAPACITY, dtype=torch.uint8)
        self._work = dist.irecv(self._first, src, group=_group_arg(group), tag=tag)

    def take(self):
        """The object (blocks until it arrived)."""
        self._work.wait()
        return _unpack(self._first, self.src, self.tag, self.group)


def _unpack(first: torch.Tensor, src: int, tag: int, group):
    raw = first.numpy()
    size = struct.unpack_from(_HEADER_FORMAT, raw, 0)[0]
    head = min(size, CAPACITY - _HEADER)
    if size <= head:
        return pickle.loads(raw[_HEADER:_HEADER + head])
    rest = torch.empty(size - head, dtype=torch.uint8)
    dist.recv(rest, src, group=_group_arg(group), tag=tag)
    return pickle.loads(raw[_HEADER:_HEADER + head].tobytes() + rest.numpy().tobytes())


def _group_arg(group):
    return group if group is not None else dist.group.WORLD


class Outbox:
    """Sends under way, a batch per ``send``: holds their buffers until the receivers take them.

    A gloo send's handle only learns that it completed by being waited on, so each ``send`` first
    waits on the batches older than the last ``in_flight``: by then their receivers must have
    taken them (a rank receives the previous step's messages before it sends the next step's),
    and the wait returns at once. The newest batches are never waited on: their receivers may
    still be computing.
    """

    def __init__(self, in_flight: int = 1) -> None:
        self.in_flight = in_flight
        self._batches: list[list] = []

    def send(self, obj, dsts, tag: int, group=None) -> None:
        """Send ``obj`` to every rank of ``dsts`` (pickled once) without waiting for them."""
        while len(self._batches) >= max(self.in_flight, 1):
            for work, _ in self._batches.pop(0):
                work.wait()
        self._batches.append(send_object(obj, dsts, tag, group))

    def wait_all(self) -> None:
        """Wait until every receiver took what was sent to it."""
        for batch in self._batches:
            for work, _ in batch:
                work.wait()
        self._batches = []

    def __len__(self) -> int:
        """Messages sent and not yet waited on."""
        return sum(len(batch) for batch in self._batches)
