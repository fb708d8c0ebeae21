"""Ed25519 identities and the signed-request envelope.

- The coordinator's key signs every job and every snapshot manifest; clients pin it on first contact.
- Each client's key signs every request. The signature covers the protocol number, the client id, a
  timestamp, a random nonce, the endpoint path and the body, so a captured request can neither be replayed
  (nonce + timestamp window) nor re-targeted at another endpoint (path).
- A client id is derived from the public key (first 16 bytes of its sha256, hex), so an id cannot be
  claimed with someone else's key.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared import PROTOCOL_VERSION, wire
from shared.errors import EchoSwarmError, ProtocolError, Reason, SignatureError
from shared.messages import SignedRequest

REQUEST_DOMAIN = b"echo-swarm/request/v1"
JOB_DOMAIN = b"echo-swarm/job/v1"
MANIFEST_DOMAIN = b"echo-swarm/manifest/v1"
NOTICES_DOMAIN = b"echo-swarm/notices/v1"  # the run's notice board (GET /v1/notices, docs/protocol.md §4)
LATEST_DOMAIN = b"echo-swarm/dht-latest/v1"  # the DHT record of a run's newest version (docs/protocol.md §6a)


class KeyFileError(EchoSwarmError):
    """A key file is missing, unreadable, malformed, or readable by other users."""


def client_id_for(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:32]


def public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def save_private_key(key: Ed25519PrivateKey, path: Path) -> None:
    """Write the key as raw 32 bytes with mode 0600, atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, raw)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        mode = path.stat().st_mode & 0o777
        raw = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise KeyFileError(
            f"key file {path} is readable by other users (mode {mode:o}); run `chmod 600 {path}` and retry"
        )
    if len(raw) != 32:
        raise KeyFileError(f"key file {path} is not a 32-byte Ed25519 key; move it away to create a new identity")
    return Ed25519PrivateKey.from_private_bytes(raw)


def load_or_create_key(path: Path) -> tuple[Ed25519PrivateKey, bool]:
    """Load the key at ``path``, or create one there. Returns (key, created)."""
    if path.exists():
        return load_private_key(path), False
    key = generate_key()
    save_private_key(key, path)
    return key, True


def sign(key: Ed25519PrivateKey, domain: bytes, payload: bytes) -> bytes:
    return key.sign(domain + b"\0" + payload)


def verify(public_key: bytes, domain: bytes, payload: bytes, signature: bytes) -> None:
    """Raise SignatureError unless ``signature`` is ``public_key``'s signature of (domain, payload)."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, domain + b"\0" + payload)
    except (InvalidSignature, ValueError):
        raise SignatureError("signature does not verify") from None


def _request_signing_bytes(
    protocol: int, client_id: str, timestamp: float, nonce: bytes, path: str, body: bytes
) -> bytes:
    return wire.pack([protocol, client_id, timestamp, nonce, path, body])


def sign_request(key: Ed25519PrivateKey, path: str, body: bytes, *, timestamp: float) -> SignedRequest:
    client_id = client_id_for(public_bytes(key))
    nonce = secrets.token_bytes(16)
    payload = _request_signing_bytes(PROTOCOL_VERSION, client_id, timestamp, nonce, path, body)
    return SignedRequest(
        protocol=PROTOCOL_VERSION,
        client_id=client_id,
        timestamp=timestamp,
        nonce=nonce,
        path=path,
        body=body,
        signature=sign(key, REQUEST_DOMAIN, payload),
    )


def verify_request(request: SignedRequest, public_key: bytes) -> None:
    """Check the envelope's signature under ``public_key`` and that the id derives from that key."""
    if client_id_for(public_key) != request.client_id:
        raise ProtocolError(Reason.CLIENT_ID_MISMATCH, "client_id is not derived from the presented public key")
    payload = _request_signing_bytes(
        request.protocol, request.client_id, request.timestamp, request.nonce, request.path, request.body
    )
    verify(public_key, REQUEST_DOMAIN, payload, request.signature)
