from __future__ import annotations

import hashlib
from pathlib import Path

from shared.hashing import prompt_hash, sha256_bytes, sha256_file


def test_sha256_helpers(tmp_path: Path) -> None:
    assert sha256_bytes(b"abc") == hashlib.sha256(b"abc").hexdigest()
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)
    assert sha256_file(path) == hashlib.sha256(b"x" * 100_000).hexdigest()


def test_prompt_hash_stable() -> None:
    prompts = [[1, 2, 3], [4, 5]]
    h = prompt_hash(prompts)
    assert h == prompt_hash([[1, 2, 3], [4, 5]])
    assert h == prompt_hash(((1, 2, 3), (4, 5)))  # sequence type does not matter
    assert len(h) == 64 and all(c in "0123456789abcdef" for c in h)


def test_prompt_hash_known_value() -> None:
    # sha256 of msgpack [[1, 2]] = 0x91 0x92 0x01 0x02; pins the canonical encoding across versions
    assert prompt_hash([[1, 2]]) == hashlib.sha256(b"\x91\x92\x01\x02").hexdigest()


def test_prompt_hash_sensitive_to_order() -> None:
    assert prompt_hash([[1, 2], [3]]) != prompt_hash([[3], [1, 2]])
    assert prompt_hash([[1, 2]]) != prompt_hash([[2, 1]])


def test_prompt_hash_sensitive_to_content_and_boundaries() -> None:
    base = prompt_hash([[1, 2], [3]])
    assert base != prompt_hash([[1, 2], [4]])
    assert base != prompt_hash([[1], [2, 3]])  # same flat tokens, different prompt boundaries
    assert base != prompt_hash([[1, 2, 3]])
    assert base != prompt_hash([[1, 2], [3], []])
    assert prompt_hash([]) != prompt_hash([[]])
