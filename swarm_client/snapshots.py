"""Fetching policy snapshots: verify the signed manifest, download each file by sha256 (resuming partial
downloads with HTTP Range), verify every byte, and assemble a model folder from the content-addressed cache.

Files shared between versions (tokenizer, config) are downloaded once. A file whose hash does not match is
discarded and fetched again; nothing unverified is ever placed in a model folder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
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
                return folder
            signed = wire.decode(await self.client.get_raw(f"/v1/snapshots/{version}"), SignedManifest)
            manifest, sha = open_manifest(signed, self.coordinator_key)
            if manifest_sha256 not in (None, sha) or manifest.version != version or manifest.run_id != run_id:
                raise IntegrityError(f"snapshot manifest for version {version} does not match the one the job names")
            for f in self._wanted(manifest):
                async with self._lock(f.sha256):
                    await self._fetch_blob(f.sha256, f.size)
            self._assemble(folder, manifest, sha)
            self._prune(run_id, keep=folder)
            return folder

    def _wanted(self, manifest: Manifest) -> list[ManifestFile]:
        return [f for f in manifest.files if self.forms is None or f.form in self.forms]

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
        for blob in self.blobs.iterdir():
            if not blob.name.endswith(".partial") and blob.stat().st_nlink == 1:
                blob.unlink(missing_ok=True)
