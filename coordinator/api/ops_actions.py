"""What an operator can change on a running coordinator: ban/unban, pause/resume issuing, export a
checkpoint, add/remove operator keys. Called by :mod:`coordinator.api.admin` after authentication; each
action is logged and appended to ``admin.log`` (JSON lines) in the run directory as an audit trail.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.api.admin_keys import AdminKey, load_admin_keys, write_admin_keys
from coordinator.api.guard import INVITES, REGISTRATION_MODE
from coordinator.api.replies import (
    BanReply,
    CheckpointReply,
    InviteReply,
    IssuingReply,
    KeyAdded,
    KeyRemoved,
    KeysReply,
    NoticeReply,
    RegistrationReply,
)
from coordinator.api.runstate import RunView
from coordinator.core.leases import lease_live
from coordinator.core.ops import ADMIN_KEYS, ClientLookupError, resolve_client
from coordinator.publish.checkpoints import CheckpointStore
from coordinator.run import notices
from coordinator.store import readmodels
from shared import crypto
from shared.errors import ProtocolError, Reason

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Operations:
    """What the operator's actions act on: the run's reads (``view``: its store, snapshots, trust guard and the
    API's state), the run directory (admin.log, admin_keys, exports), the wake-up of waiting lease requests
    (coordinator.api.leasing.Leasing.notify_jobs) and the API's I/O thread for file copies."""

    view: RunView
    run_dir: Path
    notify_jobs: Callable[[], None]
    run_io: Callable[..., Awaitable[Any]]


def record(ops: Operations, operator: str, action: str, **details: Any) -> None:
    entry = {"at": ops.view.clock(), "operator": operator, "action": action} | details
    logger.warning("operator %s: %s %s", operator[:8], action, json.dumps(details))
    with open(ops.run_dir / "admin.log", "a") as f:
        f.write(json.dumps(entry) + "\n")


def find_client(ops: Operations, ref: str) -> str:
    try:
        return resolve_client(ref, readmodels.client_ids(ops.view.store))
    except ClientLookupError as exc:
        raise ProtocolError(Reason.NOT_FOUND, str(exc)) from None


def set_banned(ops: Operations, operator: str, ref: str, banned: bool, note: str) -> BanReply:
    """Ban: every later request of the client is refused (403 ``banned``) and its live leases are released
    at once so that other clients pick the work up. Unban restores it. Credit and history are kept."""
    client_id = find_client(ops, ref)
    ops.view.store.clients.set_banned(client_id, banned)
    notices.set_ban_note(ops.view.store, client_id, note if banned else "")
    released: list[str] = []
    if banned:
        now = ops.view.clock()
        for j in ops.view.store.jobs.active():
            if j.view.lease_client == client_id and lease_live(j.view, now) and j.view.lease_id is not None \
                    and ops.view.store.jobs.release(j.view.job_id, j.view.lease_id, client_id):
                released.append(j.view.job_id)
        if released:
            ops.notify_jobs()
    record(ops, operator, "ban" if banned else "unban", client_id=client_id, note=note, released_jobs=released)
    return {"client_id": client_id, "banned": banned, "released_jobs": released}


def set_issuing(ops: Operations, operator: str, paused: bool) -> IssuingReply:
    """Pause: lease requests get 'no job, retry later' (live leases may still be returned and are credited);
    the setting survives a restart. Resume wakes every waiting lease request."""
    changed = ops.view.state.issuing_paused != paused
    ops.view.state.issuing_paused = paused
    ops.view.store.set_meta("issuing_paused", "1" if paused else "0")
    if not paused:
        ops.notify_jobs()
    if changed:
        record(ops, operator, "pause" if paused else "resume")
    return {"paused": paused, "changed": changed}


def issue_invite(ops: Operations, operator: str, note: str) -> InviteReply:
    """A new invite token: its sha256 joins the run's valid invites (the store's ``meta.invite_sha256``, beside
    the config's ``registration.invite_sha256``); the token itself is returned once and kept nowhere."""
    token = secrets.token_urlsafe(24)
    digest = hashlib.sha256(token.encode()).hexdigest()
    issued = json.loads(ops.view.store.get_meta(INVITES) or "[]")
    ops.view.store.set_meta(INVITES, json.dumps([*issued, digest]))
    record(ops, operator, "invite", sha256=digest, note=note)
    return {"token": token, "sha256": digest, "mode": ops.view.guard.registration_mode()}


def set_registration(ops: Operations, operator: str, mode: str) -> RegistrationReply:
    """The run's registration setting: 'invite' (registering needs a valid invite token) or 'open'. Kept in the
    store: it survives a restart and holds for every API process, over the config's ``registration.mode``."""
    changed = ops.view.guard.registration_mode() != mode
    if mode == "invite" and not ops.view.guard.invite_hashes():
        raise ProtocolError(Reason.ADMIN_REFUSED, "no invite token exists yet, so nobody new could join: issue one "
                                                  "first with `echo-swarm admin invite`")
    ops.view.store.set_meta(REGISTRATION_MODE, mode)
    if changed:
        record(ops, operator, "registration", mode=mode)
    return {"mode": mode, "changed": changed, "invites": len(ops.view.guard.invite_hashes())}


def post_notice(ops: Operations, operator: str, text: str, kind: str, min_client_version: str | None,
                withdraw: int | None) -> NoticeReply:
    """Publish a notice to every volunteer, or withdraw one (coordinator.run.notices); a notice that does not fit
    the wire (an empty text, an 'update' without a version) is refused with nothing written."""
    store = ops.view.store
    if withdraw is not None:
        if not notices.withdraw(store, withdraw):
            raise ProtocolError(Reason.NOT_FOUND, f"no notice {withdraw} is in force: `echo-swarm admin notices` "
                                                  f"lists them")
        record(ops, operator, "notice withdrawn", notice_id=withdraw)
        return {"notice_id": withdraw, "published": False, "notices": len(notices.current(store))}
    try:
        notice = notices.publish(store, ops.view.clock(), text, kind, min_client_version)
    except ValidationError as exc:
        problem = exc.errors()[0]
        raise ProtocolError(Reason.SCHEMA, f"the notice does not fit: {problem['msg']}") from None
    record(ops, operator, "notice", notice_id=notice.notice_id, kind=kind, text=text,
           min_client_version=min_client_version)
    return {"notice_id": notice.notice_id, "published": True, "notices": len(notices.current(store))}


async def export_checkpoint(ops: Operations, operator: str) -> CheckpointReply:
    """Write a self-contained copy of the current version to ``exports/v<version>-<UTC time>/``: the model
    folder as published (a Hugging Face folder: usable as another run's ``model.path``; for a LoRA run the
    adapter, with the run's shared base beside it in ``base/``), the newest learner checkpoint at or below the
    version (weights and optimizer state: what a restart resumes from), and an online backup of the database.
    The API copies the files on its I/O thread; the learner (another process) only prunes versions older than
    ``snapshots.keep_last``, so the current one stays while it is read — if it vanished all the same, the
    export fails with a message and leaves nothing behind. The folder appears under its final name only when
    complete."""
    version = ops.view.state.version
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(ops.view.clock()))
    root = ops.run_dir / "exports"
    dest = root / f"v{version:06d}-{stamp}"
    k = 1
    while dest.exists():
        k += 1
        dest = root / f"v{version:06d}-{stamp}-{k}"
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    database = ops.view.store.backup_to(tmp / "coordinator.sqlite")
    checkpoints = CheckpointStore(ops.run_dir / "checkpoints")
    newest = checkpoints.latest(version)
    base = ops.view.snapshots.base_dir if ops.view.config.learner.lora_rank > 0 else None
    try:
        await ops.run_io(_copy_files, ops.view.snapshots.folder(version), base,
                           None if newest is None else checkpoints.folder(newest), tmp)
    except FileNotFoundError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ProtocolError(Reason.NOT_FOUND, f"version {version} or its checkpoint was pruned while it was "
                                              f"copied ({exc.filename}); run the export again") from None
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {"version": version, "run_id": ops.view.files.run_id, "created_at": ops.view.clock(), "files": files,
                "checkpoint_version": newest, "database": database}
    (tmp / "checkpoint.json").write_text(json.dumps(manifest, indent=2))
    tmp.rename(dest)
    total = sum(files.values())
    record(ops, operator, "checkpoint", version=version, path=str(dest), bytes=total)
    return {"version": version, "path": str(dest), "bytes": total, "files": len(files) + 1}


def _copy_files(model_dir: Path, base: Path | None, checkpoint: Path | None, dest: Path) -> None:
    shutil.copytree(model_dir, dest / "model")
    if base is not None and base.exists():
        shutil.copytree(base, dest / "base", ignore=shutil.ignore_patterns(".*"))
    if checkpoint is not None:
        shutil.copytree(checkpoint, dest / "checkpoint")


def list_keys(ops: Operations, caller: str) -> KeysReply:
    return {
        "admin_keys": [k.as_dict() | {"you": k.key_id == caller} for k in load_admin_keys(ops.run_dir)],
        "coordinator_public_key": ops.view.files.public_key.hex(),
        "coordinator_key_id": crypto.client_id_for(ops.view.files.public_key),
        "keys_file": str(ops.run_dir / "admin_keys"),
    }


def add_key(ops: Operations, operator: str, public_key: bytes, comment: str) -> KeyAdded:
    keys = load_admin_keys(ops.run_dir)
    key = AdminKey(crypto.client_id_for(public_key), public_key, comment)
    added = all(k.key_id != key.key_id for k in keys)
    if added:
        write_admin_keys(ops.run_dir, [*keys, key])
        record(ops, operator, "key_add", key_id=key.key_id, comment=comment)
    return {"key_id": key.key_id, "added": added}


def remove_key(ops: Operations, operator: str, ref: str) -> KeyRemoved:
    keys = load_admin_keys(ops.run_dir)
    try:
        key_id = resolve_client(ref, [k.key_id for k in keys], ADMIN_KEYS)
    except ClientLookupError as exc:
        raise ProtocolError(Reason.NOT_FOUND, str(exc)) from None
    rest = [k for k in keys if k.key_id != key_id]
    if not rest:
        raise ProtocolError(Reason.ADMIN_REFUSED, "that is the only operator key; removing it would lock every "
                                                  "operator out. Add another key first (`echo-swarm admin keys add`)")
    write_admin_keys(ops.run_dir, rest)
    record(ops, operator, "key_remove", key_id=key_id)
    return {"key_id": key_id, "removed": True, "remaining": len(rest)}
