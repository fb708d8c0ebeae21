"""Rebuilding a snapshot file from one this client already holds and the version's patch (docs/protocol.md §6).

A whole-weight file the manifest also lists a patch for is rebuilt from the version this client holds (or through a
chain of patches from an older one) when that downloads fewer bytes than the file. A patch is fetched like any file
(sha256, pieces over p2p), applied to a copy of the cached base, and the result enters the cache only once its
sha256 is the manifest's; a patch that fails anywhere is refused and the full file is fetched instead, so nothing
half-applied is ever used.

Split from swarm_client/snapshots.py (issue 33): the cache asks for a file; this module only tries the cheaper way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable

from shared.deltas import PatchError, apply_patch
from shared.errors import IntegrityError, ProtocolError
from shared.messages import Manifest, ManifestFile
from swarm_client.blob_fetch import BlobFetcher, FileNotServed, _size

logger = logging.getLogger(__name__)
MAX_CHAIN = 64  # patches walked back at most (the coordinator's snapshots.anchor_every bounds chains anyway)


class Patches:
    """Rebuilds files through patch chains; counts the files rebuilt (``patched``) and the patches refused
    (``patches_refused``: each replaced by the full file)."""

    def __init__(self, fetcher: BlobFetcher, manifests: Callable[[int], Awaitable[tuple[Manifest, str]]],
                 lock: Callable[[str], asyncio.Lock]) -> None:
        self.fetcher = fetcher
        self.blobs = fetcher.blobs
        self.manifests = manifests  # a version's manifest, its signature checked (SnapshotCache.manifest)
        self._lock = lock  # the cache's lock per file: a file is fetched or rebuilt by one task at a time
        self.patched = 0
        self.patches_refused = 0

    async def rebuild(self, manifest: Manifest, file: ManifestFile) -> None:
        """Try to rebuild ``file`` from a cached earlier version and patches; on any failure only say why (the
        caller then fetches the full file). A patch no longer served (pruned) is a reason too; a stalled link is
        not a bad patch: it propagates."""
        chain = await self._chain(manifest, file)
        if not chain:
            return
        try:
            for delta, target, version in reversed(chain):  # oldest patch first
                # an intermediate file may be wanted by another download at the same time (the caller holds
                # ``file``'s lock already)
                async with contextlib.AsyncExitStack() as stack:
                    if target is not file:
                        await stack.enter_async_context(self._lock(target.sha256))
                    if (self.blobs / target.sha256).exists():
                        continue
                    async with self._lock(delta.sha256):
                        await self.fetcher.fetch(delta.sha256, delta.size, f"v{version} {delta.path}", delta)
                    await self._apply(delta, target)
        except IntegrityError as exc:  # PatchError included: a bad patch, never a bad full file
            self.patches_refused += 1
            logger.warning("patch for %s refused (%s); fetching the full file instead", file.path, exc)
        except FileNotServed as exc:  # an older version of the chain was pruned while this client walked it
            logger.info("%s; fetching the full file %s instead", exc, file.path)
        except FileNotFoundError as exc:  # the base file left this cache meanwhile (its version pruned, e.g. by a
            # prefetch of another version finishing): an absent base, no fault of the patch's
            logger.info("the base of a patch for %s left the cache meanwhile (%s); fetching the full file instead",
                        file.path, exc.filename)

    async def _chain(self, manifest: Manifest, file: ManifestFile) -> list[tuple[ManifestFile, ManifestFile, int]]:
        """(patch, file it rebuilds, version), newest first, back to a file this cache holds, if those patches
        are fewer bytes than what is left of the full file to download; [] otherwise."""
        partial = self.blobs / f"{file.sha256}.partial"
        left = file.size - (_size(partial) if partial.exists() else 0)
        chain: list[tuple[ManifestFile, ManifestFile, int]] = []
        cost, current, target = 0, manifest, file
        for _ in range(MAX_CHAIN):
            delta = next((d for d in current.files if d.form == "delta" and d.result_sha256 == target.sha256), None)
            if delta is None or delta.base_sha256 is None:
                return []
            cost += 0 if (self.blobs / delta.sha256).exists() else delta.size
            if cost >= left:
                return []
            chain.append((delta, target, current.version))
            if (self.blobs / delta.base_sha256).exists():
                return chain
            previous = await self._older_manifest(current.run_id, current.version - 1)
            base = next((f for f in previous.files if f.form != "delta" and f.sha256 == delta.base_sha256),
                        None) if previous is not None else None
            if previous is None or base is None:
                return []
            current, target = previous, base
        return []

    async def _older_manifest(self, run_id: str, version: int) -> Manifest | None:
        """An earlier version's manifest, verified like any (signature, run, version); None if it is not served."""
        if version < 0:
            return None
        try:
            manifest, _ = await self.manifests(version)
        except ProtocolError as exc:  # pruned (no_such_version), or not a manifest: no chain through it
            logger.debug("no manifest for version %d: %s", version, exc)
            return None
        return manifest if manifest.version == version and manifest.run_id == run_id else None

    async def _apply(self, delta: ManifestFile, target: ManifestFile) -> None:
        """base + patch → the target file, which enters the cache only if its sha256 is the manifest's."""
        assert delta.base_sha256 is not None
        out = self.blobs / f"{target.sha256}.rebuild"
        t0 = time.monotonic()
        try:
            digest = await asyncio.to_thread(apply_patch, self.blobs / delta.base_sha256, self.blobs / delta.sha256,
                                             out, base_sha256=delta.base_sha256, result_sha256=target.sha256)
            if digest != target.sha256:
                raise PatchError(f"{delta.path} rebuilt a file whose sha256 is {digest[:12]}, not the manifest's "
                                 f"{target.sha256[:12]}")
            os.replace(out, self.blobs / target.sha256)
        finally:
            out.unlink(missing_ok=True)
            took = time.monotonic() - t0
        self.patched += 1
        # bench/scale.py reads this line from the client's log: keep its wording
        logger.info("rebuilt %s (%d bytes) from a %d-byte patch in %.3fs", target.path, target.size, delta.size, took)
        if self.fetcher.peers is not None:
            await self.fetcher.peers.announce([target.sha256])
