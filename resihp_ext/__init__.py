"""ResiHP's decision logic: pure functions of plain data.

Responsible for everything that *decides*: layouts, schedules as data, time prediction,
failure detection and re-planning. It must never import ``megatron`` or ``torch.distributed``,
nor open files, sockets or clocks inside a decision: callers pass observations and ``now`` in.
"""
