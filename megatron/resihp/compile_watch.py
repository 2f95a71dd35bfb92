"""Whether this process is compiling a ``torch.compile`` graph right now.

Responsible for the one fact about compilation that the hang rules need. A job's first iteration
compiles the fusions megatron-core wraps in ``torch.compile`` (``--cross-entropy-loss-fusion``, the
bias and activation fusions), and a backward graph compiles lazily at its first backward; on a
loaded host or a large graph that takes longer than the hang timeout, while the rank is doing what
it should. torch reports the start and the end of every compilation (Dynamo tracing a frame, a lazy
backward, a CUDA graph recording) to the callbacks of ``torch._dynamo.callback_handler``, nested
compilations as one; this module registers one pair of them per process and keeps the answer in a
flag the heartbeat watchdog reads from its own thread.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_handler = None  # torch's, once found; False: this torch has no compile callbacks
_compiling = False


def _started(_args) -> None:
    global _compiling
    _compiling = True


def _ended(_args) -> None:
    global _compiling
    _compiling = False


def install() -> bool:
    """Follow this process's compilations from now on; False where torch cannot say.

    Cheap once done, and called again on every heartbeat: ``torch._dynamo.reset()`` clears the
    callbacks, and this registers them anew.
    """
    global _handler
    with _lock:
        if _handler is None:
            try:
                import torch._dynamo
                _handler = torch._dynamo.callback_handler
            except (ImportError, AttributeError) as err:
                logger.warning("heartbeat: this torch reports no compilations (%s); a rank compiling past the "
                               "hang timeout is judged hung", err)
                _handler = False
        if _handler is False:
            return False
        if _started not in _handler.start_callbacks:
            _handler.register_start_callback(_started)
            _handler.register_end_callback(_ended)
        return True


def compiling() -> bool:
    """This process is inside a compilation now (always False before ``install()``)."""
    return _compiling
