"""The kernel's help with processes whose parent dies, through Linux's ``prctl``.

A helper process that must not outlive the rank that started it asks for a signal when its parent
dies: a SIGKILLed rank runs no clean-up, so only the kernel can end its helpers. A launcher whose
ranks must outlive the process that forked them (``scripts/rank_fork_server.py``) becomes a child
subreaper, so that they become its own children and it can wait for their ends.
"""

from __future__ import annotations

import ctypes

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    """Linux's ``prctl(option, value)``; False where it failed or does not exist."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0
    except (OSError, AttributeError):
        return False


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    Returns:
        False where the request does not exist (not Linux): the caller then notices a dead parent
        on its own, by ``os.getppid()`` changing. Either way, a parent that died before the
        request sends nothing, so the caller compares ``os.getppid()`` with the parent it expects.
    """
    return _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> bool:
    """Make this process a child subreaper: orphans among its descendants become its children,
    whose ends it can wait for. False where that is not there."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)
