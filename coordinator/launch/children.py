"""What every child process the launcher starts (a role, a follower rank) shares: it dies with its parent."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys


def die_with_parent() -> None:
    """In a child, before exec: the kernel kills this process if its parent dies (Linux; elsewhere a role notices
    its parent is gone within a second, coordinator.launch.processes), so a killed coordinator leaves no role or
    rank behind to race its restart."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
