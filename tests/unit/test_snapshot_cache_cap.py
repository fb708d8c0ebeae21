"""The snapshot cache's size cap: least recently used model folders go first; shared files stay while any
remaining folder links them; the folder in use is never removed."""

from __future__ import annotations

import os
from pathlib import Path

from swarm_client.snapshots import cache_bytes, prune_to_cap


def make_folder(models: Path, blobs: Path, run: str, version: int, files: dict[str, bytes], used_at: float) -> Path:
    folder = models / run / f"v{version:06d}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        blob = blobs / f"{name}-{len(data)}"
        if not blob.exists():
            blob.write_bytes(data)
        os.link(blob, folder / name)
    (folder / ".complete").write_text("")
    (folder / ".last_used").write_text("")
    os.utime(folder / ".last_used", (used_at, used_at))
    return folder


def test_prunes_least_recently_used_first_and_keeps_shared_blobs(tmp_path: Path) -> None:
    models, blobs = tmp_path / "snapshots", tmp_path / "blobs"
    blobs.mkdir()
    tok = b"t" * 100  # tokenizer shared by every version
    a = make_folder(models, blobs, "runA", 1, {"tok": tok, "w": b"a" * 1000}, used_at=1000)
    b = make_folder(models, blobs, "runA", 2, {"tok": tok, "w": b"b" * 1001}, used_at=3000)
    c = make_folder(models, blobs, "runB", 1, {"tok": tok, "w": b"c" * 1002}, used_at=2000)
    assert cache_bytes(blobs) == 100 + 1000 + 1001 + 1002

    removed = prune_to_cap(models, blobs, max_bytes=2200, keep={b})
    assert removed == [a]  # oldest use first; 100 + 1001 + 1002 fits
    assert cache_bytes(blobs) == 2103 and (blobs / "tok-100").exists()

    removed = prune_to_cap(models, blobs, max_bytes=1200, keep={b})
    assert removed == [c] and b.exists() and cache_bytes(blobs) == 1101


def test_kept_folders_stay_even_over_the_cap(tmp_path: Path) -> None:
    models, blobs = tmp_path / "snapshots", tmp_path / "blobs"
    blobs.mkdir()
    only = make_folder(models, blobs, "run", 7, {"w": b"x" * 5000}, used_at=1)
    assert prune_to_cap(models, blobs, max_bytes=10, keep={only}) == []
    assert only.exists() and cache_bytes(blobs) == 5000


def test_under_the_cap_nothing_is_removed(tmp_path: Path) -> None:
    models, blobs = tmp_path / "snapshots", tmp_path / "blobs"
    blobs.mkdir()
    make_folder(models, blobs, "run", 1, {"w": b"x" * 10}, used_at=1)
    make_folder(models, blobs, "run", 2, {"w": b"y" * 11}, used_at=2)
    assert prune_to_cap(models, blobs, max_bytes=21, keep=set()) == []
