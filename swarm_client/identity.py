"""The client's home: identity key (0600), pinned coordinator keys, snapshot cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import crypto
from shared.errors import EchoSwarmError


class CoordinatorKeyChanged(EchoSwarmError):
    """The coordinator at a known URL presents a different signing key than the one pinned earlier."""


@dataclass
class Identity:
    key: Ed25519PrivateKey
    public_key: bytes
    client_id: str
    created: bool


def load_identity(home: Path) -> Identity:
    """Load the client key from ``home/identity.key``, creating it (mode 0600) on first use."""
    home.mkdir(parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    key, created = crypto.load_or_create_key(home / "identity.key")
    pub = crypto.public_bytes(key)
    return Identity(key, pub, crypto.client_id_for(pub), created)


def pin_coordinator(home: Path, url: str, public_key: bytes, *, expected: bytes | None = None) -> bool:
    """Trust on first use: remember the coordinator's key per URL; refuse a changed key later.

    ``expected`` (from --coordinator-key) overrides the pin and must match. Returns True if newly pinned.
    """
    if expected is not None and expected != public_key:
        raise CoordinatorKeyChanged(
            f"the coordinator at {url} presents key {public_key.hex()}, not the {expected.hex()} you passed")
    path = home / "known_coordinators.json"
    known: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    pinned = known.get(url)
    if pinned is not None and pinned != public_key.hex() and expected is None:
        raise CoordinatorKeyChanged(
            f"the coordinator at {url} now presents a different signing key than when you first joined.\n"
            f"  pinned:    {pinned}\n  presented: {public_key.hex()}\n"
            f"If the operator really rotated the key, remove its line from {path}; otherwise do not connect.")
    if pinned == public_key.hex():
        return False
    known[url] = public_key.hex()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(known, indent=2))
    tmp.replace(path)
    return True
