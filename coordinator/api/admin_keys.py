"""Operator keys: who may call the admin API.

The run directory holds ``admin_keys``, a text file with one Ed25519 public key per line (64 hex digits, then
an optional comment; ``#`` starts a comment line). It is re-read on every admin request, so an operator can
add or revoke a key by editing it, without a restart. On first start the coordinator creates one operator key,
``admin.key`` (mode 0600, next to the database), and lists it, so `echo-swarm admin --run-dir DIR ...` works
on the coordinator's machine out of the box; copy that key (or add your own with `admin keys add`) to
administer from elsewhere.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from shared import crypto

logger = logging.getLogger(__name__)

ADMIN_KEYS_FILE = "admin_keys"
ADMIN_KEY_FILE = "admin.key"


@dataclass(frozen=True)
class AdminKey:
    key_id: str  # crypto.client_id_for(public_key): what signed requests carry as their client id
    public_key: bytes
    comment: str

    def as_dict(self) -> dict[str, str]:
        return {"key_id": self.key_id, "public_key": self.public_key.hex(), "comment": self.comment}


def parse_admin_keys(text: str) -> tuple[list[AdminKey], list[str]]:
    """Lines → keys, plus a message per line that is not a key (so a typo is reported, never silently a key)."""
    keys: list[AdminKey] = []
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        hex_key, _, comment = line.partition(" ")
        try:
            raw = bytes.fromhex(hex_key)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            problems.append(f"line {n}: {hex_key[:20]!r} is not a 64-hex-digit Ed25519 public key")
            continue
        keys.append(AdminKey(crypto.client_id_for(raw), raw, comment.strip()))
    return keys, problems


def load_admin_keys(run_dir: Path) -> list[AdminKey]:
    path = run_dir / ADMIN_KEYS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    keys, problems = parse_admin_keys(text)
    for p in problems:
        logger.warning("%s %s (ignored)", path, p)
    return keys


def write_admin_keys(run_dir: Path, keys: list[AdminKey]) -> None:
    """Rewrite the file atomically (temp file, fsync, rename)."""
    path = run_dir / ADMIN_KEYS_FILE
    text = "# echo-swarm operator keys: <Ed25519 public key, 64 hex digits> <comment>\n" + "".join(
        f"{k.public_key.hex()} {k.comment}".rstrip() + "\n" for k in keys)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_admin_key(run_dir: Path) -> None:
    """First start: create ``admin.key`` and list it in ``admin_keys``. Never touches an existing keys file."""
    if (run_dir / ADMIN_KEYS_FILE).exists():
        return
    key, created = crypto.load_or_create_key(run_dir / ADMIN_KEY_FILE)
    pub = crypto.public_bytes(key)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    write_admin_keys(run_dir, [AdminKey(crypto.client_id_for(pub), pub, f"created with the run {stamp}")])
    logger.info("operator key %s listed in %s", run_dir / ADMIN_KEY_FILE, run_dir / ADMIN_KEYS_FILE)
