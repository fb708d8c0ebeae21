"""The contributor status page at ``/`` and the JSON it polls, ``GET /v1/status``.

The page is static HTML/JS/CSS shipped inside the package (``coordinator/web``) and draws its charts as SVG
itself, so it works with no internet access. It polls ``/v1/status?view=page`` every 2 s and redraws in place.

``/v1/status`` keeps every key it always had (``Coordinator.status``) and adds the views the page needs:
``issuing_paused``, ``throughput`` (tokens/s and results/min over the run, in equal time buckets),
``clients_summary`` (clients by state, active ones by backend and platform), ``leaderboard`` (top credit),
``recent_versions`` and ``server_time``. ``?view=page`` is the same minus the heavy full lists (``clients``,
``steps``, ``jobs.in_flight``) plus ``reward_means`` (each reward's mean per step, when the task combines
several rewards: drawn live beside the total). Either view is built at most once per second however many pages are open
(coordinator.api.public_reads caches the encoded reply) — the event loop that serves volunteers also serves the
page, so many viewers must not cost more than one.

The page's HTML loads one script and one stylesheet of its own and has no inline script or style, so it works
under the strict Content-Security-Policy that coordinator.api.app sends with every response.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from coordinator.api.service import Coordinator
from coordinator.store import readmodels

WEB_DIR = Path(__file__).with_name("web")
STATUS_COORDINATOR = web.AppKey("status_coordinator", Coordinator)
THROUGHPUT_BINS = 48


def page_views(coord: Coordinator) -> dict[str, Any]:
    now = coord.clock()
    timeout = coord.config.jobs.lease_timeout_s
    return {
        "server_time": now,
        "issuing_paused": coord.issuing_paused,
        "throughput": readmodels.throughput(coord.store, coord.started_at, now, THROUGHPUT_BINS),
        "clients_summary": readmodels.client_summary(readmodels.client_states(coord.store, now, timeout)),
        "leaderboard": readmodels.top_clients(coord.store, now, timeout),
        "recent_versions": readmodels.versions(coord.store, coord.snapshots.signed_manifest, limit=10),
        "snapshot_egress": coord.egress.view(),  # coordinator egress vs bytes peers served (p2p, issue 14)
    }


def public_status(coord: Coordinator) -> dict[str, Any]:
    """The full status: every key of ``Coordinator.status`` plus the page's views."""
    return coord.status() | page_views(coord)


def page_status(coord: Coordinator) -> dict[str, Any]:
    """What the page draws."""
    now = coord.clock()
    jobs = readmodels.jobs(coord.store, now, limit=0)
    evals = coord.store.evals()
    curve = coord.store.reward_curve()
    body = {
        "run_id": coord.run_id, "version": coord.version, "max_steps": coord.config.learner.max_steps,
        "finished": coord.finished, "sync_mode": coord.config.sync_mode,
        "max_staleness": coord.config.sync_policy.bound, "task": coord.task.name, "uptime_s": now - coord.started_at,
        "jobs": {"open": jobs["counts"]["open"] + jobs["counts"]["expired"], "leased": jobs["counts"]["leased"],
                 "buffered": jobs["buffered_results"]},
        "totals": coord.store.totals(), "reward_curve": curve, "reward_means": readmodels.reward_means(coord.store),
        "evals": [{"version": e["version"], "accuracy": e["accuracy"], "n": e["n"]} for e in evals],
    } | page_views(coord)
    return body


def select_status(coord: Coordinator, view: str | None) -> dict[str, Any]:
    return page_status(coord) if view == "page" else public_status(coord)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install(app: web.Application, coord: Coordinator) -> None:
    """Serve ``/`` and ``/static/*`` (the page's own JS and CSS)."""
    app[STATUS_COORDINATOR] = coord
    app.router.add_get("/", index)
    app.router.add_static("/static/", WEB_DIR, append_version=False)
