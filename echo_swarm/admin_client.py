"""The operator's side of the admin API: sign each request with an operator key, POST it, decode the JSON
reply or turn the coordinator's typed refusal into :class:`AdminError`. `echo-swarm admin` is a thin view
over this class; tests drive it directly as well.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

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
from shared.errors import EchoSwarmError, ProtocolError
from shared.messages import MAX_NOTICE_CHARS, ErrorBody, Message, Notice

DEFAULT_KEY_NAME = "admin.key"


class AdminError(EchoSwarmError):
    """The coordinator refused an admin request, could not be reached, or no key/URL was found."""

    def __init__(self, message: str, reason: str = "", status: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class AdminUsageError(AdminError):
    """The command itself is wrong, so no request was sent: no coordinator named, an unreadable key file, an
    argument that no coordinator would accept. `echo-swarm admin` exits with the usage code (2) for it."""


M = TypeVar("M", bound=Message)

# what an argument must look like, said in words (a pydantic error quotes the field's regex, which helps nobody)
_IDS = {"client": ("client", "client id", "echo-swarm admin clients"),
        "key_id": ("key", "key id", "echo-swarm admin keys list")}
_RULES = {
    "job_id": "a job id is 1 to 64 letters, digits, '_' or '-', as `echo-swarm admin jobs` lists them",
    "outcome": "an outcome is lowercase letters and '_', e.g. accepted or rejected",
    "note": "a note is one line of at most 256 characters",
    "comment": "a comment is one line of at most 128 characters",
    "text": f"a notice is one line of 1 to {MAX_NOTICE_CHARS} printable characters",
    "min_client_version": "a release number such as 0.4 or 1.2.3, as `echo-swarm --version` prints it",
}


def _argument_problem(field: str, value: Any) -> str:
    """One line for an argument the request schema refuses: what was wrong and what would do."""
    if field in _IDS:
        label, what, lister = _IDS[field]
        text = str(value)
        why = ("is not hex (0-9, a-f)" if not re.fullmatch(r"[0-9a-f]*", text) else
               f"is too short ({len(text)} hex digits)" if len(text) < 6 else f"is longer than a {what} (32 hex digits)")
        return f"{label} {text!r} {why}: give the whole {what} or at least its first 6 digits, as `{lister}` shows them"
    rule = _RULES.get(field, "see `echo-swarm admin --help`")
    shown = f"{value!r} " if isinstance(value, str) and len(value) <= 64 and "\n" not in value else ""
    return f"{field.replace('_', ' ')} {shown}does not fit: {rule}"


def _body(model: type[M], **fields: Any) -> M:
    """The request body, or AdminUsageError saying which argument does not fit, before anything is sent."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        loc = exc.errors()[0]["loc"]
        field = str(loc[0]) if loc else ""
        raise AdminUsageError(_argument_problem(field, fields.get(field))) from None


def resolve_target(url: str | None, run_dir: Path | None, key_path: Path | None) -> tuple[str, Path]:
    """URL: --url, else $ECHO_SWARM_ADMIN_URL, else <run_dir>/endpoint.json (written by a running coordinator).
    Key: --key, else $ECHO_SWARM_ADMIN_KEY, else <run_dir>/admin.key (created with the run)."""
    url = url or os.environ.get("ECHO_SWARM_ADMIN_URL") or None
    env_key = os.environ.get("ECHO_SWARM_ADMIN_KEY")
    key_path = key_path or (Path(env_key) if env_key else None)
    if url is None and run_dir is not None:
        endpoint = run_dir / "endpoint.json"
        try:
            url = str(json.loads(endpoint.read_text())["url"]).replace("//0.0.0.0:", "//127.0.0.1:")
        except (OSError, ValueError, KeyError):
            raise AdminError(f"no coordinator URL: {endpoint} is missing or unreadable (is the coordinator running "
                             f"with --run-dir {run_dir}?). Pass --url http://HOST:PORT") from None
    if key_path is None and run_dir is not None:
        key_path = run_dir / DEFAULT_KEY_NAME
    if url is None or key_path is None:
        raise AdminUsageError("say which coordinator to administer: --run-dir DIR on the coordinator's machine, "
                              "or --url http://HOST:PORT --key PATH (an operator key listed in the run's admin_keys)")
    return url.rstrip("/"), key_path


@dataclass
class AdminClient:
    url: str
    key: Ed25519PrivateKey
    timeout_s: float = 60.0
    retries: int = 3
    key_path: Path | None = None  # where the key came from: `keys rotate` rewrites it
    notices: Notices = field(init=False, repr=False)  # the operator's notices to every volunteer
    keys: OperatorKeys = field(init=False, repr=False)  # the run's operator keys

    def __post_init__(self) -> None:
        self.notices = Notices(self)
        self.keys = OperatorKeys(self)

    @classmethod
    def open(cls, url: str | None = None, run_dir: Path | None = None, key_path: Path | None = None,
             timeout_s: float = 60.0, retries: int = 3) -> AdminClient:
        url, key_path = resolve_target(url, run_dir, key_path)
        try:
            key = crypto.load_private_key(key_path)
        except crypto.KeyFileError as exc:
            raise AdminUsageError(str(exc)) from None
        return cls(url, key, timeout_s, retries, key_path)

    @property
    def key_id(self) -> str:
        return crypto.client_id_for(crypto.public_bytes(self.key))

    def call(self, name: str, body: Message) -> dict[str, Any]:
        """Sign and POST; connection failures are retried (bounded, with backoff), refusals are not."""
        path = f"/v1/admin/{name}"
        for attempt in range(1, self.retries + 1):
            envelope = crypto.sign_request(self.key, path, wire.encode(body), timestamp=time.time())
            req = urllib.request.Request(self.url + path, data=wire.encode(envelope), method="POST",
                                         headers={"Content-Type": "application/msgpack"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as err:
                raise _refusal(err.code, err.read()) from None
            except (urllib.error.URLError, OSError) as exc:
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise AdminError(f"cannot reach the coordinator at {self.url}: {reason}. Is it running, and is "
                                     f"the URL right?") from None
                time.sleep(min(4.0, 0.5 * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")

    # -- one method per endpoint ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return self.call("status", AdminEmpty())

    def clients(self, limit: int = 1000) -> list[dict[str, Any]]:
        return self.call("clients", AdminList(limit=limit))["clients"]

    def ban(self, client: str, note: str = "") -> dict[str, Any]:
        return self.call("ban", _body(AdminBan, client=client.lower(), banned=True, note=note))

    def unban(self, client: str, note: str = "") -> dict[str, Any]:
        return self.call("ban", _body(AdminBan, client=client.lower(), banned=False, note=note))

    def versions(self, limit: int = 50) -> dict[str, Any]:
        return self.call("versions", AdminList(limit=limit))

    def jobs(self, limit: int = 200) -> dict[str, Any]:
        return self.call("jobs", AdminList(limit=limit))

    def audit(self, limit: int = 100, client: str | None = None, job_id: str | None = None,
              outcome: str | None = None) -> list[dict[str, Any]]:
        body = _body(AdminAudit, limit=limit, client=client.lower() if client else None, job_id=job_id,
                     outcome=outcome)
        return self.call("audit", body)["entries"]

    def checkpoint(self) -> dict[str, Any]:
        return self.call("checkpoint", AdminEmpty())

    def pause(self) -> dict[str, Any]:
        return self.call("issuing", AdminIssuing(paused=True))

    def resume(self) -> dict[str, Any]:
        return self.call("issuing", AdminIssuing(paused=False))

    def invite(self, note: str = "") -> dict[str, Any]:
        return self.call("invite", _body(AdminInvite, note=note))

    def registration(self, mode: str) -> dict[str, Any]:
        return self.call("registration", _body(AdminRegistration, mode=mode))


def generate_key_file(path: Path) -> dict[str, str]:
    """A new operator key for another person or machine; its public key goes to `admin keys add`."""
    if path.exists():
        raise AdminUsageError(f"{path} already exists; choose another file (keys are never overwritten)")
    key = crypto.generate_key()
    crypto.save_private_key(key, path)
    pub = crypto.public_bytes(key)
    return {"key_file": str(path), "public_key": pub.hex(), "key_id": crypto.client_id_for(pub)}


def _refusal(status: int, raw: bytes) -> AdminError:
    try:
        err = wire.decode(raw, ErrorBody)
    except ProtocolError:
        return AdminError(f"the coordinator answered HTTP {status} with an unreadable body", "", status)
    return AdminError(f"refused ({status} {err.error}): {err.message}", err.error, status)


class Notices:
    """The run's notices to every volunteer (GET /v1/notices serves them signed), through an admin client."""

    def __init__(self, client: AdminClient) -> None:
        self.client = client

    def publish(self, text: str, kind: str = "operator", min_client_version: str | None = None) -> dict[str, Any]:
        """Publish a notice; checked as the wire's Notice first, so a notice no client would accept is never sent."""
        fields = {"text": text, "kind": kind, "min_client_version": min_client_version}
        _body(Notice, notice_id=1, at=0.0, **fields)
        return self.client.call("notice", _body(AdminNotice, **fields))

    def withdraw(self, notice_id: int) -> dict[str, Any]:
        return self.client.call("notice", _body(AdminNotice, withdraw=notice_id))

    def list(self) -> list[dict[str, Any]]:
        return self.client.call("notices", AdminEmpty())["notices"]


class OperatorKeys:
    """The operator keys the run accepts (its admin_keys), through an admin client signing with one of them."""

    def __init__(self, client: AdminClient) -> None:
        self.client = client

    def list(self) -> dict[str, Any]:
        return self.client.call("keys", AdminEmpty())

    def add(self, public_key: bytes, comment: str = "") -> dict[str, Any]:
        return self.client.call("keys/add", _body(AdminKeyAdd, public_key=public_key, comment=comment))

    def remove(self, key_id: str) -> dict[str, Any]:
        return self.client.call("keys/remove", _body(AdminKeyRemove, key_id=key_id.lower()))

    def rotate(self, key_path: Path | None = None) -> dict[str, Any]:
        """Replace the client's operator key: the new key is saved beside the old one (``.new``), listed, then used
        to remove the old key — which proves it works — and finally moved over the old key file (``key_path``, by
        default the file the key was opened from)."""
        client = self.client
        key_path = key_path or client.key_path
        if key_path is None:
            raise AdminUsageError("no key file to rewrite: pass --key PATH (the key you are rotating)")
        new = crypto.generate_key()
        staged = key_path.with_name(key_path.name + ".new")
        crypto.save_private_key(new, staged)
        old_id = client.key_id
        stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
        added = self.add(crypto.public_bytes(new), f"rotated {stamp}")
        client.key = new
        self.remove(old_id)
        os.replace(staged, key_path)
        return {"old_key_id": old_id, "new_key_id": added["key_id"], "key_file": str(key_path)}
