"""Memory a coordinator process frees goes back to the system, so its peak is what it holds, not what it once held.

A leaf module (ctypes only): the launcher fixes the threshold before any tensor exists, and the learner and the
publisher give free heap pages back after their work (:func:`release_free_heap`).

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

_libc: ctypes.CDLL | None = None
_looked = False  # looked for glibc once: find_library may run ldconfig, and release_free_heap runs every step


def _glibc() -> ctypes.CDLL | None:
    """glibc's malloc functions, or None where malloc is not glibc's (found once per process)."""
    global _libc, _looked
    if not _looked:
        _looked = True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            libc = None
        if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            _libc = libc
    return _libc


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process; False where malloc is not glibc's or the operator
    set ``MALLOC_MMAP_THRESHOLD_`` (their choice stands)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD)))
    logger.debug("malloc's mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD, ok)
    return ok


def release_free_heap() -> bool:
    """Give the free pages inside every malloc arena back to the system (glibc's ``malloc_trim(0)``); False where
    malloc is not glibc's.

    Why: blocks below the mmap threshold — Python objects, small tensors, a file writer's buffers — come from
    arenas, one per thread that allocates. What a thread frees stays in its arena, and another thread's work cannot
    reuse it: the learner process's publisher thread left ~0.1–0.2 GiB of free pages resident after each version,
    on top of which the learner thread's next step made its peak (bench/scale.py, learner 10.1 B/param). Called
    where a piece of work that allocates much and keeps little has ended: after each optimizer step and each
    publication. It takes milliseconds (a walk over the arenas' free chunks)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True
