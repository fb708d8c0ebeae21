"""Entry point of `echo-swarm coordinator`: serve one run until interrupted — every role as its own process
(coordinator.launch.processes.supervise), all roles in this one, or a single role (``--role``)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from aiohttp import web

from coordinator.api import netguard
from coordinator.api.app import CONN_GUARD, COORDINATOR, FATAL, create_app
from coordinator.config import CoordinatorConfig

logger = logging.getLogger(__name__)


async def serve(config: CoordinatorConfig, *, all_roles: bool = True, name: str = "api") -> int:
    """Serve the API (with the learner and a verifier in this process if ``all_roles``) until SIGINT/SIGTERM
    (exit 0) or a learner failure (exit 1). ``name``: "api", or "api-N" for the N-th extra API process on a
    shared PostgreSQL store (it writes endpoint-api-N.json)."""
    app = create_app(config, all_roles=all_roles)
    app[COORDINATOR].api_name = name
    runner, site = await start_site(app, config)
    port = site.port
    url = f"http://{config.server.host}:{port}"
    from coordinator.launch.processes import report_pid

    report_pid(app[COORDINATOR].store, name)
    endpoint = "endpoint.json" if name == "api" else f"endpoint-{name}.json"
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


def run(config: CoordinatorConfig, role: str = "all", index: int = 0, parent: int | None = None) -> int:
    from shared import safe_text  # every record one line, client text escaped (issue 13)

    label = "" if role == "all" else f"{role}{index if role == 'verifier' else ''} "
    safe_text.configure_logging(logging.INFO, f"%(asctime)s %(levelname)s {label}%(name)s: %(message)s", sys.stderr)
    from coordinator.launch.processes import CONFIG_ERROR, fsdp_env

    if fsdp_env() and role != "learner":  # torchrun's ranks are the learner's; the other roles run once
        logger.critical("started as one of several torch.distributed ranks (WORLD_SIZE is set): only the learner "
                        "runs on ranks; use --role learner under torchrun and start the API and verifiers on their "
                        "own (--role api, --role verifier)")
        return CONFIG_ERROR
    if role != "all":
        from coordinator.launch.processes import run_role

        return run_role(config, role, index, parent)
    if config.layout == "one-process" or config.sync_mode == "colocated":
        from coordinator.launch.processes import RoleLocked, role_lock

        try:
            with role_lock(config.run_dir, "learner"), role_lock(config.run_dir, "api"), \
                    role_lock(config.run_dir, "verifier-0"):
                return asyncio.run(serve(config))
        except RoleLocked as exc:
            logger.critical("%s", exc)
            return CONFIG_ERROR
    from coordinator.launch.processes import supervise

    return supervise(config)
