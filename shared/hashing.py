"""sha256 content addressing: snapshot files, manifests and prompts are named by their hash."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from shared import wire


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokens_sha256(sequences: Sequence[Sequence[int]]) -> str:
    """The content hash of a result's completions: their token ids, in order (msgpack of the lists), whatever
    else the submission's bytes carry (logprobs, timings) — two results with this hash equal hold the same
    tokens."""
    return hashlib.sha256(wire.pack([[int(t) for t in s] for s in sequences])).hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


PIECE_SIZE = 16 * 1024 * 1024
"""Bytes per piece of a snapshot file (ManifestFile.piece_size): a receiver checks each piece as it arrives, so a
peer serving bad bytes is caught after at most this much."""


def file_digests(path: Path, piece_size: int = PIECE_SIZE) -> tuple[str, list[bytes]]:
    """(sha256 hex of the whole file, raw sha256 of each ``piece_size`` piece, the last one possibly shorter), in
    one read of the file: publishing a multi-gigabyte snapshot hashes it once, not twice."""
    whole = hashlib.sha256()
    pieces: list[bytes] = []
    with open(path, "rb") as fh:
        while chunk := fh.read(piece_size):
            whole.update(chunk)
            pieces.append(hashlib.sha256(chunk).digest())
    return whole.hexdigest(), pieces


def prompt_hash(token_id_lists: Sequence[Sequence[int]]) -> str:
    """Binds a job to its exact prompt tokens: sha256 of their canonical msgpack encoding."""
    return sha256_bytes(wire.pack([list(map(int, ids)) for ids in token_id_lists]))


class FileDigest:
    """The sha256 of a file being written front to back, kept up to date as bytes are appended, so that the
    whole-file check of a download is no second pass over the file (docs/protocol.md §6, §6a). ``size`` is how
    many leading bytes it covers; :meth:`catch_up` makes it cover exactly what the file holds now, reading only
    what it has not seen (everything again when the file was cut back below it). A writer that rewrites the file
    from its start calls :meth:`reset` first."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.size += len(data)

    def reset(self) -> None:
        self._hash, self.size = hashlib.sha256(), 0

    def catch_up(self, path: Path) -> None:
        size = path.stat().st_size if path.exists() else 0
        if size < self.size:
            self.reset()
        if size > self.size:
            with open(path, "rb") as fh:
                fh.seek(self.size)
                while self.size < size and (chunk := fh.read(min(1 << 20, size - self.size))):
                    self.update(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()
