"""The operator admin API: ``POST /v1/admin/<name>``, JSON replies, for `echo-swarm admin`.

Authentication reuses the volunteers' signed envelope (shared.crypto.sign_request): an admin request is
signed by an operator key listed in ``<run_dir>/admin_keys`` (see :mod:`coordinator.api.admin_keys`), carries a
timestamp within the accepted skew and a fresh nonce, and names the endpoint it was signed for. Anything
else is refused before any parameter is read: 401 ``not_admin`` (no envelope, or a key that is not an
operator's), 401 ``bad_signature`` / ``stale_request``, 409 ``replayed_nonce``. Errors go through the app's
one error middleware like every other endpoint.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from coordinator.api import ops_actions
from coordinator.api.admin_keys import ADMIN_KEYS_FILE, AdminKey, ensure_admin_key, load_admin_keys
from coordinator.api.replies import (
    AdminAuditReply,
    AdminClients,
    AdminJobs,
    AdminStatus,
    AdminVersions,
    BanReply,
    CheckpointReply,
    InviteReply,
    IssuingReply,
    KeyAdded,
    KeyRemoved,
    KeysReply,
    RegistrationReply,
)
from coordinator.api.service import Coordinator
from coordinator.store import readmodels
from shared import crypto, wire
from shared.admin import (
    AdminAudit,
    AdminBan,
    AdminEmpty,
    AdminInvite,
    AdminIssuing,
    AdminKeyAdd,
    AdminKeyRemove,
    AdminList,
    AdminRegistration,
)
from shared.errors import ProtocolError, Reason
from shared.messages import SignedRequest

logger = logging.getLogger(__name__)

ADMIN_COORDINATOR = web.AppKey("admin_coordinator", Coordinator)
MAX_ADMIN_BODY = 64 * 1024


def authenticate_admin(coord: Coordinator, raw: bytes, path: str) -> tuple[SignedRequest, AdminKey]:
    """Envelope → listed operator key → signature → timestamp → nonce. Nothing is written before the
    signature verifies (the nonce is remembered only for a valid operator request)."""
    if not raw:
        raise ProtocolError(Reason.NOT_ADMIN, "admin requests must be signed by an operator key; use "
                                              "`echo-swarm admin --run-dir <run dir> ...` (see --help)")
    req = coord.open_envelope(raw, path)
    key = next((k for k in load_admin_keys(coord.run_dir) if k.key_id == req.client_id), None)
    if key is None:
        raise ProtocolError(Reason.NOT_ADMIN, f"key {req.client_id[:12]}… is not an operator key of this "
                                              f"coordinator: it is not listed in {coord.run_dir / ADMIN_KEYS_FILE}. "
                                              f"An operator can add it with `echo-swarm admin keys add`")
    crypto.verify_request(req, key.public_key)
    coord.check_fresh(req)
    return req, key


def status(coord: Coordinator, caller: str, body: AdminEmpty) -> AdminStatus:
    now = coord.clock()
    rows = readmodels.client_states(coord.store, now, coord.config.jobs.lease_timeout_s)
    jobs = readmodels.jobs(coord.store, now, limit=0)
    evals = coord.store.evals.all()
    last = coord.store.steps.last()
    return {
        "run_id": coord.run_id, "version": coord.version, "max_steps": coord.config.learner.max_steps,
        "finished": coord.finished, "sync_mode": coord.config.sync_mode,
        "max_staleness": coord.config.sync_policy.bound, "task": coord.task.name, "uptime_s": now - coord.started_at,
        "issuing_paused": coord.issuing_paused, "registration": coord.guard.registration_mode(),
        "run_dir": str(coord.run_dir),
        "learner": coord.learner_status(),
        "jobs": readmodels.jobs_summary(jobs),
        "clients": readmodels.client_summary(rows),
        "totals": coord.store.totals() | {"tokens": readmodels.result_totals(coord.store)["tokens"]},
        "rejections_by_reason": readmodels.rejection_counts(coord.store),
        "heldout_accuracy": evals[-1].accuracy if evals else None,
        "last_step": {"step": last.step, "mean_reward": last.mean_reward, "at": last.at} if last is not None else None,
    }


def clients(coord: Coordinator, caller: str, body: AdminList) -> AdminClients:
    rows = readmodels.clients(coord.store, coord.clock(), coord.config.jobs.lease_timeout_s, body.limit,
                              reporting=True)
    return {"clients": rows}


def ban(coord: Coordinator, caller: str, body: AdminBan) -> BanReply:
    return ops_actions.set_banned(coord, caller, body.client, body.banned, body.note)


def versions(coord: Coordinator, caller: str, body: AdminList) -> AdminVersions:
    return {"current": coord.version,
            "versions": readmodels.versions(coord.store, coord.snapshots.signed_manifest, body.limit)}


def jobs(coord: Coordinator, caller: str, body: AdminList) -> AdminJobs:
    return {**readmodels.jobs(coord.store, coord.clock(), body.limit), "lease_timeout_s": coord.config.jobs.lease_timeout_s}


def audit(coord: Coordinator, caller: str, body: AdminAudit) -> AdminAuditReply:
    client_id = ops_actions.find_client(coord, body.client) if body.client else None
    return {"entries": readmodels.audit(coord.store, limit=body.limit, client_id=client_id, job_id=body.job_id,
                                        outcome=body.outcome)}


async def checkpoint(coord: Coordinator, caller: str, body: AdminEmpty) -> CheckpointReply:
    return await ops_actions.export_checkpoint(coord, caller)


def issuing(coord: Coordinator, caller: str, body: AdminIssuing) -> IssuingReply:
    return ops_actions.set_issuing(coord, caller, body.paused)


def invite(coord: Coordinator, caller: str, body: AdminInvite) -> InviteReply:
    return ops_actions.issue_invite(coord, caller, body.note)


def registration(coord: Coordinator, caller: str, body: AdminRegistration) -> RegistrationReply:
    return ops_actions.set_registration(coord, caller, body.mode)


def keys(coord: Coordinator, caller: str, body: AdminEmpty) -> KeysReply:
    return ops_actions.list_keys(coord, caller)


def keys_add(coord: Coordinator, caller: str, body: AdminKeyAdd) -> KeyAdded:
    return ops_actions.add_key(coord, caller, body.public_key, body.comment)


def keys_remove(coord: Coordinator, caller: str, body: AdminKeyRemove) -> KeyRemoved:
    return ops_actions.remove_key(coord, caller, body.key_id)


# an action's reply is one of coordinator.api.replies' shapes; the handler only encodes it
Action = Callable[[Coordinator, str, Any], "Mapping[str, object] | Awaitable[Mapping[str, object]]"]
ENDPOINTS: dict[str, tuple[type[BaseModel], Action]] = {
    "status": (AdminEmpty, status),
    "clients": (AdminList, clients),
    "ban": (AdminBan, ban),
    "versions": (AdminList, versions),
    "jobs": (AdminList, jobs),
    "audit": (AdminAudit, audit),
    "checkpoint": (AdminEmpty, checkpoint),
    "issuing": (AdminIssuing, issuing),
    "invite": (AdminInvite, invite),
    "registration": (AdminRegistration, registration),
    "keys": (AdminEmpty, keys),
    "keys/add": (AdminKeyAdd, keys_add),
    "keys/remove": (AdminKeyRemove, keys_remove),
}


def _handler(path: str, model: type[BaseModel], action: Action) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
            raise ProtocolError(Reason.BODY_TOO_LARGE, f"admin requests are at most {MAX_ADMIN_BODY} bytes")
        coord = request.app[ADMIN_COORDINATOR]
        req, key = authenticate_admin(coord, await request.read(), path)
        body = wire.decode(req.body, model)
        result = action(coord, key.key_id, body)
        if inspect.isawaitable(result):
            result = await result
        return web.json_response(result, dumps=lambda o: json.dumps(o, default=str))

    return handle


async def _ensure_key(app: web.Application) -> None:
    coord = app[ADMIN_COORDINATOR]
    coord.run_dir.mkdir(parents=True, exist_ok=True)
    ensure_admin_key(coord.run_dir)


def install(app: web.Application, coord: Coordinator) -> None:
    """Register ``POST /v1/admin/*`` and create the first operator key on startup if the run has none."""
    app[ADMIN_COORDINATOR] = coord
    app.on_startup.append(_ensure_key)
    for name, (model, action) in ENDPOINTS.items():
        path = f"/v1/admin/{name}"
        app.router.add_post(path, _handler(path, model, action))
