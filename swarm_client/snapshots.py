"""Fetching policy snapshots: verify the signed manifest, download each file by sha256 (resuming partial
downloads with HTTP Range), verify every byte, and assemble a model folder from the content-addressed cache.

Files shared between versions (tokenizer, config) are downloaded once. A file whose hash does not match is
discarded and fetched again; nothing unverified is ever placed in a model folder.

Size: the newest two versions of a run are kept; with a cap (``max_bytes``) the least recently used model
folders (any run) are also removed until the blobs fit, never the one in use. Before any byte is downloaded
the ``precheck`` hook sees the signed manifest and how many bytes are missing, so the client can refuse a
model too big for the machine's memory or disk (swarm_client/resources.py) instead of failing half-way.

One cache folder, several runs: the runs of a `join --attach` client (swarm_client/multirun.py) each have a cache
object over the same folder, so that a file two runs' versions share (the same base model) is stored once. They share
the locks, the count of downloads in progress and the folders in use (:class:`_Room`, one per folder and event loop):
without that, two runs fetching the same file wrote one partial file at once, and one run's pruning took blobs
another run had just downloaded and not yet linked.

Deltas (shared.deltas, docs/protocol.md §6): a whole-weight file the manifest also lists a patch for is rebuilt
from the version this client holds when that downloads fewer bytes (swarm_client/snapshot_patches.py); the bytes
themselves move through swarm_client/blob_fetch.py (resumed, rate-capped, hashed as they arrive).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared import wire
from shared.endpoints import SNAPSHOT
from shared.errors import IntegrityError
from shared.messages import Manifest, ManifestFile, SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient
from swarm_client.bandwidth import Throttle
from swarm_client.blob_fetch import CONNECT_TIMEOUT_S, IDLE_TIMEOUT_S, BlobFetcher, Transfer
from swarm_client.snapshot_patches import Patches

if TYPE_CHECKING:
    from swarm_client.peer_fetch import ClientPeer

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    """What every cache object over one folder shares within one event loop (the module's docstring)."""

    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    busy: int = 0  # ensure() calls in progress: unlinked blobs may belong to one of them
    # per cache object (gone with it): the folder its backend generates from
    in_use: weakref.WeakKeyDictionary[SnapshotCache, Path] = field(default_factory=weakref.WeakKeyDictionary)


_ROOMS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, _Room]] = weakref.WeakKeyDictionary()


def _room(root: Path) -> _Room:
    """The shared state of the cache folder ``root`` (resolved) in the running event loop (asyncio locks belong to
    one)."""
    rooms = _ROOMS.setdefault(asyncio.get_running_loop(), {})
    return rooms.setdefault(root, _Room())


class SnapshotCache:
    """Verified model folders per version, assembled from the content-addressed blobs (see the module docstring);
    the bytes move through :class:`BlobFetcher`, patches through :class:`Patches`."""

    def __init__(self, root: Path, client: CoordinatorClient, coordinator_key: bytes, *, max_attempts: int = 3,
                 max_bytes: int | None = None, precheck: Callable[[Manifest, int], None] | None = None,
                 forms: frozenset[str] | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 on_progress: Callable[[Transfer | None], None] | None = None,
                 throttle: Throttle | None = None, count: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.forms = forms  # the file forms this client's backend needs (None: all); see ManifestFile.form
        # the GGUF precision this client runs (its lease names it): of a run's several, only that file is fetched
        self.precision: str | None = None
        self._shared_as = self.root.resolve()  # what every cache object over this folder shares (_room)
        self.blobs = self.root / "blobs"
        self.models = self.root / "snapshots"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.models.mkdir(parents=True, exist_ok=True)
        self.client = client
        self.coordinator_key = coordinator_key
        self.max_bytes = max_bytes
        self.precheck = precheck
        self.fetcher = BlobFetcher(self.blobs, client, max_attempts=max_attempts, idle_timeout_s=idle_timeout_s,
                                   connect_timeout_s=connect_timeout_s, on_progress=on_progress, throttle=throttle,
                                   count=count)
        self.patches = Patches(self.fetcher, self.manifest, self._lock)

    def _lock(self, name: str) -> asyncio.Lock:
        """A file's (its sha256) or a folder's lock, shared with every cache object over this folder."""
        return _room(self._shared_as).locks.setdefault(name, asyncio.Lock())

    async def ensure(self, run_id: str, version: int, manifest_sha256: str | None) -> Path:
        """Return a verified local model folder for ``version``. ``manifest_sha256`` (from a signed job) pins the
        exact manifest; ``None`` (a prefetch) accepts any manifest the coordinator signed for that version."""
        folder = self.models / run_id / f"v{version:06d}"
        room = _room(self._shared_as)
        if manifest_sha256 is not None:
            room.in_use[self] = folder  # the folder the backend generates from: never pruned
        room.busy += 1
        try:
            return await self._ensure(run_id, version, manifest_sha256, folder)
        finally:
            room.busy -= 1

    async def _ensure(self, run_id: str, version: int, manifest_sha256: str | None, folder: Path) -> Path:
        async with self._lock(str(folder)):
            if (folder / ".complete").exists() and manifest_sha256 in (None, (folder / ".manifest_sha256").read_text()) \
                    and _read(folder / ".precision") == (self.precision or ""):
                _touch(folder)
                return folder
            manifest, sha = await self.manifest(version)
            if manifest_sha256 not in (None, sha) or manifest.version != version or manifest.run_id != run_id:
                raise IntegrityError(f"snapshot manifest for version {version} does not match the one the job names")
            if self.precheck is not None:
                self.precheck(manifest, self.missing_bytes(manifest))
            for f in self._wanted(manifest):
                async with self._lock(f.sha256):
                    if not (self.blobs / f.sha256).exists():
                        await self.patches.rebuild(manifest, f)
                    await self.fetcher.fetch(f.sha256, f.size, f"v{version} {f.path}", f)
            if self.fetcher.peers is not None:
                await self.fetcher.peers.announce_pending()
            self._assemble(folder, manifest, sha)
            _touch(folder)
            self._prune(run_id, keep=folder)
            return folder

    async def manifest(self, version: int) -> tuple[Manifest, str]:
        """``version``'s manifest, its signature checked against the pinned coordinator key, and its sha256."""
        signed = wire.decode(await self.client.get_raw(SNAPSHOT.at(version=version)), SignedManifest)
        return open_manifest(signed, self.coordinator_key)

    @property
    def peers(self) -> ClientPeer | None:
        """`join --p2p`: other volunteers asked first for every file (swarm_client/peer_fetch.py)."""
        return self.fetcher.peers

    @peers.setter
    def peers(self, peer: ClientPeer | None) -> None:
        self.fetcher.peers = peer

    @property
    def bytes_downloaded(self) -> int:
        """Bytes downloaded over HTTP since this cache was made (patches included)."""
        return self.fetcher.bytes_downloaded

    def _wanted(self, manifest: Manifest) -> list[ManifestFile]:
        """The files this client's model folder holds (patches are only a way to get some of them)."""
        return wanted_files(manifest, self.forms, self.precision)

    def missing_bytes(self, manifest: Manifest) -> int:
        """Bytes still to download for ``manifest`` (files already cached, or partly downloaded, count less);
        only the files of the forms this client's backend needs."""
        total = 0
        for f in {f.sha256: f for f in self._wanted(manifest)}.values():
            if (self.blobs / f.sha256).exists():
                continue
            partial = self.blobs / f"{f.sha256}.partial"
            total += max(0, f.size - (partial.stat().st_size if partial.exists() else 0))
        return total

    def _assemble(self, folder: Path, manifest: Manifest, manifest_sha: str) -> None:
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in self._wanted(manifest):
            src = self.blobs / f.sha256
            try:
                os.link(src, tmp / f.path)
            except OSError:
                shutil.copyfile(src, tmp / f.path)
        (tmp / ".manifest_sha256").write_text(manifest_sha)
        (tmp / ".precision").write_text(self.precision or "")
        (tmp / ".complete").write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)

    def _prune(self, run_id: str, keep: Path, keep_last: int = 2) -> None:
        """Keep the newest few model folders; drop blobs no remaining folder links to."""
        room = _room(self._shared_as)
        in_use = {keep, *room.in_use.values()}  # every run's folder in use, not only this one's
        run_root = self.models / run_id
        folders = sorted(p for p in run_root.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
        for old in folders[:-keep_last]:
            if old not in in_use:
                shutil.rmtree(old, ignore_errors=True)
        if room.busy > 1:  # another download (of any run) may still be collecting blobs it has not linked yet
            return
        _drop_orphans(self.blobs)
        if self.max_bytes is not None:
            removed = prune_to_cap(self.models, self.blobs, self.max_bytes, keep=in_use)
            if removed:
                logger.info("snapshot cache over %d bytes: removed %s", self.max_bytes,
                            ", ".join(p.name for p in removed))


def wanted_files(manifest: Manifest, forms: frozenset[str] | None, precision: str | None) -> list[ManifestFile]:
    """The files of ``manifest`` a client of ``forms`` (None: all) holds: never patches; of a run's several whole
    GGUFs (snapshots.gguf_also) only the one of ``precision`` — the default ``model.gguf`` when ``precision`` is
    None or not among them (a coordinator that states no precisions)."""
    ggufs = [f for f in manifest.files if f.form == "gguf"]
    chosen = next((f for f in ggufs if precision is not None and f.precision == precision), None)
    if chosen is None:
        chosen = next((f for f in ggufs if f.path == "model.gguf"), ggufs[0] if ggufs else None)
    return [f for f in manifest.files if f.form != "delta" and (forms is None or f.form in forms)
            and (f.form != "gguf" or f is chosen)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _touch(folder: Path) -> None:
    """Mark a model folder as used now (its ``.last_used`` mtime orders LRU pruning)."""
    (folder / ".last_used").touch()


def _drop_orphans(blobs: Path) -> None:
    for blob in blobs.iterdir():
        if not blob.name.endswith(".partial") and blob.stat().st_nlink == 1:
            blob.unlink(missing_ok=True)


def cache_bytes(blobs: Path) -> int:
    """Bytes the cache holds on disk: every blob (model folders are hard links to them) and partial download."""
    return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file())


def last_used(folder: Path) -> float:
    marker = folder / ".last_used"
    return (marker if marker.exists() else folder).stat().st_mtime


def prune_to_cap(models: Path, blobs: Path, max_bytes: int, keep: set[Path]) -> list[Path]:
    """Remove least recently used model folders (of any run) until the blobs total at most ``max_bytes``;
    folders in ``keep`` (the one just fetched, the one in use) stay even if the cap cannot then be met."""
    folders = sorted((f for run in models.iterdir() if run.is_dir() for f in run.iterdir()
                      if f.is_dir() and (f / ".complete").exists()), key=last_used)
    removed = []
    for folder in folders:
        if cache_bytes(blobs) <= max_bytes:
            break
        if folder in keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        _drop_orphans(blobs)
    return removed
