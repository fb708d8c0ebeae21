"""The parts of the p2p snapshot path that need no network (shared/p2p.py): which bytes on disk count as verified,
and who may download from a peer (docs/protocol.md §6a). Importing shared.p2p must not need hivemind."""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.messages import ManifestFile
from shared.p2p import Uploads, verified_prefix

PIECE = 65536


def entry(data: bytes) -> ManifestFile:
    return ManifestFile(path="model.safetensors", size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                        piece_size=PIECE, pieces=[hashlib.sha256(data[i:i + PIECE]).digest()
                                                  for i in range(0, len(data), PIECE)])


def test_a_resume_starts_after_the_last_verified_piece(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000  # 3 whole pieces and a short fourth
    f, partial = entry(data), tmp_path / "x.partial"
    assert verified_prefix(partial, f) == 0  # nothing on disk yet
    partial.write_bytes(data[:PIECE + 100])  # one whole piece and a bit of the next
    assert verified_prefix(partial, f) == PIECE and partial.stat().st_size == PIECE
    partial.write_bytes(data[:2 * PIECE] + b"\0" * PIECE)  # the third piece is wrong (written by anyone)
    assert verified_prefix(partial, f) == 2 * PIECE and partial.read_bytes() == data[:2 * PIECE]
    partial.write_bytes(data)
    assert verified_prefix(partial, f) == len(data)  # the short last piece counts once it is whole


def test_uploads_are_bounded_per_peer_blob_and_bytes() -> None:
    u = Uploads(concurrent=2, per_blob=2, byte_cap=100)
    assert u.admit("a", "f1") == "ok" and u.admit("b", "f1") == "ok"
    assert u.admit("c", "f2") == "busy"  # two at once
    u.active -= 2
    assert u.admit("c", "f1") == "seeded"  # f1 went to two distinct peers already
    assert u.admit("a", "f1") == "ok"  # a peer that resumes keeps its slot
    u.active -= 1
    u.served_bytes = 100
    assert u.admit("d", "f3") == "capped"
    assert Uploads(serve=False).admit("a", "f1") == "busy"  # --no-serve


def test_importing_hivemind_leaves_our_log_level_names_alone() -> None:
    """hivemind renames WARNING to "WARN" process-wide when imported; our logs (and their parsers) keep WARNING."""
    import logging

    from shared.p2p import _validator_class

    _validator_class()  # imports hivemind
    assert logging.getLevelName(logging.WARNING) == "WARNING"
