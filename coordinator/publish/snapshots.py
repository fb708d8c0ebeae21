"""Publishing policy versions as signed, content-addressed snapshots, atomically.

A version is written into a temporary folder, fsynced, renamed to ``snapshots/vNNNNNN``, and only then is
its signed manifest written (also via rename). Readers treat a folder without a manifest as not there. A
version becomes *current* only when the database records it (after publication), so a crash at any point
leaves either the old version current with a stray folder (removed at restart) or the new one complete.

Run-level shared files (``snapshots/base/``): a file that is identical in every version (the frozen base of
a LoRA run) is written once per run and listed, by name, size and sha256, in each version's manifest. Clients
fetch files by sha256, so they neither know nor care where the coordinator keeps it; the version folder holds
only what changes. The sha256 is kept in a sidecar so a restart does not hash gigabytes again.

Delta files (``anchor_every`` set; coordinator.publish.deltas, shared.deltas): a version's whole-weight files are
also published as patches against the previous version's files, listed in its manifest with the sha256 of the
file each rebuilds; every ``anchor_every``-th version is a full anchor, published without patches, so that no
client's chain of patches is longer than ``anchor_every - 1``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.holds import hold
from coordinator.publish.deltas import PATCHED_FILES, patched, write_delta
from coordinator.publish.lazy import LagRule, Settled
from coordinator.publish.weights_file import write_weights
from shared import wire
from shared.hashing import PIECE_SIZE, file_digests, sha256_bytes
from shared.messages import Manifest, ManifestFile, SignedManifest
from shared.records import DELTA_SUFFIX, build_manifest, file_form, manifest_file, sign_manifest

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.msgpack"
BASE_DIR = "base"  # run-level files shared by every version's manifest (written once)

FileWriter = Callable[[Path], None]


@dataclass(frozen=True)
class SnapshotFiles:
    """What one version consists of, as the learner hands it over for publication.

    ``write(folder)`` writes the version's own files into ``folder``; ``shared`` maps a manifest file name to a
    writer of a run-level file (``writer(path)`` writes exactly that file) that is the same in every version:
    it is written into ``snapshots/base/`` the first time and reused afterwards. Both run on the publisher's
    thread, after the learner has moved on, so they must read copies (or weights that never change).

    ``weights`` (full-weight versions): the tensors of the version's ``model.safetensors``, by name. The store
    writes that file from them first (coordinator.publish.weights_file: a chunk at a time, settled against the
    previous version on the way, lazy publication, coordinator.publish.lazy; the tensors themselves are only read),
    then calls :meth:`release`, then ``write``, which writes the rest and may read ``model.safetensors`` back (the
    GGUF form is written from it). They are either the learner's hand-over copy, or its live weights (already in
    the publish dtype on the CPU): then the learner's next optimizer update waits for ``written``.
    :meth:`release` empties ``weights`` (a copy is freed before GGUF, hashing, patches and the manifest) and sets
    ``written`` (also on failure). The learner hands over its next copy only after that: one copy in flight."""

    write: FileWriter
    shared: Mapping[str, FileWriter] = field(default_factory=dict)
    weights: MutableMapping[str, Any] | None = None
    written: threading.Event = field(default_factory=threading.Event)

    def write_into(self, folder: Path, lag: LagRule | None = None) -> Settled | None:
        """Write the version's own files into ``folder``: ``model.safetensors`` from ``weights`` (settled by ``lag``,
        lazy publication; what it did is returned), :meth:`release`, then ``write`` (everything else)."""
        settled = None
        try:
            if self.weights is not None:
                settled = write_weights(folder / PATCHED_FILES[0], self.weights, {"format": "pt"}, lag)
        finally:
            self.release()
        self.write(folder)
        return settled

    def write_whole(self, folder: Path) -> None:
        """The version as one self-contained folder, outside any store: the run-level ``shared`` files beside its
        own (a reference copy a test or a bench compares with what was published)."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, writer in self.shared.items():
            writer(folder / name)
        self.write_into(folder)

    def release(self) -> None:
        """The weights are written (or will not be): drop them, let the learner go on updating. Idempotent."""
        if self.weights is not None:
            self.weights.clear()
        self.written.set()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (the directory entry itself), as atomic publication needs."""
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
    fsync_dir(folder)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class SnapshotStore:
    """The ``snapshots/`` folder of a run, plus an in-memory index of servable files by sha256."""

    def __init__(self, root: Path, key: Ed25519PrivateKey, run_id: str, *, piece_size: int = PIECE_SIZE,
                 anchor_every: int | None = None, lag_tolerance: float = 0.0, lag_cap: float | None = None) -> None:
        self.root = Path(root)
        self.piece_size = piece_size  # of the manifests' per-piece hashes (ManifestFile.pieces)
        if anchor_every is not None and anchor_every < 1:
            raise ValueError(f"anchor_every must be at least 1 (every version a full anchor), not {anchor_every}")
        if lag_tolerance < 0:
            raise ValueError(f"lag_tolerance must be at least 0 (0: publish every rounding), not {lag_tolerance}")
        self.anchor_every = anchor_every  # None: no delta files
        self.lag_tolerance = lag_tolerance  # lazy publication between anchors (coordinator.publish.lazy); 0: off
        self.lag_cap = lag_cap  # the largest δ in absolute terms (snapshots.lag_steps × learner.lr); None: no cap
        self.last_settled: Settled | None = None  # what the newest publication's settling did (benches, logs)
        self.root.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.run_id = run_id
        self._blobs: dict[str, Path] = {}
        self._signed: dict[int, bytes] = {}
        # the index is read and changed from several threads where roles share one process (the publisher's thread
        # indexes and prunes while the API and the verifier observe it from the event loop)
        self._index_lock = threading.RLock()

    def folder(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    @property
    def base_dir(self) -> Path:
        return self.root / BASE_DIR

    def base_file(self, name: str, write: FileWriter) -> ManifestFile:
        """The run-level file ``snapshots/base/<name>``, written by ``write(path)`` (atomically, fsynced) only if
        it does not exist yet; its manifest entry (sha256 from the sidecar, computed once)."""
        if "/" in name or name.startswith(".") or name == MANIFEST_FILE:
            raise ValueError(f"bad shared file name {name!r}: a plain file name, not hidden, not the manifest")
        self.base_dir.mkdir(exist_ok=True)
        path = self.base_dir / name
        sidecar = self.base_dir / f".{name}.sha256"
        piece_sidecar = self.base_dir / f".{name}.pieces-{self.piece_size}"  # raw piece hashes (protocol 4)
        if not (path.exists() and sidecar.exists()):
            tmp = self.base_dir / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                write(tmp)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                digest, pieces = file_digests(tmp, self.piece_size)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            write_atomic(piece_sidecar, b"".join(pieces))
            write_atomic(sidecar, digest.encode())
        digest = sidecar.read_text().strip()
        if not piece_sidecar.exists():  # a base written before piece hashes: hash it once more, then never again
            _, pieces = file_digests(path, self.piece_size)
            write_atomic(piece_sidecar, b"".join(pieces))
        raw = piece_sidecar.read_bytes()
        entry = ManifestFile(path=name, size=path.stat().st_size, sha256=digest, form=file_form(name),  # type: ignore[arg-type]
                             piece_size=self.piece_size, pieces=[raw[i:i + 32] for i in range(0, len(raw), 32)])
        with self._index_lock:
            self._blobs.setdefault(digest, path)
        return entry

    def publish(self, version: int, write_files: FileWriter | SnapshotFiles, now: float) -> str:
        """Write a version's files via ``write_files(tmp_folder)`` (or a :class:`SnapshotFiles`, whose shared
        files are listed from ``snapshots/base/``); return the signed manifest's sha256."""
        files = write_files if isinstance(write_files, SnapshotFiles) else SnapshotFiles(write_files)
        tmp = self.root / f".tmp-v{version}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self.last_settled = None
            try:
                self.last_settled = files.write_into(tmp, self._lag_rule(version))
            finally:
                files.release()
            if self.last_settled is not None:
                done = self.last_settled
                logger.debug("version %d: %d of %d elements republished, %d held back", version, done.republished,
                             done.elements, done.held)
            hold(f"publish-v{version}")  # a fault test's kill point: written, not yet durable or renamed
            # the fsync (waiting on the disk) and the hashing (reading the same files from the page cache) overlap
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-fsync") as pool:
                synced = pool.submit(_fsync_tree, tmp)
                manifest = build_manifest(tmp, run_id=self.run_id, version=version, created_at=now,
                                          piece_size=self.piece_size)
                synced.result()
            if files.shared:
                own = {f.path for f in manifest.files}
                extra = [self.base_file(name, w) for name, w in sorted(files.shared.items())]
                clash = own & {f.path for f in extra}
                if clash:
                    raise ValueError(f"version {version} writes {sorted(clash)} itself and as a shared file")
                manifest = manifest.model_copy(update={"files": sorted([*manifest.files, *extra],
                                                                       key=lambda f: f.path)})
            patches = self._write_deltas(version, tmp, manifest)
            if patches:
                manifest = Manifest.model_validate({**manifest.model_dump(),
                                                    "files": sorted([*manifest.files, *patches], key=lambda f: f.path)})
            final = self.folder(version)
            if final.exists():  # left over by a crash before the database recorded this version
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        signed = wire.encode(sign_manifest(self.key, manifest))
        write_atomic(final / MANIFEST_FILE, signed)
        self._index(version, manifest, signed)
        return sha256_bytes(wire.decode(signed, SignedManifest).manifest)

    def is_anchor(self, version: int) -> bool:
        """A version published whole only (no patches): every ``anchor_every``-th, and every one without deltas."""
        return self.anchor_every is None or version % self.anchor_every == 0

    def _lag_rule(self, version: int) -> LagRule | None:
        """Lazy publication (coordinator.publish.lazy): hold back the elements of this version's weights that moved
        by no more than the tolerance from the previous version's ``model.safetensors``. Not at an anchor (a
        resync), not without deltas (nothing to save), not when the previous version is not here."""
        if self.lag_tolerance <= 0 or self.is_anchor(version):
            return None
        with self._index_lock:
            if version - 1 not in self._signed:
                return None
            previous = self._file_of(version - 1, PATCHED_FILES[0])
        return LagRule(previous, self.lag_tolerance, self.lag_cap)

    def _write_deltas(self, version: int, folder: Path, manifest: Manifest) -> list[ManifestFile]:
        """The patches of this version's whole-weight files against the previous version's (written into
        ``folder``, fsynced), as manifest entries; none for an anchor, the first version, or a previous version
        no longer here (pruned, or published by another process before a restart reindexed it)."""
        if self.is_anchor(version):
            return []
        with self._index_lock:
            previous = self._signed.get(version - 1)
        if previous is None:
            return []
        before = {f.path: f for f in wire.decode(wire.decode(previous, SignedManifest).manifest, Manifest).files}
        entries = []
        for f in manifest.files:
            old = before.get(f.path)
            if not patched(f.path) or old is None or old.sha256 == f.sha256:
                continue
            base, out = self._file_of(version - 1, f.path), folder / (f.path + DELTA_SUFFIX)
            try:
                size = write_delta(base, folder / f.path, out, base_sha256=old.sha256, result_sha256=f.sha256)
            except FileNotFoundError:  # the previous version was pruned under us: this one is published whole
                out.unlink(missing_ok=True)
                continue
            if size is None:
                continue
            with open(out, "rb") as fh:
                os.fsync(fh.fileno())
            entries.append(manifest_file(out, piece_size=self.piece_size, base_sha256=old.sha256,
                                         result_sha256=f.sha256))
        if entries:
            fsync_dir(folder)
        return entries

    def _index(self, version: int, manifest: Manifest, signed: bytes) -> None:
        with self._index_lock:
            for f in manifest.files:  # a file shared by several versions is served from the newest indexed one
                self._blobs[f.sha256] = self._file_of(version, f.path)
            self._signed[version] = signed

    def _reindex(self) -> None:
        """Rebuild the blob index from the versions still on disk, oldest first (so the newest copy wins)."""
        with self._index_lock:
            for version in [v for v in self._signed if not (self.folder(v) / MANIFEST_FILE).exists()]:
                del self._signed[version]
            self._blobs.clear()
            for version in sorted(self._signed):
                manifest = wire.decode(wire.decode(self._signed[version], SignedManifest).manifest, Manifest)
                for f in manifest.files:
                    self._blobs[f.sha256] = self._file_of(version, f.path)

    def _file_of(self, version: int, name: str) -> Path:
        """Where a version's manifest entry lives: its own folder, else the run-level base folder."""
        own = self.folder(version) / name
        return own if own.exists() or not (self.base_dir / name).exists() else self.base_dir / name

    def disk_bytes(self) -> int:
        """Bytes under ``snapshots/`` (every kept version plus the shared base), for status and benches."""
        return sum(p.stat().st_size for p in self.root.rglob("*") if p.is_file())

    def signed_manifest(self, version: int) -> bytes | None:
        return self._signed.get(version)

    def blob_path(self, sha256: str) -> Path | None:
        path = self._blobs.get(sha256)
        if path is not None and not path.exists():
            # the version it was indexed from was pruned (by another process: the learner publishes and prunes, the
            # API serves); a file shared with a kept version is still there
            self._reindex()
            path = self._blobs.get(sha256)
        return path if path is not None and path.exists() else None

    def reconcile(self, committed: Iterable[int]) -> None:
        """At start-up: drop temp folders and versions the database never recorded; index the rest."""
        keep = set(committed)
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            if name == BASE_DIR:
                for tmp in entry.glob(".*.tmp"):  # a shared file whose writing a crash interrupted
                    tmp.unlink(missing_ok=True)
                continue
            version = int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None
            manifest_file = entry / MANIFEST_FILE
            if version is None or version not in keep or not manifest_file.exists():
                logger.info("removing unpublished snapshot folder %s", entry)
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
                continue
            signed = manifest_file.read_bytes()
            manifest = wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)
            self._index(version, manifest, signed)

    def observe(self, committed: Iterable[int]) -> None:
        """In a process that reads snapshots another one publishes (the API, the verifiers): index the committed
        versions not seen yet, forget the ones whose folder the publisher pruned. Writes nothing."""
        committed = set(committed)
        with self._index_lock:
            gone = [v for v in self._signed if v not in committed or not (self.folder(v) / MANIFEST_FILE).exists()]
            for version in gone:
                del self._signed[version]
            if gone:
                self._reindex()
            new = sorted(committed - self._signed.keys())
        for version in new:
            manifest_file = self.folder(version) / MANIFEST_FILE
            try:
                signed = manifest_file.read_bytes()
            except FileNotFoundError:
                continue  # pruned (or not this host's folder)
            manifest = wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)
            self._index(version, manifest, signed)

    def prune(self, keep: Iterable[int]) -> None:
        """Delete published versions not in ``keep`` and rebuild the blob index from what remains."""
        keep = set(keep)
        with self._index_lock:
            for version in list(self._signed):
                if version not in keep:
                    shutil.rmtree(self.folder(version), ignore_errors=True)
                    del self._signed[version]
            self._reindex()
