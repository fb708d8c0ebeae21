"""The contributor status page at ``/`` and the JSON it polls, ``GET /v1/status``.

The page is static HTML/JS/CSS shipped inside the package (``coordinator/web``) and draws its charts as SVG
itself, so it works with no internet access. It polls ``/v1/status?view=page`` every 2 s and redraws in place.

``/v1/status`` keeps every key it always had (``RunView.status``) and adds the views the page needs:
``issuing_paused``, ``throughput`` (tokens/s and results/min over the run, in equal time buckets),
``clients_summary`` (clients by state, active ones by backend and platform), ``leaderboard`` (top credit),
``recent_versions`` and ``server_time``. ``?view=page`` is the same minus the heavy full lists (``clients``,
``steps``, ``jobs.in_flight``) plus ``reward_means`` (each reward's mean per step, when the task combines
several rewards: drawn live beside the total). Either view is built at most once per second however many pages are open
(coordinator.api.public_reads caches the encoded reply) — the event loop that serves volunteers also serves the
page, so many viewers must not cost more than one.

The page's HTML loads one script and one stylesheet of its own and has no inline script or style, so it works
under the strict Content-Security-Policy that coordinator.api.app sends with every response.

``/volunteer`` is the per-volunteer page: a volunteer finds themselves by display name or client id
(``GET /v1/volunteers?q=``) and sees their standing, latest results and the versions they generated for
(``GET /v1/volunteers/{client_id}``). Both are public reads under the same per-address limit as /v1/status.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from aiohttp import web

from coordinator.api.egress import EGRESS_COUNTER
from coordinator.api.public_reads import PUBLIC_READS
from coordinator.api.replies import PageBody, PageStatus, PageViews, PublicStatus
from coordinator.api.runstate import RunView
from coordinator.store import readmodels
from shared.errors import ProtocolError, Reason

WEB_DIR = Path(__file__).with_name("web")
#: The run the pages read: set once the API role started (coordinator.api.app.api_role).
STATUS_VIEW = web.AppKey("status_view", RunView)
THROUGHPUT_BINS = 48
MAX_QUERY = 64  # characters of a volunteer search
CLIENT_ID = re.compile(r"[0-9a-f]{32}")


def page_views(view: RunView) -> PageViews:
    now = view.clock()
    timeout = view.config.jobs.lease_timeout_s
    return {
        "server_time": now,
        "issuing_paused": view.state.issuing_paused,
        "throughput": readmodels.throughput(view.store, view.state.started_at, now, THROUGHPUT_BINS),
        "clients_summary": readmodels.client_summary(readmodels.client_states(view.store, now, timeout)),
        "leaderboard": readmodels.top_clients(view.store, now, timeout),
        "teams": readmodels.teams(view.store),
        "recent_versions": readmodels.versions(view.store, view.snapshots.signed_manifest, limit=10),
        # coordinator egress vs bytes peers served (p2p, issue 14), counted across restarts (the store's counter)
        "snapshot_egress": view.egress.view(view.store.counter(EGRESS_COUNTER)),
    }


def public_status(view: RunView) -> PublicStatus:
    """The full status: every key of ``RunView.status`` plus the page's views."""
    return {**view.status(), **page_views(view)}


def page_status(view: RunView) -> PageStatus:
    """What the page draws."""
    now = view.clock()
    jobs = readmodels.jobs(view.store, now, limit=0)
    evals = view.store.evals.all()
    curve = view.store.steps.reward_curve()
    body: PageBody = {
        "run_id": view.files.run_id, "version": view.state.version, "max_steps": view.config.learner.max_steps,
        "finished": view.state.finished, "sync_mode": view.config.sync_mode,
        "max_staleness": view.config.sync_policy.bound, "task": view.files.task.name,
        "uptime_s": now - view.state.started_at,
        "jobs": {"open": jobs["counts"]["open"] + jobs["counts"]["expired"], "leased": jobs["counts"]["leased"],
                 "buffered": jobs["buffered_results"]},
        "totals": view.store.totals(), "reward_curve": curve, "reward_means": readmodels.reward_means(view.store),
        "evals": [{"version": e.version, "accuracy": e.accuracy, "n": e.n} for e in evals],
    }
    return {**body, **page_views(view)}


def select_status(run: RunView, view: str | None) -> PageStatus | PublicStatus:
    return page_status(run) if view == "page" else public_status(run)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def volunteer_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "volunteer.html", headers={"Cache-Control": "no-cache"})


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, default=str).encode(), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def find_volunteers(request: web.Request) -> web.Response:
    """``GET /v1/volunteers?q=TEXT``: volunteers by display name (contains, any case) or client id prefix."""
    request.app[PUBLIC_READS].check(request)
    query = request.query.get("q", "")[:MAX_QUERY]
    return _json({"query": query, "volunteers": readmodels.find_volunteers(request.app[STATUS_VIEW].store,
                                                                           query)})


async def volunteer(request: web.Request) -> web.Response:
    """``GET /v1/volunteers/{client_id}``: one volunteer's results, credit and versions (404 when unknown)."""
    request.app[PUBLIC_READS].check(request)
    client_id = request.match_info["client_id"]
    view = request.app[STATUS_VIEW]
    found = None
    if CLIENT_ID.fullmatch(client_id):
        found = readmodels.volunteer(view.store, client_id, view.clock(), view.config.jobs.lease_timeout_s)
    if found is None:
        raise ProtocolError(Reason.NOT_FOUND, f"no volunteer {client_id[:64]!r} in this run: find yourself by name "
                                              f"or id at /volunteer")
    return _json(found)


def install(app: web.Application) -> None:
    """Serve ``/``, ``/volunteer``, their JSON (``/v1/volunteers``) and ``/static/*`` (the pages' own JS and CSS);
    the run they read is handed over once the API role started (``app[STATUS_VIEW]``)."""
    app.router.add_get("/", index)
    app.router.add_get("/volunteer", volunteer_page)
    app.router.add_get("/v1/volunteers", find_volunteers)
    app.router.add_get("/v1/volunteers/{client_id}", volunteer)
    app.router.add_static("/static/", WEB_DIR, append_version=False)
