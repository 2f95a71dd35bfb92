"""A helper process that must not outlive the rank that started it asks the kernel for a signal
when its parent dies: a SIGKILLed rank runs no clean-up, so only the kernel can end its helpers."""

from __future__ import annotations

import ctypes

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies.

    Returns:
        False where the request does not exist (not Linux): the caller then notices a dead parent
        on its own, by ``os.getppid()`` changing. Either way, a parent that died before the
        request sends nothing, so the caller compares ``os.getppid()`` with the parent it expects.
    """
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig) == 0
    except (OSError, AttributeError):
        return False
