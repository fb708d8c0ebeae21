"""sha256 content addressing: snapshot files, manifests and prompts are named by their hash."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from shared import wire


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def prompt_hash(token_id_lists: Sequence[Sequence[int]]) -> str:
    """Binds a job to its exact prompt tokens: sha256 of their canonical msgpack encoding."""
    return sha256_bytes(wire.pack([list(map(int, ids)) for ids in token_id_lists]))
