"""Write-behind for the publisher's gigabytes: while a library writes a snapshot or a checkpoint, its files are
flushed to disk every fraction of a second, so they never pile up as dirty pages in the OS cache.

Why: Linux lets a process dirty page cache freely only up to a threshold (between ``vm.dirty_background_ratio``
and ``vm.dirty_ratio`` of memory); beyond it, *every* process that writes is paused in ``balance_dirty_pages`` —
for up to seconds — whatever it writes. A 0.5 B version is 2 GB and a checkpoint 6 GB, written as fast as the
library can, so without this the API process's one-page writes (a nonce, a lease) stalled for 0.1–1.7 s while a
version was published (docs/benchmarks.md). Flushing as we go keeps the publisher's dirty pages to what it writes
in one interval; the final fsync of atomic publication then finds almost nothing left to write.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

#: Seconds between flushes: the publisher's dirty pages stay below one interval's worth of writing.
FLUSH_EVERY_S = 0.2


def _flush(target: Path) -> None:
    """fdatasync every regular file at or under ``target`` (a file or a folder); files that vanish are skipped."""
    paths = [target] if not target.is_dir() else [Path(d) / f for d, _, fs in os.walk(target) for f in fs]
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # not written yet, or renamed away
            continue
        try:
            os.fdatasync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def flushed_while_writing(target: Path, every_s: float = FLUSH_EVERY_S) -> Iterator[None]:
    """Inside the block, a helper thread flushes what has been written at or under ``target`` every
    ``every_s`` seconds. The block's own fsyncs (atomic publication) still decide durability."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            _flush(target)

    thread = threading.Thread(target=run, name="write-behind", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
