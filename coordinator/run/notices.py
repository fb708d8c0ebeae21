"""The run's notices: what the operator tells every volunteer (`echo-swarm admin notice`), kept in the store and
served signed at ``GET /v1/notices`` (docs/protocol.md §4).

A volunteer's client is otherwise told nothing but jobs: an operator could not say "the next run starts Monday" or
"please update". Notices are few and small (at most MAX_NOTICES, the newest; each one line), so they live in one
``meta`` row as JSON — every API process reads the same board, a restart keeps it, and no table is needed. Each is
validated as the wire's :class:`shared.messages.Notice` before anything is written, so what is stored is exactly
what clients will accept. The board is signed with the run's key, like a job or a manifest, and names its run: a
client checks it against the key it pinned and the run it joined.
"""

from __future__ import annotations

import json

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.store.store import Store
from shared.messages import MAX_NOTICES, Notice, NoticeBoard, SignedNotices
from shared.records import sign_notices
from shared.safe_text import escape

NOTICES_KEY = "notices"  # the meta row: {"next_id": int, "notices": [Notice as JSON, oldest first]}
BAN_NOTE_KEY = "ban_note/{client_id}"  # the meta row of a banned client's note ("" once unbanned)


def _read(store: Store) -> tuple[int, list[Notice]]:
    raw = store.get_meta(NOTICES_KEY)
    if raw is None:
        return 1, []
    data = json.loads(raw)
    return int(data["next_id"]), [Notice.model_validate(n) for n in data["notices"]]


def _write(store: Store, next_id: int, notices: list[Notice]) -> None:
    store.set_meta(NOTICES_KEY, json.dumps({"next_id": next_id, "notices": [n.model_dump() for n in notices]}))


def current(store: Store) -> list[Notice]:
    """The notices in force, oldest first."""
    return _read(store)[1]


def make(notice_id: int, at: float, text: str, kind: str, min_client_version: str | None) -> Notice:
    """The notice, validated as the wire will carry it (pydantic's ValidationError says what does not fit)."""
    return Notice.model_validate({"notice_id": notice_id, "at": at, "kind": kind, "text": text,
                                  "min_client_version": min_client_version})


def publish(store: Store, now: float, text: str, kind: str, min_client_version: str | None = None) -> Notice:
    """Add a notice (the oldest drops off beyond MAX_NOTICES); invalid input raises before anything is written."""
    next_id, notices = _read(store)
    notice = make(next_id, now, text, kind, min_client_version)
    _write(store, next_id + 1, [*notices, notice][-MAX_NOTICES:])
    return notice


def withdraw(store: Store, notice_id: int) -> bool:
    """Remove one notice; False (nothing written) when no notice has that id."""
    next_id, notices = _read(store)
    kept = [n for n in notices if n.notice_id != notice_id]
    if len(kept) == len(notices):
        return False
    _write(store, next_id, kept)
    return True


FINISHED_KEY = "notices/run_finished"  # the meta row: the version the run-finished notice was published for


def announce_finished(store: Store, now: float, version: int) -> Notice | None:
    """The run reached its last step: tell every volunteer, once (a ``run`` notice; a learner that restarts after
    it publishes none again). None when it was already told."""
    if store.get_meta(FINISHED_KEY) is not None:
        return None
    notice = publish(store, now, f"this run has finished: it trained {version} policy versions. Thank you! Your "
                                 f"client waits for the operator's next run at this address and joins it by "
                                 f"itself (or stop it with `echo-swarm client finish`).", "run")
    store.set_meta(FINISHED_KEY, str(version))
    return notice


def set_ban_note(store: Store, client_id: str, note: str) -> None:
    """The operator's note of a ban, told to the banned client with every refusal (cleared by an unban)."""
    store.set_meta(BAN_NOTE_KEY.format(client_id=client_id), note)


def ban_message(store: Store, client_id: str) -> str:
    """The ``banned`` refusal's message: with the operator's note, escaped to one printable line (it reaches the
    volunteer's terminal)."""
    note = store.get_meta(BAN_NOTE_KEY.format(client_id=client_id))
    return "this client has been banned by the coordinator's operator" + (
        f"; the operator's note: {escape(note)}" if note else "")


def signed_board(store: Store, key: Ed25519PrivateKey, run_id: str, now: float) -> SignedNotices:
    return sign_notices(key, NoticeBoard(run_id=run_id, issued_at=now, notices=current(store)))
