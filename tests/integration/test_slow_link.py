"""Snapshot downloads over home links (swarm_client/snapshots.py), against a real aiohttp server on 127.0.0.1
that serves a signed manifest and trickles, stalls or corrupts the file's bytes:

- a transfer that takes far longer than the client's request timeout still arrives (only an idle link is cut);
- a link that stalls mid-file is cut after the idle timeout and the next transfer resumes from the bytes on disk;
- a client restarted mid-download resumes where the previous one stopped;
- a link that delivers nothing and a file that fails its hash end with different errors, saying which it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import crypto, wire
from shared.errors import IntegrityError
from shared.records import build_manifest, sign_manifest
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.blob_fetch import DownloadStalled, Transfer
from swarm_client.identity import load_identity
from swarm_client.snapshots import SnapshotCache

SIZE = 3 * 1024 * 1024
RUN_ID = "slowlinkrun1"


@dataclass
class Link:
    """How the test server misbehaves. ``rate`` bytes/s; ``stall_at``: stop sending (keep the connection open) at
    this offset, on the first ``stalls`` transfers that reach it; ``corrupt``: flip a byte of every copy."""

    rate: float = 1e9
    stall_at: int | None = None
    stalls: int = 1
    silent: bool = False
    corrupt: bool = False
    ranges: list[int] = field(default_factory=list)  # start offset of every transfer
    served: int = 0


@contextlib.asynccontextmanager
async def serve(folder: Path, key: Ed25519PrivateKey, link: Link) -> AsyncIterator[str]:
    manifest = build_manifest(folder, run_id=RUN_ID, version=1, created_at=0.0)
    signed = wire.encode(sign_manifest(key, manifest))
    blobs = {f.sha256: folder / f.path for f in manifest.files}

    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=signed, content_type="application/msgpack")

    async def blob(request: web.Request) -> web.StreamResponse:
        data = blobs[request.match_info["sha"]].read_bytes()
        if link.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = int(request.headers["Range"].split("=")[1].rstrip("-")) if "Range" in request.headers else 0
        link.ranges.append(start)
        resp = web.StreamResponse(status=206 if start else 200)
        resp.content_length = len(data) - start
        await resp.prepare(request)
        if link.silent:
            await asyncio.Event().wait()  # headers, then nothing, ever (the client must cut it)
        step = 64 * 1024
        for offset in range(start, len(data), step):
            if link.stall_at is not None and link.stalls > 0 and offset >= link.stall_at:
                link.stalls -= 1
                await asyncio.Event().wait()  # stalls until the client hangs up
            chunk = data[offset : offset + step]
            await resp.write(chunk)
            link.served += len(chunk)
            await asyncio.sleep(len(chunk) / link.rate)  # the trickle: this server's bandwidth
        return resp

    app = web.Application()
    app.router.add_get("/v1/snapshots/{version}", snapshot)
    app.router.add_get("/v1/blobs/{sha}", blob)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
def snapshot_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(SIZE))
    (folder / "config.json").write_text("{}")
    return folder


async def fetch(home: Path, url: str, key: Ed25519PrivateKey, *, request_timeout_s: float = 30.0,
                idle_timeout_s: float = 60.0, attempts: int = 3,
                progress: list[tuple[float, Transfer]] | None = None) -> Path:
    """Fetch version 1 into ``home``'s cache; ``progress`` collects (monotonic time, copy) of every progress report."""
    client = CoordinatorClient(url, load_identity(home / "id"), timeout_s=request_timeout_s,
                               retry=RetryPolicy(attempts=attempts, base_s=0.05, max_s=0.2))
    seen = progress if progress is not None else []
    cache = SnapshotCache(home / "cache", client, crypto.public_bytes(key), idle_timeout_s=idle_timeout_s,
                          on_progress=lambda t: seen.append((time.monotonic(), Transfer(t.name, t.done, t.total, t.rate)))
                          if t is not None else None)
    try:
        return await cache.ensure(RUN_ID, 1, None)
    finally:
        await client.close()


def _same(folder: Path, published: Path) -> bool:
    return (folder / "model.safetensors").read_bytes() == (published / "model.safetensors").read_bytes()


def test_a_transfer_longer_than_the_request_timeout_arrives(tmp_path: Path, snapshot_folder: Path) -> None:
    """3 MiB at 1 MiB/s takes ~3 s; the client's request timeout (the API's total) is 1 s. Only idleness cuts a
    download, so it arrives in one transfer, and the progress reports carry a rate and a time left. The rates are
    judged against the rate the test itself measures over the same reports (bytes between the first and the last
    report over the seconds between them), not against fixed bounds a loaded machine cannot promise."""
    key = crypto.generate_key()
    link = Link(rate=1024 * 1024)
    progress: list[tuple[float, Transfer]] = []

    async def main() -> Path:
        async with serve(snapshot_folder, key, link) as url:
            return await fetch(tmp_path, url, key, request_timeout_s=1.0, progress=progress)

    folder = asyncio.run(main())
    assert _same(folder, snapshot_folder)
    blob_transfers = [r for r in link.ranges]
    assert blob_transfers.count(0) == 2 and len(blob_transfers) == 2  # the model file and config.json, once each
    model = [(at, t) for at, t in progress if t.total == SIZE]
    rated = [t for _, t in model if t.rate > 0]
    (t0, first), (t1, last) = model[0], model[-1]
    assert t1 - t0 > 1.0  # the transfer outlasted the 1-s request timeout, and was not cut
    measured = (last.done - first.done) / (t1 - t0)  # side by side: what the reports' own bytes and times say
    assert rated and all(measured / 3 < t.rate < measured * 3 for t in rated), (measured, [t.rate for t in rated])
    assert "MB/s" in rated[-1].describe() and "left" in rated[-1].describe()


def test_a_stalled_link_is_cut_and_resumed_from_the_bytes_on_disk(tmp_path: Path, snapshot_folder: Path) -> None:
    key = crypto.generate_key()
    link = Link(stall_at=SIZE // 2, stalls=2)

    async def main() -> Path:
        async with serve(snapshot_folder, key, link) as url:
            return await fetch(tmp_path, url, key, idle_timeout_s=0.5)

    folder = asyncio.run(main())
    assert _same(folder, snapshot_folder)
    model_ranges = [r for r in link.ranges if r not in (0,)]
    assert model_ranges and all(r >= SIZE // 2 for r in model_ranges)  # resumed mid-file, never from scratch
    assert link.served <= SIZE + 64 * 1024 * 4  # nothing downloaded twice beyond the chunk in flight


def test_a_restarted_client_resumes_where_the_last_one_stopped(tmp_path: Path, snapshot_folder: Path) -> None:
    key = crypto.generate_key()
    # the first client gives up during a long stall (as if killed); its partial file stays in the cache
    link = Link(stall_at=SIZE // 3, stalls=10)

    async def first() -> None:
        async with serve(snapshot_folder, key, link) as url:
            with pytest.raises(DownloadStalled):
                await fetch(tmp_path, url, key, idle_timeout_s=0.3, attempts=1)

    asyncio.run(first())
    partials = list((tmp_path / "cache" / "blobs").glob("*.partial"))
    assert len(partials) == 1 and partials[0].stat().st_size >= SIZE // 3

    link2 = Link()

    async def second() -> Path:
        async with serve(snapshot_folder, key, link2) as url:
            return await fetch(tmp_path, url, key)

    folder = asyncio.run(second())
    assert _same(folder, snapshot_folder)
    assert max(link2.ranges) >= SIZE // 3  # the new process asked only for the rest
    assert link2.served < SIZE


def test_a_dead_link_and_a_corrupt_file_say_different_things(tmp_path: Path, snapshot_folder: Path) -> None:
    key = crypto.generate_key()

    async def dead() -> str:
        async with serve(snapshot_folder, key, Link(silent=True)) as url:
            with pytest.raises(DownloadStalled) as err:
                await fetch(tmp_path / "a", url, key, idle_timeout_s=0.3, attempts=2)
            return str(err.value)

    async def corrupt() -> str:
        async with serve(snapshot_folder, key, Link(corrupt=True)) as url:
            with pytest.raises(IntegrityError) as err:
                await fetch(tmp_path / "b", url, key)
            return str(err.value)

    stalled, bad = asyncio.run(dead()), asyncio.run(corrupt())
    assert "link" in stalled and "added no byte" in stalled and "resumes" in stalled
    assert "failed its sha256 check" in bad and "corrupting" in bad
    assert "sha256" not in stalled and "link to the coordinator" not in bad
    # nothing unverified entered the cache
    for home in (tmp_path / "a", tmp_path / "b"):
        blobs = home / "cache" / "blobs"
        digest = hashlib.sha256((snapshot_folder / "model.safetensors").read_bytes()).hexdigest()
        assert not (blobs / digest).exists()
