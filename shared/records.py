"""Signed records from the coordinator: snapshot manifests (a version = files named by sha256) and jobs."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import PROTOCOL_VERSION, crypto, wire
from shared.hashing import PIECE_SIZE, file_digests, sha256_bytes
from shared.messages import Job, Manifest, ManifestFile, SignedJob, SignedManifest

GGUF_FILES = {"model.gguf": "gguf", "base.gguf": "gguf-base", "adapter.gguf": "gguf-lora"}


def file_form(name: str) -> str:
    """Which client form a snapshot file belongs to (see ManifestFile.form)."""
    return GGUF_FILES.get(name, "hf")


def manifest_file(path: Path, name: str | None = None, piece_size: int = PIECE_SIZE) -> ManifestFile:
    """The manifest entry of one file: size, sha256 and the sha256 of each piece (one read)."""
    digest, pieces = file_digests(path, piece_size)
    return ManifestFile(path=name or path.name, size=path.stat().st_size, sha256=digest,
                        form=file_form(name or path.name), piece_size=piece_size, pieces=pieces)  # type: ignore[arg-type]


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


def sign_job(key: Ed25519PrivateKey, job: Job) -> SignedJob:
    payload = wire.encode(job)
    return SignedJob(job=payload, signature=crypto.sign(key, crypto.JOB_DOMAIN, payload))


def open_job(signed: SignedJob, coordinator_key: bytes) -> Job:
    crypto.verify(coordinator_key, crypto.JOB_DOMAIN, signed.job, signed.signature)
    return wire.decode(signed.job, Job)
