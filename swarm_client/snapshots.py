"""Fetching policy snapshots: verify the signed manifest, download each file by sha256 (resuming partial
downloads with HTTP Range), verify every byte, and assemble a model folder from the content-addressed cache.

Files shared between versions (tokenizer, config) are downloaded once. A file whose hash does not match is
discarded and fetched again; nothing unverified is ever placed in a model folder.

Size: the newest two versions of a run are kept; with a cap (``max_bytes``) the least recently used model
folders (any run) are also removed until the blobs fit, never the one in use. Before any byte is downloaded
the ``precheck`` hook sees the signed manifest and how many bytes are missing, so the client can refuse a
model too big for the machine's memory or disk (swarm_client/resources.py) instead of failing half-way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp

from shared import wire
from shared.errors import IntegrityError
from shared.hashing import sha256_file
from shared.messages import Manifest, ManifestFile, SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient

logger = logging.getLogger(__name__)
CHUNK = 1 << 20


class SnapshotCache:
    def __init__(self, root: Path, client: CoordinatorClient, coordinator_key: bytes, *, max_attempts: int = 3,
                 max_bytes: int | None = None, precheck: Callable[[Manifest, int], None] | None = None,
                 forms: frozenset[str] | None = None) -> None:
        self.root = Path(root)
        self.forms = forms  # the file forms this client's backend needs (None: all); see ManifestFile.form
        self.blobs = self.root / "blobs"
        self.models = self.root / "snapshots"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.models.mkdir(parents=True, exist_ok=True)
        self.client = client
        self.coordinator_key = coordinator_key
        self.max_attempts = max_attempts
        self.bytes_downloaded = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._in_use: Path | None = None  # the folder the backend generates from: never pruned
        self._busy = 0  # ensure() calls in progress: unlinked blobs may belong to one of them
        self.max_bytes = max_bytes
        self.precheck = precheck

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def ensure(self, run_id: str, version: int, manifest_sha256: str | None) -> Path:
        """Return a verified local model folder for ``version``. ``manifest_sha256`` (from a signed job) pins the
        exact manifest; ``None`` (a prefetch) accepts any manifest the coordinator signed for that version."""
        folder = self.models / run_id / f"v{version:06d}"
        if manifest_sha256 is not None:
            self._in_use = folder
        self._busy += 1
        try:
            return await self._ensure(run_id, version, manifest_sha256, folder)
        finally:
            self._busy -= 1

    async def _ensure(self, run_id: str, version: int, manifest_sha256: str | None, folder: Path) -> Path:
        async with self._lock(str(folder)):
            if (folder / ".complete").exists() and manifest_sha256 in (None, (folder / ".manifest_sha256").read_text()):
                _touch(folder)
                return folder
            signed = wire.decode(await self.client.get_raw(f"/v1/snapshots/{version}"), SignedManifest)
            manifest, sha = open_manifest(signed, self.coordinator_key)
            if manifest_sha256 not in (None, sha) or manifest.version != version or manifest.run_id != run_id:
                raise IntegrityError(f"snapshot manifest for version {version} does not match the one the job names")
            if self.precheck is not None:
                self.precheck(manifest, self.missing_bytes(manifest))
            for f in self._wanted(manifest):
                async with self._lock(f.sha256):
                    await self._fetch_blob(f.sha256, f.size)
            self._assemble(folder, manifest, sha)
            _touch(folder)
            self._prune(run_id, keep=folder)
            return folder

    def _wanted(self, manifest: Manifest) -> list[ManifestFile]:
        return [f for f in manifest.files if self.forms is None or f.form in self.forms]

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

    async def _fetch_blob(self, sha256: str, size: int) -> Path:
        """Download one file into the cache. Interrupted transfers resume (HTTP Range) with backoff; a complete
        file that fails its hash is discarded and fetched again from scratch, at most ``max_attempts`` times."""
        final = self.blobs / sha256
        if final.exists():
            return final
        partial = self.blobs / f"{sha256}.partial"
        corrupt = 0
        for transfer in range(self.client.retry.attempts):
            if not await self._download(sha256, partial, size):
                await asyncio.sleep(self.client.retry.delay(transfer))
                continue
            digest = sha256_file(partial)
            if digest == sha256:
                os.replace(partial, final)
                return final
            corrupt += 1
            partial.unlink(missing_ok=True)
            logger.warning("file %s failed verification (got sha256 %s); fetching it again (%d/%d)",
                           sha256[:12], digest[:12], corrupt, self.max_attempts)
            if corrupt >= self.max_attempts:
                break
        raise IntegrityError(f"could not fetch a verified copy of file {sha256[:12]}")

    async def _download(self, sha256: str, partial: Path, size: int) -> bool:
        """Continue the transfer into ``partial``; True once it holds ``size`` bytes."""
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        if have == size:
            return True
        headers = {"Range": f"bytes={have}-"} if have else {}
        url = f"{self.client.base_url}/v1/blobs/{sha256}"
        try:
            async with self.client.session.get(url, headers=headers) as resp:
                if resp.status not in (200, 206):
                    logger.warning("coordinator answered HTTP %d for file %s", resp.status, sha256[:12])
                    return False
                mode = "ab" if resp.status == 206 else "wb"
                with open(partial, mode) as fh:
                    async for chunk in resp.content.iter_chunked(CHUNK):
                        fh.write(chunk)
                        self.bytes_downloaded += len(chunk)
                        if fh.tell() > size:
                            break
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise  # disk full: retrying cannot help; the client says what to do
            logger.warning("download of %s interrupted (%s); resuming", sha256[:12], exc)
        return partial.exists() and partial.stat().st_size >= size

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
        (tmp / ".complete").write_text("")
        shutil.rmtree(folder, ignore_errors=True)
        os.rename(tmp, folder)

    def _prune(self, run_id: str, keep: Path, keep_last: int = 2) -> None:
        """Keep the newest few model folders; drop blobs no remaining folder links to."""
        run_root = self.models / run_id
        folders = sorted(p for p in run_root.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
        for old in folders[:-keep_last]:
            if old not in (keep, self._in_use):
                shutil.rmtree(old, ignore_errors=True)
        if self._busy > 1:  # another download may still be collecting blobs it has not linked yet
            return
        _drop_orphans(self.blobs)
        if self.max_bytes is not None:
            removed = prune_to_cap(self.models, self.blobs, self.max_bytes,
                                   keep={p for p in (keep, self._in_use) if p is not None})
            if removed:
                logger.info("snapshot cache over %d bytes: removed %s", self.max_bytes,
                            ", ".join(p.name for p in removed))


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
