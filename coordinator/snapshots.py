"""Publishing policy versions as signed, content-addressed snapshots, atomically.

A version is written into a temporary folder, fsynced, renamed to ``snapshots/vNNNNNN``, and only then is
its signed manifest written (also via rename). Readers treat a folder without a manifest as not there. A
version becomes *current* only when the database records it (after publication), so a crash at any point
leaves either the old version current with a stray folder (removed at restart) or the new one complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import wire
from shared.hashing import sha256_bytes
from shared.messages import Manifest, SignedManifest
from shared.records import build_manifest, sign_manifest

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.msgpack"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class SnapshotStore:
    """The ``snapshots/`` folder of a run, plus an in-memory index of servable files by sha256."""

    def __init__(self, root: Path, key: Ed25519PrivateKey, run_id: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.run_id = run_id
        self._blobs: dict[str, Path] = {}
        self._signed: dict[int, bytes] = {}

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def publish(self, version: int, write_files: Callable[[Path], None], now: float) -> str:
        """Write a version's files via ``write_files(tmp_folder)``; return the signed manifest's sha256."""
        tmp = self.root / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_files(tmp)
            _fsync_tree(tmp)
            manifest = build_manifest(tmp, run_id=self.run_id, version=version, created_at=now)
            final = self.folder(version)
            if final.exists():  # left over by a crash before the database recorded this version
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        signed = wire.encode(sign_manifest(self.key, manifest))
        write_atomic(final / MANIFEST_FILE, signed)
        self._index(version, manifest, signed)
        return sha256_bytes(wire.decode(signed, SignedManifest).manifest)

    def _index(self, version: int, manifest: Manifest, signed: bytes) -> None:
        folder = self.folder(version)
        for f in manifest.files:
            self._blobs.setdefault(f.sha256, folder / f.path)
        self._signed[version] = signed

    def signed_manifest(self, version: int) -> bytes | None:
        return self._signed.get(version)

    def blob_path(self, sha256: str) -> Path | None:
        path = self._blobs.get(sha256)
        return path if path is not None and path.exists() else None

    def reconcile(self, committed: Iterable[int]) -> None:
        """At start-up: drop temp folders and versions the database never recorded; index the rest."""
        keep = set(committed)
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            version = int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None
            manifest_file = entry / MANIFEST_FILE
            if version is None or version not in keep or not manifest_file.exists():
                logger.info("removing unpublished snapshot folder %s", entry)
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                continue
            signed = manifest_file.read_bytes()
            manifest = wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)
            self._index(version, manifest, signed)

    def prune(self, keep: Iterable[int]) -> None:
        """Delete published versions not in ``keep`` and rebuild the blob index from what remains."""
        keep = set(keep)
        for version in list(self._signed):
            if version not in keep:
                shutil.rmtree(self.folder(version), ignore_errors=True)
                del self._signed[version]
        self._blobs.clear()
        for version, signed in self._signed.items():
            manifest = wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)
            for f in manifest.files:
                self._blobs.setdefault(f.sha256, self.folder(version) / f.path)
