"""Request bodies of the operator admin API (``POST /v1/admin/...``), as strict bounded schemas.

Each admin request travels in the same signed envelope as a volunteer's (:class:`shared.messages.SignedRequest`),
signed by an operator key listed in the run directory's ``admin_keys`` file; the body is one of these models,
msgpack-encoded. Replies are JSON (they are read by the CLI and by people, never by untrusted parties).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from shared.messages import MAX_NOTICE_CHARS, JobId, Message, PublicKey, ReleaseNumber

ClientRef = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{6,32}$")]
Limit = Annotated[int, Field(ge=1, le=10_000)]

class AdminEmpty(Message):
    """Endpoints without parameters take an empty map."""


class AdminList(Message):
    limit: Limit = 200


class AdminBan(Message):
    client: ClientRef  # a full client id or a unique prefix of ≥ 6 hex digits
    banned: bool
    note: Annotated[str, StringConstraints(max_length=256)] = ""


class AdminAudit(Message):
    limit: Limit = 100
    client: ClientRef | None = None
    job_id: JobId | None = None
    outcome: Annotated[str, StringConstraints(pattern=r"^[a-z_]{1,32}$")] | None = None  # accepted, rejected, …


class AdminIssuing(Message):
    paused: bool


class AdminInvite(Message):
    note: Annotated[str, StringConstraints(max_length=256, pattern=r"^[^\n\r]*$")] = ""  # whom it is for


class AdminRegistration(Message):
    mode: Literal["open", "invite"]  # the run's registration setting (overrides the config's registration.mode)


class AdminNotice(Message):
    """Publish a notice to every volunteer (``text``), or withdraw one (``withdraw``: its id; text ignored)."""

    text: Annotated[str, StringConstraints(max_length=MAX_NOTICE_CHARS)] = ""
    kind: Literal["operator", "run", "update"] = "operator"
    min_client_version: ReleaseNumber | None = None
    withdraw: Annotated[int, Field(ge=1, lt=2**53)] | None = None


class AdminKeyAdd(Message):
    public_key: PublicKey
    comment: Annotated[str, StringConstraints(max_length=128, pattern=r"^[^\n\r]*$")] = ""


class AdminKeyRemove(Message):
    key_id: ClientRef  # the key's id (client_id_for(public key)) or a unique prefix
