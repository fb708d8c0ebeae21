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
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from coordinator.api import ops_actions
from coordinator.api.admin_keys import ADMIN_KEYS_FILE, AdminKey, ensure_admin_key, load_admin_keys
from coordinator.api.ops_actions import Operations
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
    NoticeReply,
    NoticesReply,
    RegistrationReply,
)
from coordinator.api.signin import SignIn
from coordinator.run import notices
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
    AdminNotice,
    AdminRegistration,
)
from shared.errors import ProtocolError, Reason
from shared.messages import SignedRequest

logger = logging.getLogger(__name__)

#: What the admin endpoints act on, and how their envelopes are opened: set once the API role started
#: (coordinator.api.app.api_role).
ADMIN_OPERATIONS = web.AppKey("admin_operations", Operations)
ADMIN_SIGNIN = web.AppKey("admin_signin", SignIn)
MAX_ADMIN_BODY = 64 * 1024


def authenticate_admin(signin: SignIn, run_dir: Path, raw: bytes, path: str) -> tuple[SignedRequest, AdminKey]:
    """Envelope → listed operator key → signature → timestamp → nonce. Nothing is written before the
    signature verifies (the nonce is remembered only for a valid operator request)."""
    if not raw:
        raise ProtocolError(Reason.NOT_ADMIN, "admin requests must be signed by an operator key; use "
                                              "`echo-swarm admin --run-dir <run dir> ...` (see --help)")
    req = signin.open_envelope(raw, path)
    key = next((k for k in load_admin_keys(run_dir) if k.key_id == req.client_id), None)
    if key is None:
        raise ProtocolError(Reason.NOT_ADMIN, f"key {req.client_id[:12]}… is not an operator key of this "
                                              f"coordinator: it is not listed in {run_dir / ADMIN_KEYS_FILE}. "
                                              f"An operator can add it with `echo-swarm admin keys add`")
    crypto.verify_request(req, key.public_key)
    signin.check_fresh(req)
    return req, key


def status(ops: Operations, caller: str, body: AdminEmpty) -> AdminStatus:
    now = ops.view.clock()
    rows = readmodels.client_states(ops.view.store, now, ops.view.config.jobs.lease_timeout_s)
    jobs = readmodels.jobs(ops.view.store, now, limit=0)
    evals = ops.view.store.evals.all()
    last = ops.view.store.steps.last()
    state = ops.view.state
    return {
        "run_id": ops.view.files.run_id, "version": state.version, "max_steps": ops.view.config.learner.max_steps,
        "finished": state.finished, "sync_mode": ops.view.config.sync_mode,
        "max_staleness": ops.view.config.sync_policy.bound, "task": ops.view.files.task.name,
        "uptime_s": now - state.started_at, "issuing_paused": state.issuing_paused,
        "registration": ops.view.guard.registration_mode(), "run_dir": str(ops.run_dir),
        "learner": ops.view.learner_status(),
        "jobs": readmodels.jobs_summary(jobs),
        "clients": readmodels.client_summary(rows),
        "totals": ops.view.store.totals() | {"tokens": readmodels.result_totals(ops.view.store)["tokens"]},
        "rejections_by_reason": readmodels.rejection_counts(ops.view.store),
        "heldout_accuracy": evals[-1].accuracy if evals else None,
        "last_step": {"step": last.step, "mean_reward": last.mean_reward, "at": last.at} if last is not None else None,
    }


def clients(ops: Operations, caller: str, body: AdminList) -> AdminClients:
    rows = readmodels.clients(ops.view.store, ops.view.clock(), ops.view.config.jobs.lease_timeout_s, body.limit,
                              reporting=True)
    return {"clients": rows}


def ban(ops: Operations, caller: str, body: AdminBan) -> BanReply:
    return ops_actions.set_banned(ops, caller, body.client, body.banned, body.note)


def versions(ops: Operations, caller: str, body: AdminList) -> AdminVersions:
    return {"current": ops.view.state.version,
            "versions": readmodels.versions(ops.view.store, ops.view.snapshots.signed_manifest, body.limit)}


def jobs(ops: Operations, caller: str, body: AdminList) -> AdminJobs:
    return {**readmodels.jobs(ops.view.store, ops.view.clock(), body.limit),
            "lease_timeout_s": ops.view.config.jobs.lease_timeout_s}


def audit(ops: Operations, caller: str, body: AdminAudit) -> AdminAuditReply:
    client_id = ops_actions.find_client(ops, body.client) if body.client else None
    return {"entries": readmodels.audit(ops.view.store, limit=body.limit, client_id=client_id, job_id=body.job_id,
                                        outcome=body.outcome)}


async def checkpoint(ops: Operations, caller: str, body: AdminEmpty) -> CheckpointReply:
    return await ops_actions.export_checkpoint(ops, caller)


def issuing(ops: Operations, caller: str, body: AdminIssuing) -> IssuingReply:
    return ops_actions.set_issuing(ops, caller, body.paused)


def invite(ops: Operations, caller: str, body: AdminInvite) -> InviteReply:
    return ops_actions.issue_invite(ops, caller, body.note)


def registration(ops: Operations, caller: str, body: AdminRegistration) -> RegistrationReply:
    return ops_actions.set_registration(ops, caller, body.mode)


def notice(ops: Operations, caller: str, body: AdminNotice) -> NoticeReply:
    return ops_actions.post_notice(ops, caller, body.text, body.kind, body.min_client_version, body.withdraw)


def notices_list(ops: Operations, caller: str, body: AdminEmpty) -> NoticesReply:
    return {"notices": [n.model_dump() for n in notices.current(ops.view.store)]}


def keys(ops: Operations, caller: str, body: AdminEmpty) -> KeysReply:
    return ops_actions.list_keys(ops, caller)


def keys_add(ops: Operations, caller: str, body: AdminKeyAdd) -> KeyAdded:
    return ops_actions.add_key(ops, caller, body.public_key, body.comment)


def keys_remove(ops: Operations, caller: str, body: AdminKeyRemove) -> KeyRemoved:
    return ops_actions.remove_key(ops, caller, body.key_id)


# an action's reply is one of coordinator.api.replies' shapes; the handler only encodes it
Action = Callable[[Operations, str, Any], "Mapping[str, object] | Awaitable[Mapping[str, object]]"]
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
    "notice": (AdminNotice, notice),
    "notices": (AdminEmpty, notices_list),
    "keys": (AdminEmpty, keys),
    "keys/add": (AdminKeyAdd, keys_add),
    "keys/remove": (AdminKeyRemove, keys_remove),
}


def _handler(path: str, model: type[BaseModel], action: Action) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
            raise ProtocolError(Reason.BODY_TOO_LARGE, f"admin requests are at most {MAX_ADMIN_BODY} bytes")
        ops = request.app[ADMIN_OPERATIONS]
        req, key = authenticate_admin(request.app[ADMIN_SIGNIN], ops.run_dir, await request.read(), path)
        body = wire.decode(req.body, model)
        result = action(ops, key.key_id, body)
        if inspect.isawaitable(result):
            result = await result
        return web.json_response(result, dumps=lambda o: json.dumps(o, default=str))

    return handle


def install(app: web.Application, run_dir: Path) -> None:
    """Register ``POST /v1/admin/*`` and create the first operator key on startup if the run has none. What the
    endpoints act on is handed over once the API role started (:func:`serve`)."""

    async def ensure_key(app: web.Application) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        ensure_admin_key(run_dir)

    app.on_startup.append(ensure_key)
    for name, (model, action) in ENDPOINTS.items():
        path = f"/v1/admin/{name}"
        app.router.add_post(path, _handler(path, model, action))


def serve(app: web.Application, ops: Operations, signin: SignIn) -> None:
    """Hand the admin endpoints what they act on (during the app's startup, before it serves)."""
    app[ADMIN_OPERATIONS] = ops
    app[ADMIN_SIGNIN] = signin
