"""A run's folder in memory (tmpfs, ``/dev/shm``) for state that must outlive a process but not the machine.

Why: the API writes one nonce per signed request. On disk, while the publisher writes a multi-gigabyte snapshot
or checkpoint, such a one-page write stalls for 0.1–1.7 s (a page still under writeback must be waited for, and
beyond Linux's dirty threshold every writer is paused), measured in bench/scale.py's log as "slow database"
commits of the nonce file. tmpfs pages never go to disk: the same commits stayed under 4 ms while a disk was
saturated. Nonces only need to survive a crash of the API process (a kill -9 keeps tmpfs), which is all the
disk file gave them without an fsync; after a reboot, timestamps older than ``request_window_s`` are refused
anyway.

The folder is private (mode 0700, owned by this user, not a symlink) and named after the run's database path, so
every API process of the run on this host finds the same one. A folder whose run's database no longer exists is
removed when another is opened. Without a usable tmpfs, callers fall back to the run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "echo-swarm-"
OWNER_FILE = "database"  # the run database's path, to tell when the folder is an orphan


def _is_tmpfs(path: Path) -> bool:
    try:
        with open("/proc/mounts") as fh:
            return any(parts[1] == str(path) and parts[2] == "tmpfs"
                       for parts in (line.split() for line in fh) if len(parts) > 2)
    except OSError:
        return False


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def run_folder(database: Path, root: Path = SHM) -> Path | None:
    """This run's private folder in tmpfs (created if needed), or None where there is no usable tmpfs."""
    if not _is_tmpfs(root) or not os.access(root, os.W_OK):
        return None
    database = database.resolve()
    key = hashlib.sha256(str(database).encode()).hexdigest()[:16]
    folder = root / f"{PREFIX}{os.getuid()}-{key}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        if not _private(folder):  # someone else's, or a symlink planted there: not ours to use
            return None
        (folder / OWNER_FILE).write_text(str(database))
    except OSError:
        return None
    _remove_orphans(root, keep=folder)
    return folder


def _remove_orphans(root: Path, keep: Path) -> None:
    """Folders of this user's runs whose database is gone (a deleted run directory, a finished test)."""
    for folder in root.glob(f"{PREFIX}{os.getuid()}-*"):
        if folder == keep:
            continue
        with contextlib.suppress(OSError):
            if _private(folder) and not Path((folder / OWNER_FILE).read_text()).exists():
                shutil.rmtree(folder)
