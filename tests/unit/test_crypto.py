from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared import PROTOCOL_VERSION, crypto, wire
from shared.errors import ProtocolError, Reason, SignatureError
from shared.messages import SignedRequest

NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def key() -> Ed25519PrivateKey:
    return crypto.generate_key()


@pytest.fixture(scope="module")
def other_key() -> Ed25519PrivateKey:
    return crypto.generate_key()


# ---- sign / verify --------------------------------------------------------------------------------------
def test_sign_verify_round_trip(key: Ed25519PrivateKey) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    assert len(sig) == 64
    crypto.verify(crypto.public_bytes(key), crypto.JOB_DOMAIN, b"payload", sig)


def test_tampered_payload(key: Ed25519PrivateKey) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    for tampered in (b"payloae", b"payload\x00", b"", b"Payload"):
        with pytest.raises(SignatureError):
            crypto.verify(crypto.public_bytes(key), crypto.JOB_DOMAIN, tampered, sig)


def test_wrong_key(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    with pytest.raises(SignatureError) as info:
        crypto.verify(crypto.public_bytes(other_key), crypto.JOB_DOMAIN, b"payload", sig)
    assert info.value.reason is Reason.BAD_SIGNATURE
    assert isinstance(info.value, ProtocolError)


@pytest.mark.parametrize("domain", [crypto.MANIFEST_DOMAIN, crypto.REQUEST_DOMAIN, b"echo-swarm/job/v2", b""])
def test_wrong_domain(key: Ed25519PrivateKey, domain: bytes) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    with pytest.raises(SignatureError):
        crypto.verify(crypto.public_bytes(key), domain, b"payload", sig)


def test_domain_separator_prevents_shifting(key: Ed25519PrivateKey) -> None:
    # (domain "ab", payload "c") must not verify as (domain "a", payload "bc")
    sig = crypto.sign(key, b"ab", b"c")
    with pytest.raises(SignatureError):
        crypto.verify(crypto.public_bytes(key), b"a", b"bc", sig)


@pytest.mark.parametrize("mutate", [lambda s: s[:-1], lambda s: s[:32], lambda s: b"", lambda s: s + b"\x00",
                                    lambda s: bytes([s[0] ^ 1]) + s[1:]],
                         ids=["truncated-1", "truncated-half", "empty", "extended", "bitflip"])
def test_bad_signature_bytes(key: Ed25519PrivateKey, mutate: object) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    with pytest.raises(SignatureError):
        crypto.verify(crypto.public_bytes(key), crypto.JOB_DOMAIN, b"payload", mutate(sig))  # type: ignore[operator]


@pytest.mark.parametrize("public_key", [b"", b"x" * 31, b"x" * 33])
def test_malformed_public_key(key: Ed25519PrivateKey, public_key: bytes) -> None:
    sig = crypto.sign(key, crypto.JOB_DOMAIN, b"payload")
    with pytest.raises(SignatureError):
        crypto.verify(public_key, crypto.JOB_DOMAIN, b"payload", sig)


# ---- client ids -----------------------------------------------------------------------------------------
def test_client_id_derived_from_public_key(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey) -> None:
    cid = crypto.client_id_for(crypto.public_bytes(key))
    assert len(cid) == 32 and all(c in "0123456789abcdef" for c in cid)
    assert cid == crypto.client_id_for(crypto.public_bytes(key))
    assert cid != crypto.client_id_for(crypto.public_bytes(other_key))


# ---- signed requests ------------------------------------------------------------------------------------
def test_sign_request_round_trip(key: Ed25519PrivateKey) -> None:
    req = crypto.sign_request(key, "/v1/lease", b"body", timestamp=NOW)
    assert req.protocol == PROTOCOL_VERSION
    assert req.client_id == crypto.client_id_for(crypto.public_bytes(key))
    assert req.timestamp == NOW and req.path == "/v1/lease" and req.body == b"body"
    crypto.verify_request(req, crypto.public_bytes(key))
    # and it survives the wire
    crypto.verify_request(wire.decode(wire.encode(req), SignedRequest), crypto.public_bytes(key))


def test_sign_request_uses_fresh_nonces(key: Ed25519PrivateKey) -> None:
    nonces = {crypto.sign_request(key, "/v1/lease", b"", timestamp=NOW).nonce for _ in range(20)}
    assert len(nonces) == 20
    assert all(len(n) == 16 for n in nonces)


@pytest.mark.parametrize(("field", "value"), [
    ("body", b"bodY"),
    ("body", b""),
    ("path", "/v1/submit"),
    ("timestamp", NOW + 1),
    ("nonce", b"\x00" * 16),
    ("protocol", PROTOCOL_VERSION + 1),
])
def test_tampered_request_fails(key: Ed25519PrivateKey, field: str, value: object) -> None:
    req = crypto.sign_request(key, "/v1/lease", b"body", timestamp=NOW)
    tampered = req.model_copy(update={field: value})
    with pytest.raises(SignatureError):
        crypto.verify_request(tampered, crypto.public_bytes(key))


def test_request_signed_by_another_key_fails(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey) -> None:
    req = crypto.sign_request(other_key, "/v1/lease", b"body", timestamp=NOW)
    forged = req.model_copy(update={"client_id": crypto.client_id_for(crypto.public_bytes(key))})
    with pytest.raises(SignatureError):
        crypto.verify_request(forged, crypto.public_bytes(key))


def test_client_id_not_derived_from_key(key: Ed25519PrivateKey, other_key: Ed25519PrivateKey) -> None:
    req = crypto.sign_request(key, "/v1/lease", b"body", timestamp=NOW)
    with pytest.raises(ProtocolError) as info:
        crypto.verify_request(req, crypto.public_bytes(other_key))
    assert info.value.reason is Reason.CLIENT_ID_MISMATCH
    assert not isinstance(info.value, SignatureError)
    assert info.value.http_status == 401


def test_request_signature_is_domain_separated(key: Ed25519PrivateKey) -> None:
    req = crypto.sign_request(key, "/v1/lease", b"body", timestamp=NOW)
    payload = wire.pack([req.protocol, req.client_id, req.timestamp, req.nonce, req.path, req.body])
    crypto.verify(crypto.public_bytes(key), crypto.REQUEST_DOMAIN, payload, req.signature)
    with pytest.raises(SignatureError):
        crypto.verify(crypto.public_bytes(key), crypto.JOB_DOMAIN, payload, req.signature)


# ---- key files ------------------------------------------------------------------------------------------
def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_save_private_key_mode_0600(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    path = tmp_path / "nested" / "dir" / "client.key"
    crypto.save_private_key(key, path)
    assert mode_of(path) == 0o600
    assert path.stat().st_size == 32
    assert not path.with_name("client.key.tmp").exists()
    assert crypto.public_bytes(crypto.load_private_key(path)) == crypto.public_bytes(key)


def test_save_private_key_overwrite_keeps_0600(tmp_path: Path, key: Ed25519PrivateKey,
                                               other_key: Ed25519PrivateKey) -> None:
    path = tmp_path / "client.key"
    crypto.save_private_key(key, path)
    crypto.save_private_key(other_key, path)
    assert mode_of(path) == 0o600
    assert crypto.public_bytes(crypto.load_private_key(path)) == crypto.public_bytes(other_key)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o666, 0o700 | 0o040])
def test_load_refuses_group_or_world_readable(tmp_path: Path, key: Ed25519PrivateKey, mode: int) -> None:
    path = tmp_path / "client.key"
    crypto.save_private_key(key, path)
    path.chmod(mode)
    with pytest.raises(crypto.KeyFileError) as info:
        crypto.load_private_key(path)
    assert "chmod 600" in str(info.value)
    assert str(path) in str(info.value)


def test_load_accepts_owner_only_modes(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    path = tmp_path / "client.key"
    crypto.save_private_key(key, path)
    path.chmod(0o400)
    assert crypto.public_bytes(crypto.load_private_key(path)) == crypto.public_bytes(key)


@pytest.mark.parametrize("size", [0, 31, 33, 64])
def test_load_refuses_wrong_length(tmp_path: Path, size: int) -> None:
    path = tmp_path / "client.key"
    path.write_bytes(b"\x01" * size)
    path.chmod(0o600)
    with pytest.raises(crypto.KeyFileError) as info:
        crypto.load_private_key(path)
    assert "32-byte" in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(crypto.KeyFileError):
        crypto.load_private_key(tmp_path / "absent.key")


def test_load_or_create_creates_once_then_loads(tmp_path: Path) -> None:
    path = tmp_path / "id" / "client.key"
    first, created = crypto.load_or_create_key(path)
    assert created is True
    assert mode_of(path) == 0o600
    second, created_again = crypto.load_or_create_key(path)
    assert created_again is False
    assert crypto.public_bytes(second) == crypto.public_bytes(first)
    # the loaded key signs verifiably under the created key's public half
    crypto.verify(crypto.public_bytes(first), crypto.JOB_DOMAIN, b"x", crypto.sign(second, crypto.JOB_DOMAIN, b"x"))


def test_load_or_create_refuses_insecure_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "client.key"
    crypto.load_or_create_key(path)
    path.chmod(0o644)
    with pytest.raises(crypto.KeyFileError):
        crypto.load_or_create_key(path)
