"""Downloading one content-addressed file into the snapshot cache over a volunteer's home link.

A transfer is cut only when no byte arrived for a while (never for taking long: a 15 GB file over a slow link must
still arrive), every retry resumes with HTTP Range from the bytes on disk (also after a restart: the partial file
stays), and the file's sha256 is computed as bytes are written, so a complete file is checked without reading it
again. The two failures say different things to the volunteer: :class:`DownloadStalled` (the link) and
IntegrityError (the bytes). With p2p on, peers are asked first and HTTP fetches what they did not deliver.

Split from swarm_client/snapshots.py (issue 33): the cache decides *which* files a version needs and assembles
folders; this module only moves bytes and says how it went (the panel's :class:`Transfer`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from shared.endpoints import BLOB
from shared.errors import EchoSwarmError, IntegrityError
from shared.hashing import FileDigest
from shared.messages import ManifestFile
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
RATE_WINDOW_S = 1.0


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



def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"




class BlobFetcher:
    """Fetches files by sha256 into ``blobs``; counts the bytes (``bytes_downloaded``, the month's budget through
    ``count``) and reports the transfer in progress (``on_progress``) for the panel."""

    def __init__(self, blobs: Path, client: CoordinatorClient, *, max_attempts: int = 3,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 on_progress: Callable[[Transfer | None], None] | None = None, throttle: Throttle | None = None,
                 count: Callable[[int], None] | None = None) -> None:
        self.blobs = blobs
        self.client = client
        self.max_attempts = max_attempts
        self.idle_timeout_s = idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.on_progress = on_progress  # the transfer in progress (None when it ends), for the client's panel
        self.throttle = throttle  # the volunteer's download rate cap (swarm_client.bandwidth)
        self.count = count  # every byte downloaded, for the monthly data budget
        self.peers: ClientPeer | None = None  # `join --p2p`: try other volunteers first (swarm_client/peer_fetch.py)
        self.bytes_downloaded = 0

    async def fetch(self, sha256: str, size: int, name: str = "", file: ManifestFile | None = None) -> Path:
        """Download one file into the cache (see the module docstring). Only transfers that add no byte count
        toward giving up (``retry.attempts`` in a row), so a slow but moving link always finishes; a complete file
        that fails its hash is discarded and fetched again from scratch, at most ``max_attempts`` times."""
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
                await self._from_peers(file, partial, transfer, digest)
            while True:
                before = _size(partial)
                complete, error, status = await self._download(sha256, partial, size, transfer, digest)
                if complete:
                    got = await self._verified(sha256, partial, digest)
                    if got is None:
                        return final
                    corrupt += 1
                    transfer.done = 0
                    self._corrupt(transfer, sha256, got, corrupt)
                    continue
                last_error = error or last_error
                stalled = 0 if _size(partial) > before else stalled + 1
                if stalled >= self.client.retry.attempts:
                    raise self._gave_up(transfer, partial, size, stalled, status, last_error)
                # a transfer that moved resumes at once; one that did not backs off
                await asyncio.sleep(self.client.retry.delay(stalled - 1) if stalled else 0.2)
        finally:
            self._report(None)

    async def _from_peers(self, file: ManifestFile, partial: Path, transfer: Transfer, digest: FileDigest) -> None:
        """Whatever other volunteers deliver of ``file``, every piece checked as it arrives."""
        assert self.peers is not None
        transfer.restart(_size(partial))

        def advanced(n: int) -> None:
            transfer.advance(n)
            if self.count is not None:  # bytes from peers count toward the month's budget too
                self.count(n)
            self._report(transfer)

        await self.peers.fetch(file, partial, advanced, digest)

    async def _verified(self, sha256: str, partial: Path, digest: FileDigest) -> str | None:
        """A complete download whose sha256 is ``sha256`` enters the cache (and is served to peers): None. One
        that is not is discarded, to be fetched again from scratch: the sha256 it had."""
        await asyncio.to_thread(digest.catch_up, partial)  # what it has not seen (normally nothing)
        got = digest.hexdigest()
        if got == sha256:
            os.replace(partial, self.blobs / sha256)
            if self.peers is not None:
                await self.peers.announce([sha256])  # serve it from now on (whole, verified)
            return None
        partial.unlink(missing_ok=True)
        digest.reset()
        return got

    def _corrupt(self, transfer: Transfer, sha256: str, got: str, corrupt: int) -> None:
        logger.warning("file %s failed its sha256 check (got %s); fetching it again (%d/%d)",
                       transfer.name, got[:12], corrupt, self.max_attempts)
        if corrupt >= self.max_attempts:
            raise IntegrityError(
                f"file {transfer.name} ({sha256[:12]}) arrived complete but failed its sha256 check "
                f"{corrupt} times: the coordinator, a proxy or the disk is corrupting it (the link "
                f"itself worked). Tell the coordinator's operator; nothing unverified was used")

    def _gave_up(self, transfer: Transfer, partial: Path, size: int, stalled: int, status: int | None,
                 last_error: str) -> DownloadStalled:
        if status == 404:
            return FileNotServed(
                f"the coordinator no longer serves {transfer.name} (HTTP 404, {stalled} tries): its "
                f"version was pruned. Nothing to fix here; newer jobs name newer versions")
        return DownloadStalled(
            f"download of {transfer.name} stopped at {_mb(_size(partial))} of {_mb(size)}: "
            f"{stalled} attempts in a row added no byte (last: {last_error or 'no data'}). The link "
            f"to the coordinator is down or stalled for over {self.idle_timeout_s:.0f}s at a time; check "
            f"the connection. The bytes so far are kept and the next try resumes from them")

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
