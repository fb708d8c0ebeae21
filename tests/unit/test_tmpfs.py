"""coordinator.store.tmpfs: the run's private folder in /dev/shm for the nonce database (real tmpfs, real SQLite)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from coordinator.store import tmpfs
from coordinator.store.store import Store

pytestmark = pytest.mark.skipif(not tmpfs._is_tmpfs(tmpfs.SHM), reason="this host has no tmpfs at /dev/shm")


def test_each_run_has_one_private_folder_and_orphans_go(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "coordinator.sqlite", tmp_path / "b" / "coordinator.sqlite"
    for db in (a, b):
        db.parent.mkdir()
        db.touch()
    fa, fb = tmpfs.run_folder(a), tmpfs.run_folder(b)
    assert fa is not None and fb is not None and fa != fb
    assert tmpfs.run_folder(a) == fa  # every process of the run finds the same folder
    assert oct(os.stat(fa).st_mode & 0o777) == "0o700"
    b.unlink()  # run b is gone: its folder is removed when another run's folder is opened
    assert tmpfs.run_folder(a) == fa and not fb.exists()
    tmpfs.shutil.rmtree(fa)


def test_a_planted_symlink_is_not_used(tmp_path: Path) -> None:
    db = tmp_path / "coordinator.sqlite"
    db.touch()
    expected = tmpfs.SHM / f"{tmpfs.PREFIX}{os.getuid()}-{tmpfs.hashlib.sha256(str(db.resolve()).encode()).hexdigest()[:16]}"
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    expected.symlink_to(target)
    try:
        assert tmpfs.run_folder(db) is None
    finally:
        expected.unlink()


def test_nonces_live_in_tmpfs_and_old_ones_on_disk_are_adopted(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    store = Store(path)
    disk = store._disk_nonce_path
    store.close()
    import sqlite3

    old = sqlite3.connect(disk)  # what a release before coordinator.store.tmpfs left beside the main file
    old.execute("CREATE TABLE nonces(nonce BLOB PRIMARY KEY, expires REAL NOT NULL)")
    old.execute("INSERT INTO nonces VALUES(?, ?)", (b"r" * 16, time.time() + 300))
    old.commit()
    old.close()
    store = Store(path)
    try:
        assert store.nonce_path.is_relative_to(tmpfs.SHM)
        assert not store.nonces.remember(b"r" * 16, time.time() + 300)  # the replay is still refused
        assert store.nonces.remember(b"n" * 16, time.time() + 300)
        assert not disk.exists()
    finally:
        store.close()
