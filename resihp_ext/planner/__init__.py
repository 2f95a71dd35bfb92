"""The re-planner: Layout + Health -> Plan, across TP, PP and DP.

``plan_adaptation`` (joint.py) is the ResiHP policy; ``simple_policies.POLICIES`` holds it beside the
comparison policies, all with the same signature. Everything here is a pure function of plain
data: no process groups, clocks or files.
"""

from resihp_ext.planner.hardware import HardwareModel
from resihp_ext.planner.health import Health
from resihp_ext.planner.joint import plan_adaptation
from resihp_ext.planner.plan import Plan

__all__ = ["HardwareModel", "Health", "Plan", "plan_adaptation"]
