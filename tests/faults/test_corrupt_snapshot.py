"""A snapshot download corrupted on the wire is detected by its sha256 and fetched again.

A real aiohttp proxy on 127.0.0.1 sits between the client and a live coordinator and flips one byte in the
first response for each weight blob (a flaky link or a bad cache on the way); later responses pass unchanged.
The client's snapshot cache must notice the hash mismatch, throw the bytes away, fetch the file again and end
up with exactly the served weights. A permanently corrupted file is never used (the cache gives up)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from shared import wire
from shared.errors import IntegrityError
from shared.hashing import sha256_bytes
from shared.messages import SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.identity import load_identity
from swarm_client.snapshots import SnapshotCache
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient


@asynccontextmanager
async def corrupting_proxy(upstream: str, corrupt_first: int) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """Forward GETs to ``upstream``; the first ``corrupt_first`` responses per blob get one byte flipped."""
    seen: dict[str, int] = {}
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def forward(request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "range"}
        async with session.get(upstream + request.path_qs, headers=headers) as resp:
            body = await resp.read()
            status, ctype = resp.status, resp.content_type
        if request.path.startswith("/v1/blobs/") and status in (200, 206) and len(body) > 1000:
            n = seen.get(request.path, 0)
            seen[request.path] = n + 1
            if n < corrupt_first:
                body = body[:500] + bytes([body[500] ^ 0x40]) + body[501:]
        return web.Response(body=body, status=status, content_type=ctype)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()
        await session.close()


def _fetch_through_proxy(live: LiveCoordinator, home: Path, corrupt_first: int) -> tuple[Path, int, dict[str, int]]:
    status, raw = RawClient(live.url).get("/v1/snapshots/0")
    assert status == 200
    _, sha = open_manifest(wire.decode(raw, SignedManifest), live.coordinator.public_key)

    async def go() -> tuple[Path, int, dict[str, int]]:
        async with corrupting_proxy(live.url, corrupt_first) as (url, seen):
            client = CoordinatorClient(url, load_identity(home), retry=RetryPolicy(attempts=2, base_s=0.01))
            try:
                cache = SnapshotCache(home / "cache", client, live.coordinator.public_key, max_attempts=3)
                folder = await cache.ensure(live.coordinator.run_id, 0, sha)
                return folder, cache.bytes_downloaded, dict(seen)
            finally:
                await client.close()

    return asyncio.run(go())


def test_corrupted_download_is_detected_and_fetched_again(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    served = live_coordinator.run_dir / "snapshots" / "v000000"
    weights = (served / "model.safetensors").read_bytes()
    folder, downloaded, seen = _fetch_through_proxy(live_coordinator, tmp_path / "home", corrupt_first=1)
    assert (folder / "model.safetensors").read_bytes() == weights  # the good copy, verified
    blob = f"/v1/blobs/{sha256_bytes(weights)}"
    assert seen[blob] == 2  # corrupted once, fetched again once
    assert downloaded >= 2 * len(weights)  # the corrupted bytes were thrown away, not resumed from


def test_persistently_corrupted_download_is_never_used(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    with pytest.raises(IntegrityError):
        _fetch_through_proxy(live_coordinator, tmp_path / "home", corrupt_first=100)
    assert not any((tmp_path / "home" / "cache").rglob("model.safetensors"))
