"""Fetching policy snapshots: verify the signed manifest, download each file by sha256 (resuming partial
downloads with HTTP Range), verify every byte, and assemble a model folder from the content-addressed cache.

Files shared between versions (tokenizer, config) are downloaded once. A file whose hash does not match is
discarded and fetched again; nothing unverified is ever placed in a model folder.

Size: the newest two versions of a run are kept; with a cap (``max_bytes``) the least recently used model
folders (any run) are also removed until the blobs fit, never the one in use. Before any byte is downloaded
the ``precheck`` hook sees the signed manifest and how many bytes are missing, so the client can refuse a
model too big for the machine's memory or disk (swarm_client/resources.py) instead of failing half-way.

Deltas (shared.deltas, docs/protocol.md §6): a whole-weight file the manifest also lists a patch for is rebuilt
from the version this client holds (or through a chain of patches from an older one) when that downloads fewer
bytes than the file. The patch is fetched like any file (sha256, pieces over p2p), applied to a copy of the cached
base, and the result enters the cache only once its sha256 is the manifest's; a patch that fails anywhere is
refused and the full file is fetched instead, so nothing half-applied is ever used.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from shared import wire
from shared.deltas import PatchError, apply_patch
from shared.endpoints import BLOB, SNAPSHOT
from shared.errors import EchoSwarmError, IntegrityError, ProtocolError
from shared.hashing import FileDigest
from shared.messages import Manifest, ManifestFile, SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient, duration_text
from swarm_client.bandwidth import Throttle

if TYPE_CHECKING:
    from swarm_client.peer_fetch import ClientPeer

logger = logging.getLogger(__name__)
CHUNK = 1 << 20
THROTTLED_CHUNK = 64 << 10  # reads under a rate cap: fine-grained enough to hold a cap of well under 1 MB/s
#: A download is flushed to disk every this many bytes, in a thread while it goes on: the verified bytes a resume
#: starts from survive a power loss, and a multi-gigabyte file never piles up as dirty pages, which would stall
#: every other program on the volunteer's machine that writes (Linux throttles all writers beyond a threshold).
FLUSH_BYTES = 64 << 20
IDLE_TIMEOUT_S = 60.0  # a blob transfer is cut (and resumed) only after this long without a byte
CONNECT_TIMEOUT_S = 15.0
MAX_CHAIN = 64  # patches walked back at most (the coordinator's snapshots.anchor_every bounds chains anyway)


class DownloadStalled(EchoSwarmError):
    """A snapshot file stopped arriving: the link to the coordinator is down or stalled (not a bad file)."""


class FileNotServed(DownloadStalled):
    """The coordinator answered 404 for a file every try: it no longer serves it (its version was pruned). For a
    patch that is no fault: the full file is fetched instead. For a full file it ends like a stalled download
    (the job's version is gone; the coordinator says so when the result comes back)."""


@dataclass
class Transfer:
    """A file download in progress, as the client's panel shows it: bytes, smoothed rate and time left."""

    name: str
    done: int
    total: int
    rate: float = 0.0  # bytes/s, smoothed over about RATE_WINDOW_S
    _mark_t: float = field(default_factory=time.monotonic, repr=False)
    _mark_bytes: int = field(default=0, repr=False)

    def restart(self, done: int) -> None:
        self.done = done
        self._mark_t, self._mark_bytes = time.monotonic(), done

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if (dt := now - self._mark_t) >= RATE_WINDOW_S:
            sample = (self.done - self._mark_bytes) / dt
            self.rate = sample if self.rate == 0 else 0.7 * self.rate + 0.3 * sample
            self._mark_t, self._mark_bytes = now, self.done

    @property
    def eta_s(self) -> float | None:
        return (self.total - self.done) / self.rate if self.rate > 0 else None

    def describe(self) -> str:
        """E.g. ``v12 model.safetensors  412 MB / 988 MB (42 %) · 4.2 MB/s · 2m17s left``."""
        pct = 100 * self.done / self.total if self.total else 100.0
        text = f"{self.name}  {_mb(self.done)} / {_mb(self.total)} ({pct:.0f} %)"
        if self.rate > 0:
            text += f" · {self.rate / 1e6:.1f} MB/s"
        if (eta := self.eta_s) is not None:
            text += f" · {duration_text(eta)} left"
        return text


RATE_WINDOW_S = 1.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"




class SnapshotCache:
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
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.on_progress = on_progress  # the transfer in progress (None when it ends), for the client's panel
        self.peers: ClientPeer | None = None  # `join --p2p`: try other volunteers first (swarm_client/peer_fetch.py)
        self.throttle = throttle  # the volunteer's download rate cap (swarm_client.bandwidth)
        self.count = count  # every byte downloaded, for the monthly data budget
        self.patched = 0  # files rebuilt from a patch (the panel and the benches)
        self.patches_refused = 0  # patches that failed and were replaced by the full file
        self.patch_apply_s = 0.0  # time spent applying patches and hashing their results

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
                        await self._rebuild(manifest, f)
                    await self._fetch_blob(f.sha256, f.size, f"v{version} {f.path}", f)
            if self.peers is not None:
                await self.peers.announce_pending()
            self._assemble(folder, manifest, sha)
            _touch(folder)
            self._prune(run_id, keep=folder)
            return folder

    async def manifest(self, version: int) -> tuple[Manifest, str]:
        """``version``'s manifest, its signature checked against the pinned coordinator key, and its sha256."""
        signed = wire.decode(await self.client.get_raw(SNAPSHOT.at(version=version)), SignedManifest)
        return open_manifest(signed, self.coordinator_key)

    def _wanted(self, manifest: Manifest) -> list[ManifestFile]:
        """The files this client's model folder holds (patches are only a way to get some of them)."""
        return wanted_files(manifest, self.forms, self.precision)

    # -- deltas -----------------------------------------------------------------------------------------------
    async def _rebuild(self, manifest: Manifest, file: ManifestFile) -> None:
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
                        await self._fetch_blob(delta.sha256, delta.size, f"v{version} {delta.path}", delta)
                    await self._apply(delta, target)
        except IntegrityError as exc:  # PatchError included: a bad patch, never a bad full file
            self.patches_refused += 1
            logger.warning("patch for %s refused (%s); fetching the full file instead", file.path, exc)
        except FileNotServed as exc:  # an older version of the chain was pruned while this client walked it
            logger.info("%s; fetching the full file %s instead", exc, file.path)

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
            signed = wire.decode(await self.client.get_raw(SNAPSHOT.at(version=version)), SignedManifest)
            manifest, _ = open_manifest(signed, self.coordinator_key)
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
            self.patch_apply_s += took
        self.patched += 1
        # bench/scale.py reads this line from the client's log: keep its wording
        logger.info("rebuilt %s (%d bytes) from a %d-byte patch in %.3fs", target.path, target.size, delta.size, took)
        if self.peers is not None:
            await self.peers.announce([target.sha256])

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

    async def _fetch_blob(self, sha256: str, size: int, name: str = "", file: ManifestFile | None = None) -> Path:
        """Download one file into the cache, for home links: a transfer is cut only when no byte arrived for
        ``idle_timeout_s`` (never for taking long), and every retry resumes (HTTP Range) from the bytes already on
        disk — also after a client restart, since the partial file stays. Only transfers that add no byte count
        toward giving up (``retry.attempts`` in a row), so a slow but moving link always finishes. A complete file
        that fails its hash is discarded and fetched again from scratch, at most ``max_attempts`` times.

        The two failures say different things: :class:`DownloadStalled` (the link) and IntegrityError (the bytes).
        With p2p on (``self.peers``), peers are asked first, every piece checked as it arrives; HTTP then fetches
        whatever they did not deliver, from the first unverified byte."""
        final = self.blobs / sha256
        if final.exists():
            return final
        partial = self.blobs / f"{sha256}.partial"
        corrupt = stalled = 0
        last_error = ""
        transfer = Transfer(name or sha256[:12], _size(partial), size)
        digest = FileDigest()  # the whole file's sha256, fed as bytes are written: no second pass to check it
        try:
            if self.peers is not None and file is not None:
                transfer.restart(_size(partial))

                def advanced(n: int) -> None:
                    transfer.advance(n)
                    if self.count is not None:  # bytes from peers count toward the month's budget too
                        self.count(n)
                    self._report(transfer)

                await self.peers.fetch(file, partial, advanced, digest)
            while True:
                before = _size(partial)
                complete, error, status = await self._download(sha256, partial, size, transfer, digest)
                if complete:
                    await asyncio.to_thread(digest.catch_up, partial)  # what it has not seen (normally nothing)
                    got = digest.hexdigest()
                    if got == sha256:
                        os.replace(partial, final)
                        if self.peers is not None:
                            await self.peers.announce([sha256])  # serve it from now on (whole, verified)
                        return final
                    corrupt += 1
                    partial.unlink(missing_ok=True)
                    digest.reset()
                    transfer.done = 0
                    logger.warning("file %s failed its sha256 check (got %s); fetching it again (%d/%d)",
                                   transfer.name, got[:12], corrupt, self.max_attempts)
                    if corrupt >= self.max_attempts:
                        raise IntegrityError(
                            f"file {transfer.name} ({sha256[:12]}) arrived complete but failed its sha256 check "
                            f"{corrupt} times: the coordinator, a proxy or the disk is corrupting it (the link "
                            f"itself worked). Tell the coordinator's operator; nothing unverified was used")
                    continue
                last_error = error or last_error
                stalled = 0 if _size(partial) > before else stalled + 1
                if stalled >= self.client.retry.attempts:
                    if status == 404:
                        raise FileNotServed(
                            f"the coordinator no longer serves {transfer.name} (HTTP 404, {stalled} tries): its "
                            f"version was pruned. Nothing to fix here; newer jobs name newer versions")
                    raise DownloadStalled(
                        f"download of {transfer.name} stopped at {_mb(_size(partial))} of {_mb(size)}: "
                        f"{stalled} attempts in a row added no byte (last: {last_error or 'no data'}). The link "
                        f"to the coordinator is down or stalled for over {self.idle_timeout_s:.0f}s at a time; check "
                        f"the connection. The bytes so far are kept and the next try resumes from them")
                # a transfer that moved resumes at once; one that did not backs off
                await asyncio.sleep(self.client.retry.delay(stalled - 1) if stalled else 0.2)
        finally:
            self._report(None)

    async def _download(self, sha256: str, partial: Path, size: int, transfer: Transfer, digest: FileDigest
                        ) -> tuple[bool, str, int | None]:
        """Continue the transfer into ``partial``: (complete, what interrupted it, the refusing HTTP status).
        ``digest`` is fed every byte written."""
        have = _size(partial)
        if have > size:
            partial.unlink()
            have = 0
        if have == size:
            return True, "", None
        headers = {"Range": f"bytes={have}-"} if have else {}
        url = self.client.base_url + BLOB.at(sha256=sha256)
        # no total timeout: a 15 GB file over a 5 MB/s link takes most of an hour and must still arrive
        timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s, sock_connect=self.connect_timeout_s,
                                        sock_read=self.idle_timeout_s)
        error = ""
        try:
            async with self.client.session.get(url, headers=headers, timeout=timeout) as resp:
                if resp.status not in (200, 206):
                    error = f"HTTP {resp.status}"
                    logger.warning("coordinator answered HTTP %d for file %s", resp.status, transfer.name)
                    return False, error, resp.status
                mode = "ab" if resp.status == 206 else "wb"
                if mode == "wb":
                    digest.reset()
                else:
                    await asyncio.to_thread(digest.catch_up, partial)  # bytes a restart or another writer left
                with open(partial, mode) as fh:
                    transfer.restart(fh.tell() if mode == "ab" else 0)
                    flushed, flushing = fh.tell(), None
                    throttle = self.throttle if self.throttle is not None and self.throttle.rate else None
                    try:
                        # capped: small reads, each taken from the bucket before the next (TCP then slows the sender)
                        async for chunk in resp.content.iter_chunked(THROTTLED_CHUNK if throttle else CHUNK):
                            fh.write(chunk)
                            digest.update(chunk)
                            if self.count is not None:
                                self.count(len(chunk))
                            if throttle is not None:
                                await throttle.take(len(chunk))
                            self.bytes_downloaded += len(chunk)
                            transfer.advance(len(chunk))
                            self._report(transfer)
                            if fh.tell() > size:
                                break
                            if fh.tell() - flushed >= FLUSH_BYTES and (flushing is None or flushing.done()):
                                fh.flush()
                                flushed = fh.tell()
                                flushing = asyncio.ensure_future(asyncio.to_thread(os.fdatasync, fh.fileno()))
                    finally:
                        if flushing is not None:  # before the file (and its descriptor) is closed
                            await asyncio.gather(flushing, return_exceptions=True)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise  # disk full: retrying cannot help; the client says what to do
            error = f"{type(exc).__name__}: {exc}" if str(exc) else (
                f"no byte for {self.idle_timeout_s:.0f}s" if isinstance(exc, TimeoutError) else type(exc).__name__)
            logger.warning("download of %s interrupted at %s of %s (%s); resuming", transfer.name,
                           _mb(_size(partial)), _mb(size), error)
        return _size(partial) >= size, error, None

    def _report(self, transfer: Transfer | None) -> None:
        if self.on_progress is not None:
            self.on_progress(transfer)

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
