"""Serving the API role's HTTP app on its listener until SIGINT/SIGTERM: alone (the process layout's ``api`` role) or
with the other roles in this process (the one-process layout, coordinator.launch.one_process)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import signal
import time

from aiohttp import web

from coordinator.api import netguard
from coordinator.api.app import CONN_GUARD, COORDINATOR, FATAL, create_app
from coordinator.config import CoordinatorConfig
from coordinator.launch import one_process
from coordinator.run.names import API
from coordinator.run.records import ProcessReport
from coordinator.store.store import Store
from shared.exit_codes import ExitCode

logger = logging.getLogger(__name__)


async def serve(config: CoordinatorConfig, *, all_roles: bool = True, name: str = API) -> int:
    """Serve the API (with the learner and a verifier in this process if ``all_roles``) until SIGINT/SIGTERM
    (exit 0) or a learner failure (exit 1). ``name``: "api", or "api-N" for the N-th extra API process on a
    shared PostgreSQL store (it writes endpoint-api-N.json)."""
    app = one_process.create_app(config) if all_roles else create_app(config)
    app[COORDINATOR].api_name = name
    try:
        runner, site = await start_site(app, config)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # taken after the pre-flight check (two coordinators started at once): a restart cannot fix it
        logger.critical("port %d on %s is in use: pass another --port (server.port; 0 picks a free one), or stop "
                        "what uses it", config.server.port, config.server.host)
        return int(ExitCode.PORT_IN_USE)
    port = site.port
    url = f"http://{config.server.host}:{port}"
    report_pid(app[COORDINATOR].store, name)
    endpoint = "endpoint.json" if name == API else f"endpoint-{name}.json"
    (config.run_dir / endpoint).write_text(json.dumps({"url": url, "port": port}))
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


async def start_site(app: web.Application, config: CoordinatorConfig) -> tuple[web.AppRunner, netguard.GuardedSite]:
    """Serve ``app`` on server.host:port with bounded connections: the soft file limit raised to the hard
    one, and the connection cap derived from it (coordinator.api.netguard)."""
    guard = app[CONN_GUARD]
    guard.set_fd_limit(netguard.raise_fd_limit())
    runner = web.AppRunner(app, handle_signals=False, keepalive_timeout=config.server.keepalive_timeout_s,
                           access_log=logger, access_log_class=netguard.ReplyWritten)  # marks replies done
    await runner.setup()
    site = netguard.GuardedSite(runner, guard, config.server.host, config.server.port)
    await site.start()
    logger.info("connections: at most %d open (%d per address); file limit %d", guard.caps.total,
                guard.caps.per_address, guard.fd_limit)
    return runner, site


def report_pid(store: Store, role: str) -> None:
    """The API's entry in the roles' status (the learner and the verifiers report their own)."""
    store.role_status.set(role, ProcessReport(started_at=time.time()))
