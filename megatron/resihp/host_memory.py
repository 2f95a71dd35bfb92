"""Host memory that a CPU rank frees stays with the rank, as a GPU caching allocator keeps it.

PyTorch's CPU tensors come from glibc's malloc. glibc serves large blocks with fresh ``mmap``s and
gives the top of its heap back to the kernel once enough of it is free, so a training step that
frees and reallocates the same activations touches new pages every time: each first touch is a
page fault, and the kernel's time for it is charged to the rank's thread. The count varies from
step to step, and with it the step's CPU time, which is what the detector measures as device time
on CPU (``schedules.py``). Measured on this project's 2-core host (4-layer encoder, hidden 256,
sequence 256, one thread, 150 forward+backward steps, thread CPU time, 4 runs each):

======================  ======================  =====================================
                        page faults per step    spread of identical steps (mean |dev|)
======================  ======================  =====================================
glibc defaults          median 560-1,456        1.43-2.40%
``keep_freed_memory``   median 0                0.66-0.85%, and 1.5% faster
======================  ======================  =====================================

``keep_freed_memory()`` sets glibc's thresholds (``mallopt``) so blocks up to 32 MiB come from the
heap and a freed heap top is kept. The rank's resident memory stays at its peak, which is what
CUDA's caching allocator does on a GPU. Numerics are unchanged. Without glibc (another libc, or a
preloaded allocator that does not read these settings) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above 32 MiB on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 << 20
TOP_PAD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 2**31 - 1  # the largest mallopt takes: in effect, keep the heap top

_log = logging.getLogger(__name__)


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed blocks for reuse; True if it accepted every setting."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        _log.info("host allocator: no glibc mallopt (%s); freed memory goes back to the OS", name)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TOP_PAD, TOP_PAD_BYTES),
                (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    accepted = all(mallopt(param, value) == 1 for param, value in settings)
    if not accepted:
        _log.info("host allocator: glibc refused a mallopt setting; freed memory may go back to the OS")
    return accepted
