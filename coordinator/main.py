"""Entry point of `echo-swarm coordinator`: serve one run until interrupted."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from aiohttp import web

from coordinator.app import FATAL, create_app
from coordinator.config import CoordinatorConfig

logger = logging.getLogger(__name__)


async def serve(config: CoordinatorConfig) -> int:
    """Run the coordinator until SIGINT/SIGTERM (exit 0) or a learner failure (exit 1)."""
    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port, reuse_address=True)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else config.server.port
    url = f"http://{config.server.host}:{port}"
    (config.run_dir / "endpoint.json").write_text(json.dumps({"url": url, "port": port}))
    print(f"echo-swarm coordinator listening on {url} (run dir {config.run_dir})", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(app[FATAL].wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    fatal = app[FATAL].is_set()
    print("echo-swarm coordinator stopping" + (" after a learner failure" if fatal else ""), flush=True)
    await runner.cleanup()
    return 1 if fatal else 0


def run(config: CoordinatorConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return asyncio.run(serve(config))
