"""Memory a coordinator process frees goes back to the system, so its peak is what it holds, not what it once held.

glibc's malloc serves blocks below its mmap threshold from heap arenas, and raises that threshold (up to 32 MiB) each
time it frees a larger mapped block. A learner frees tensors of every size at every step — at 0.5 B parameters its
gradients and activations are mostly 3–17 MB blocks — which then land in arenas that are seldom trimmed: measured
with bench/learner_memory.py, 1.7 GiB (3.7 B/param) stayed resident after each step and the next step's peak grew
by as much. A fixed 1 MiB threshold maps every larger block on its own and unmaps it when freed; the cost is the
kernel handing out fresh zeroed pages for each new large block (an estimated tens of milliseconds per step at
0.5 B, a few hundred MB of activations and gradients; not separately measured).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; False where malloc is not glibc's or the operator
    set ``MALLOC_MMAP_THRESHOLD_`` (their choice stands)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)))
    logger.debug("malloc's mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD, ok)
    return ok
