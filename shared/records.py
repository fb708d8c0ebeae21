"""Signed records from the coordinator: snapshot manifests (a version = files named by sha256) and jobs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import get_args

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import PROTOCOL_VERSION, crypto, wire
from shared.hashing import PIECE_SIZE, file_digests, sha256_bytes
from shared.llama_files import gguf_precision, name_precision
from shared.messages import (
    Job,
    LatestRecord,
    Manifest,
    ManifestFile,
    NoticeBoard,
    Precision,
    SignedJob,
    SignedManifest,
    SignedNotices,
)

logger = logging.getLogger(__name__)

GGUF_FILES = {"model.gguf": "gguf", "base.gguf": "gguf-base", "adapter.gguf": "gguf-lora"}
DELTA_SUFFIX = ".delta"  # "model.safetensors.delta": the patch that rebuilds model.safetensors (shared.deltas)


def file_form(name: str) -> str:
    """Which client form a snapshot file belongs to (see ManifestFile.form)."""
    if name.endswith(DELTA_SUFFIX):
        return "delta"
    return "gguf" if name_precision(name) is not None else GGUF_FILES.get(name, "hf")


def file_precision(path: Path, form: str) -> str | None:
    """A whole-model or base GGUF's precision for its manifest entry: from its name (``model.<p>.gguf``) or its
    header; None for other forms, and for a file whose header names none the protocol knows."""
    if form not in ("gguf", "gguf-base"):
        return None
    named = name_precision(path.name)
    try:
        precision = named or gguf_precision(path)
    except (ImportError, OSError, ValueError, KeyError, IndexError) as exc:
        logger.warning("%s: no GGUF precision read (%s); its manifest entry states none", path.name, exc)
        return None
    return precision if precision in get_args(Precision) else None


def manifest_file(path: Path, name: str | None = None, piece_size: int = PIECE_SIZE, *,
                  base_sha256: str | None = None, result_sha256: str | None = None) -> ManifestFile:
    """The manifest entry of one file: size, sha256 and the sha256 of each piece (one read); a patch also names
    the file it applies to and the file it rebuilds; a GGUF its precision."""
    digest, pieces = file_digests(path, piece_size)
    form = file_form(name or path.name)
    return ManifestFile(path=name or path.name, size=path.stat().st_size, sha256=digest,
                        form=form, piece_size=piece_size, pieces=pieces,  # type: ignore[arg-type]
                        base_sha256=base_sha256, result_sha256=result_sha256,
                        precision=file_precision(path, form))  # type: ignore[arg-type]


def build_manifest(folder: Path, *, run_id: str, version: int, created_at: float,
                   piece_size: int = PIECE_SIZE) -> Manifest:
    files = [
        manifest_file(p, piece_size=piece_size)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name != "manifest.msgpack"
    ]
    return Manifest(
        protocol=PROTOCOL_VERSION, run_id=run_id, version=version, created_at=created_at,
        format="hf-safetensors", files=files,
    )


def sign_manifest(key: Ed25519PrivateKey, manifest: Manifest) -> SignedManifest:
    payload = wire.encode(manifest)
    return SignedManifest(manifest=payload, signature=crypto.sign(key, crypto.MANIFEST_DOMAIN, payload))


def open_manifest(signed: SignedManifest, coordinator_key: bytes) -> tuple[Manifest, str]:
    """Verify the signature, then decode. Returns (manifest, manifest_sha256)."""
    crypto.verify(coordinator_key, crypto.MANIFEST_DOMAIN, signed.manifest, signed.signature)
    return wire.decode(signed.manifest, Manifest), sha256_bytes(signed.manifest)


def sign_notices(key: Ed25519PrivateKey, board: NoticeBoard) -> SignedNotices:
    payload = wire.encode(board)
    return SignedNotices(board=payload, signature=crypto.sign(key, crypto.NOTICES_DOMAIN, payload))


def open_notices(signed: SignedNotices, coordinator_key: bytes, run_id: str) -> NoticeBoard:
    """Verify the signature with the pinned key, then decode; a board of another run is refused (ValueError): a
    board signed for one run cannot be replayed to the volunteers of the next under the same key."""
    crypto.verify(coordinator_key, crypto.NOTICES_DOMAIN, signed.board, signed.signature)
    board = wire.decode(signed.board, NoticeBoard)
    if board.run_id != run_id:
        raise ValueError(f"a notice board of run {board.run_id!r}, not {run_id!r}")
    return board


def sign_job(key: Ed25519PrivateKey, job: Job) -> SignedJob:
    payload = wire.encode(job)
    return SignedJob(job=payload, signature=crypto.sign(key, crypto.JOB_DOMAIN, payload))


def open_job(signed: SignedJob, coordinator_key: bytes) -> Job:
    crypto.verify(coordinator_key, crypto.JOB_DOMAIN, signed.job, signed.signature)
    return wire.decode(signed.job, Job)


def latest_key(run_id: str) -> str:
    """The DHT key of a run's newest-version record (docs/protocol.md §6a)."""
    return f"es1/{run_id}/latest"


def blob_key(run_id: str, sha256: str) -> str:
    """The DHT key under which the holders of one file announce themselves, one subkey each."""
    return f"es1/{run_id}/blob/{sha256}"


def _latest_signing_bytes(r: LatestRecord) -> bytes:
    return wire.pack([latest_key(r.run_id), r.run_id, r.version, r.manifest_sha256, r.created_at, r.expires_at])


def sign_latest(key: Ed25519PrivateKey, *, run_id: str, version: int, manifest_sha256: str, created_at: float,
                expires_at: float) -> LatestRecord:
    unsigned = LatestRecord(run_id=run_id, version=version, manifest_sha256=manifest_sha256, created_at=created_at,
                            expires_at=expires_at, signature=b"\0" * 64)
    return unsigned.model_copy(update={"signature": crypto.sign(key, crypto.LATEST_DOMAIN,
                                                                 _latest_signing_bytes(unsigned))})


def open_latest(data: bytes, coordinator_key: bytes, run_id: str, *, expiration: float,
                max_ttl_s: float) -> LatestRecord:
    """Decode and check a latest-version record as found in the DHT: the coordinator's signature, the run, and
    that the DHT expiration is the signed one and not further than ``max_ttl_s`` after its creation (a record
    cannot be kept alive by re-dating it). Raises ProtocolError / SignatureError / ValueError."""
    record = wire.decode(data, LatestRecord)
    if record.run_id != run_id:
        raise ValueError(f"latest record of run {record.run_id!r}, not {run_id!r}")
    crypto.verify(coordinator_key, crypto.LATEST_DOMAIN, _latest_signing_bytes(record), record.signature)
    if expiration != record.expires_at:
        raise ValueError("latest record re-dated: its DHT expiration is not the signed one")
    if not 0 < record.expires_at - record.created_at <= max_ttl_s:
        raise ValueError(f"latest record lives {record.expires_at - record.created_at:.0f}s; at most {max_ttl_s:.0f}s")
    return record
