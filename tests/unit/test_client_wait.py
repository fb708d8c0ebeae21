"""`join --wait-for-coordinator`: a client started with its coordinator looks for it at a steady pace (no
backoff) until it answers, and gives up on time when it never does."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from aiohttp import web

from swarm_client.api import CoordinatorClient
from swarm_client.identity import load_identity


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_up_waits_through_a_starting_coordinator_and_stops_at_its_first_200(tmp_path: Path) -> None:
    async def main() -> None:
        seen: list[int] = []

        async def healthz(request: web.Request) -> web.Response:
            seen.append(1)
            return web.Response(status=503 if len(seen) < 3 else 200, text="starting" if len(seen) < 3 else "ok")

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        api = CoordinatorClient(f"http://127.0.0.1:{port}", load_identity(tmp_path))
        try:
            assert await api.up(60.0, every_s=0.01)
            assert len(seen) == 3  # two "starting" answers, then up: no request after the first 200
        finally:
            await api.close()
            await runner.cleanup()

    asyncio.run(main())


def test_up_gives_up_after_its_time_when_nothing_listens(tmp_path: Path) -> None:
    async def main() -> None:
        api = CoordinatorClient(f"http://127.0.0.1:{_free_port()}", load_identity(tmp_path))
        try:
            t0 = time.monotonic()
            assert not await api.up(0.3, every_s=0.05)
            assert time.monotonic() - t0 < 10  # refused connections are retried at the pace, then it stops
        finally:
            await api.close()

    asyncio.run(main())
