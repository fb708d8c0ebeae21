from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import PROTOCOL_VERSION, crypto, records, wire
from shared.errors import ProtocolError, Reason, SignatureError
from shared.messages import Manifest, SignedJob, SignedManifest

from .factories import job


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return crypto.generate_key()


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "v3"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 1000)
    (folder / "tokenizer.json").write_bytes(b"")
    (folder / ".hidden").write_text("ignored")
    (folder / "manifest.msgpack").write_bytes(b"ignored")
    (folder / "subdir").mkdir()
    return folder


def flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


# ---- manifests ------------------------------------------------------------------------------------------
def test_build_manifest_lists_files_by_hash(model_dir: Path) -> None:
    m = records.build_manifest(model_dir, run_id="run-1", version=3, created_at=1234.5)
    assert m.protocol == PROTOCOL_VERSION and m.run_id == "run-1" and m.version == 3 and m.created_at == 1234.5
    assert m.format == "hf-safetensors"
    assert [f.path for f in m.files] == ["config.json", "model.safetensors", "tokenizer.json"]
    by_name = {f.path: f for f in m.files}
    assert by_name["model.safetensors"].size == 1000
    assert by_name["model.safetensors"].sha256 == hashlib.sha256(b"\x00" * 1000).hexdigest()
    assert by_name["tokenizer.json"].sha256 == hashlib.sha256(b"").hexdigest()


def test_manifest_carries_the_hash_of_every_piece(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000  # 256000 bytes: three whole 64 KiB pieces and a shorter fourth
    (tmp_path / "model.safetensors").write_bytes(data)
    (tmp_path / "empty.json").write_bytes(b"")
    m = records.build_manifest(tmp_path, run_id="r", version=1, created_at=1.0, piece_size=65536)
    f = {f.path: f for f in m.files}
    assert f["model.safetensors"].piece_size == 65536
    assert f["model.safetensors"].pieces == [hashlib.sha256(data[i:i + 65536]).digest() for i in range(0, len(data), 65536)]
    assert len(f["model.safetensors"].pieces) == 4 and f["empty.json"].pieces == []
    wire.decode(wire.encode(m), Manifest)  # the pieces survive the wire


def test_piece_hashes_must_cover_the_file_exactly() -> None:
    from pydantic import ValidationError

    from shared.messages import ManifestFile

    sha, digest = "0" * 64, b"\x00" * 32
    with pytest.raises(ValidationError, match="3 piece hashes for 65537 bytes"):
        ManifestFile(path="a", size=65537, sha256=sha, piece_size=65536, pieces=[digest] * 3)
    with pytest.raises(ValidationError, match="power of two"):
        ManifestFile(path="a", size=10, sha256=sha, piece_size=65537, pieces=[digest])
    with pytest.raises(ValidationError, match="without a piece_size"):
        ManifestFile(path="a", size=10, sha256=sha, pieces=[digest])
    # a manifest published before protocol 4 (no piece fields at all) still decodes: HTTP-only files
    old = wire.pack({"path": "a", "size": 10, "sha256": sha, "form": "hf"})
    assert wire.decode(old, ManifestFile).pieces == []


def test_build_manifest_is_deterministic(model_dir: Path) -> None:
    a = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    b = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    assert wire.encode(a) == wire.encode(b)


def test_sign_open_manifest_round_trip(model_dir: Path, key: Ed25519PrivateKey) -> None:
    m = records.build_manifest(model_dir, run_id="run-1", version=3, created_at=1234.5)
    signed = records.sign_manifest(key, m)
    opened, sha = records.open_manifest(signed, crypto.public_bytes(key))
    assert opened == m
    assert sha == hashlib.sha256(signed.manifest).hexdigest()
    # and through the wire
    again = wire.decode(wire.encode(signed), SignedManifest)
    assert records.open_manifest(again, crypto.public_bytes(key)) == (m, sha)


def test_manifest_sha_changes_with_content(model_dir: Path, key: Ed25519PrivateKey) -> None:
    m1 = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    (model_dir / "model.safetensors").write_bytes(b"\x01" * 1000)
    m2 = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    pub = crypto.public_bytes(key)
    assert records.open_manifest(records.sign_manifest(key, m1), pub)[1] != \
        records.open_manifest(records.sign_manifest(key, m2), pub)[1]


@pytest.mark.parametrize("pos", [0, 5, -1])
def test_tampered_manifest_bytes_refused(model_dir: Path, key: Ed25519PrivateKey, pos: int) -> None:
    signed = records.sign_manifest(key, records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0))
    bad = SignedManifest(manifest=flip(signed.manifest, pos % len(signed.manifest)), signature=signed.signature)
    with pytest.raises(SignatureError):
        records.open_manifest(bad, crypto.public_bytes(key))


def test_manifest_substitution_refused(model_dir: Path, key: Ed25519PrivateKey) -> None:
    m = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    signed = records.sign_manifest(key, m)
    forged = wire.encode(m.model_copy(update={"version": 2}))
    with pytest.raises(SignatureError):
        records.open_manifest(SignedManifest(manifest=forged, signature=signed.signature), crypto.public_bytes(key))


def test_tampered_manifest_signature_refused(model_dir: Path, key: Ed25519PrivateKey) -> None:
    signed = records.sign_manifest(key, records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0))
    bad = SignedManifest(manifest=signed.manifest, signature=flip(signed.signature, 10))
    with pytest.raises(SignatureError):
        records.open_manifest(bad, crypto.public_bytes(key))


def test_manifest_wrong_coordinator_key_refused(model_dir: Path, key: Ed25519PrivateKey) -> None:
    signed = records.sign_manifest(key, records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0))
    with pytest.raises(SignatureError):
        records.open_manifest(signed, crypto.public_bytes(crypto.generate_key()))


def test_job_signature_does_not_open_a_manifest(key: Ed25519PrivateKey) -> None:
    # a signed job's bytes must never be accepted as a manifest (domain separation)
    signed_job = records.sign_job(key, job())
    with pytest.raises(SignatureError):
        records.open_manifest(SignedManifest(manifest=signed_job.job, signature=signed_job.signature),
                              crypto.public_bytes(key))


def test_signed_garbage_manifest_is_protocol_error(key: Ed25519PrivateKey) -> None:
    payload = wire.pack({"not": "a manifest"})
    signed = SignedManifest(manifest=payload, signature=crypto.sign(key, crypto.MANIFEST_DOMAIN, payload))
    with pytest.raises(ProtocolError) as info:
        records.open_manifest(signed, crypto.public_bytes(key))
    assert info.value.reason is Reason.SCHEMA


def test_empty_folder_cannot_make_a_manifest(tmp_path: Path) -> None:
    with pytest.raises(ValueError):  # pydantic ValidationError: files needs at least one entry
        records.build_manifest(tmp_path, run_id="r", version=0, created_at=0.0)


# ---- jobs -----------------------------------------------------------------------------------------------
def test_sign_open_job_round_trip(key: Ed25519PrivateKey) -> None:
    signed = records.sign_job(key, job())
    assert records.open_job(signed, crypto.public_bytes(key)) == job()
    again = wire.decode(wire.encode(signed), SignedJob)
    assert records.open_job(again, crypto.public_bytes(key)) == job()


def test_tampered_job_refused(key: Ed25519PrivateKey) -> None:
    signed = records.sign_job(key, job())
    for pos in (0, len(signed.job) // 2, len(signed.job) - 1):
        with pytest.raises(SignatureError):
            records.open_job(SignedJob(job=flip(signed.job, pos), signature=signed.signature),
                             crypto.public_bytes(key))


def test_job_field_substitution_refused(key: Ed25519PrivateKey) -> None:
    signed = records.sign_job(key, job())
    for update in ({"seed": 1}, {"client_id": "f" * 32}, {"deadline": 9e9}, {"group_size": 1}):
        forged = wire.encode(job(**update))
        with pytest.raises(SignatureError):
            records.open_job(SignedJob(job=forged, signature=signed.signature), crypto.public_bytes(key))


def test_job_tampered_signature_or_wrong_key_refused(key: Ed25519PrivateKey) -> None:
    signed = records.sign_job(key, job())
    with pytest.raises(SignatureError):
        records.open_job(SignedJob(job=signed.job, signature=flip(signed.signature, 63)), crypto.public_bytes(key))
    with pytest.raises(SignatureError):
        records.open_job(signed, crypto.public_bytes(crypto.generate_key()))


def test_manifest_signature_does_not_open_a_job(model_dir: Path, key: Ed25519PrivateKey) -> None:
    m = records.sign_manifest(key, records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0))
    with pytest.raises(SignatureError):
        records.open_job(SignedJob(job=m.manifest, signature=m.signature), crypto.public_bytes(key))


def test_open_manifest_returns_manifest_type(model_dir: Path, key: Ed25519PrivateKey) -> None:
    m = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0)
    opened, _ = records.open_manifest(records.sign_manifest(key, m), crypto.public_bytes(key))
    assert isinstance(opened, Manifest)


def test_a_snapshot_published_under_protocol_1_still_opens(model_dir: Path, key: Ed25519PrivateKey) -> None:
    """Manifests live in the run directory and are re-served after an upgrade; their layout is unchanged since
    protocol 1, so an older one still opens, and a newer one than this build knows does not."""
    old = records.build_manifest(model_dir, run_id="r", version=1, created_at=1.0).model_copy(update={"protocol": 1})
    signed = records.sign_manifest(key, old)
    opened, _ = records.open_manifest(wire.decode(wire.encode(signed), SignedManifest), crypto.public_bytes(key))
    assert opened.protocol == 1
    future = old.model_copy(update={"protocol": PROTOCOL_VERSION + 1})
    with pytest.raises(ProtocolError):
        records.open_manifest(records.sign_manifest(key, future), crypto.public_bytes(key))


# ---- the DHT's latest-version record (docs/protocol.md §6a) ------------------------------------------------
def test_latest_record_opens_only_as_signed(key: Ed25519PrivateKey) -> None:
    pub = crypto.public_bytes(key)
    rec = records.sign_latest(key, run_id="run-1", version=7, manifest_sha256="ab" * 32, created_at=1000.0,
                              expires_at=1300.0)
    data = wire.encode(rec)
    assert records.open_latest(data, pub, "run-1", expiration=1300.0, max_ttl_s=600) == rec
    with pytest.raises(ValueError, match="re-dated"):
        records.open_latest(data, pub, "run-1", expiration=1400.0, max_ttl_s=600)
    with pytest.raises(ValueError, match="not 'run-2'"):
        records.open_latest(data, pub, "run-2", expiration=1300.0, max_ttl_s=600)
    with pytest.raises(ValueError, match="at most 100s"):
        records.open_latest(data, pub, "run-1", expiration=1300.0, max_ttl_s=100)
    with pytest.raises(SignatureError):  # another key
        records.open_latest(data, crypto.public_bytes(crypto.generate_key()), "run-1", expiration=1300.0, max_ttl_s=600)
    for field, value in (("version", 8), ("expires_at", 1301.0), ("manifest_sha256", "cd" * 32)):
        tampered = wire.encode(rec.model_copy(update={field: value}))
        with pytest.raises(SignatureError):
            records.open_latest(tampered, pub, "run-1", expiration=float(rec.expires_at if field != "expires_at"
                                                                           else value), max_ttl_s=600)
