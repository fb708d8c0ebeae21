"""`join URL --attach URL2=SHARE …`: one client process working for several coordinators (BOINC's attach).

Each run is a :class:`swarm_client.runner.Runner` of its own — its own identity, pinned key, registration, leases
and backend — on one event loop, and they meet in these places only:

- **the machine** (swarm_client/shares.py): generation takes turns by resource share, and only the run on the
  machine holds its model in memory;
- **the snapshot cache folder** (swarm_client/snapshots.py): a file two runs share is stored and fetched once;
- **the volunteer's controls and budgets**: pause, snooze and finish are read from the client's home for every run,
  the monthly data budget and the download cap are one meter and one throttle, and the lifetime ledger is one file;
- **stopping**: one stop event; Ctrl-C stops every run (each releases its lease), a second quits at once.

URL's run keeps the client's home as it is (a client that adds `--attach` later keeps its identity there); an
attached run's identity, pinned key and status live in ``HOME/attached/<host>_<port>/``. On a terminal URL's panel
lists every run (the others draw none: two live panels would erase each other's lines) and every line says which
coordinator it is about; without one, each run prints plain tagged lines. The control page is URL's, and lists
every run's share.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
from pathlib import Path
from urllib.parse import urlsplit

from shared import safe_text
from shared.exit_codes import ExitCode
from swarm_client import logs
from swarm_client.runner import Runner, run
from swarm_client.settings import JoinConfig, attached_run
from swarm_client.shares import Shares

logger = logging.getLogger(__name__)


def attached_home(home: Path, url: str) -> Path:
    """Where an attached run keeps its identity, pinned key and status: one folder per coordinator address."""
    parts = urlsplit(url)
    return home / "attached" / re.sub(r"[^A-Za-z0-9._-]", "_", f"{parts.hostname}_{parts.port or parts.scheme}")


def runners(cfg: JoinConfig) -> list[Runner]:
    """URL's runner first, then one per attached coordinator, sharing the machine and the volunteer's settings."""
    attached = [attached_run(entry) for entry in cfg.attach]
    shares = Shares({cfg.url: cfg.share, **dict(attached)}, keep_models=cfg.keep_models)
    main = Runner(cfg.model_copy(update={"attach": []}), shares=shares)
    out = [main]
    for url, _ in attached:
        sub = cfg.model_copy(update={"url": url, "home": attached_home(cfg.home, url), "attach": [], "panel": False,
                                     "control_page": False, "coordinator_key": None,
                                     "log_dir": cfg.log_dir or main.paths.logs})
        out.append(Runner(sub, shares=shares, household=main.household))  # URL's controls, budgets, ledger, stop
    main.attach(out[1:])
    return out


def join(cfg: JoinConfig) -> int:
    """`echo-swarm join`: one run (swarm_client.runner.run), or several with --attach."""
    if not cfg.attach:
        return run(cfg)
    safe_text.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")  # escaped, one line each
    return asyncio.run(run_all(cfg))


async def run_all(cfg: JoinConfig) -> int:
    """Every run until each has stopped; the first failing run's exit code, else 0."""
    group = runners(cfg)
    main = group[0]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main._on_signal)  # the stop event is shared: every run stops
    log_file = logs.setup(main.paths.logs, cfg.log_level, main.display.error)
    logger.info("echo-swarm join %s with %s (log %s)", cfg.url, ", ".join(cfg.attach), log_file)
    main.reporter.say(f"working for {len(group)} coordinators, generation by share: "
              + ", ".join(f"{r['url']} {r['share']:g}" for r in main.runs()))
    try:
        codes = await asyncio.gather(*(r.work() for r in group))
    finally:
        logs.teardown()
    return next((code for code in codes if code != ExitCode.OK), ExitCode.OK)
