"""The contributor status page at ``/`` and the JSON it polls, ``GET /v1/status``.

The page is static HTML/JS/CSS shipped inside the package (``coordinator/web``) and draws its charts as SVG
itself, so it works with no internet access. It polls ``/v1/status`` every few seconds and redraws in place.

``/v1/status`` keeps every key it always had (``Coordinator.status``) and adds the views the page needs:
``issuing_paused``, ``throughput`` (tokens/s and results/min over the run, in equal time buckets),
``clients_summary`` (clients by state, active ones by backend and platform), ``leaderboard`` (top credit),
``recent_versions`` and ``server_time``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from coordinator import readmodels
from coordinator.service import Coordinator

WEB_DIR = Path(__file__).with_name("web")
STATUS_COORDINATOR = web.AppKey("status_coordinator", Coordinator)
THROUGHPUT_BINS = 48


def public_status(coord: Coordinator) -> dict[str, Any]:
    now = coord.clock()
    base = coord.status()
    rows = readmodels.clients(coord.store, now, coord.config.jobs.lease_timeout_s)
    return base | {
        "server_time": now,
        "issuing_paused": coord.issuing_paused,
        "throughput": readmodels.throughput(coord.store, coord.started_at, now, THROUGHPUT_BINS),
        "clients_summary": readmodels.client_summary(rows),
        "leaderboard": readmodels.leaderboard(rows),
        "recent_versions": readmodels.versions(coord.store, coord.snapshots.signed_manifest, limit=10),
    }


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install(app: web.Application, coord: Coordinator) -> None:
    """Serve ``/`` and ``/static/*`` (the page's own JS and CSS)."""
    app[STATUS_COORDINATOR] = coord
    app.router.add_get("/", index)
    app.router.add_static("/static/", WEB_DIR, append_version=False)
