"""Hardware and self-benchmark fields at registration: optional (old clients stay valid), bounded, and kept by
the coordinator's store in their own column for the scheduler."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from coordinator.store.store import Store
from shared import wire
from shared.errors import ProtocolError
from shared.messages import ClientProfile

from .factories import profile

NEW_FIELDS = ("gpu", "gpu_memory_gb", "disk_free_gb", "benchmark_tokens_per_s")


def test_a_profile_from_an_older_client_without_the_new_fields_decodes() -> None:
    obj = wire.unpack(wire.encode(profile()))
    for k in NEW_FIELDS:
        del obj[k]
    decoded = wire.decode(wire.pack(obj), ClientProfile)
    assert all(getattr(decoded, k) is None for k in NEW_FIELDS)


def test_new_fields_round_trip() -> None:
    p = profile(gpu="NVIDIA H200", gpu_memory_gb=140.4, disk_free_gb=71.3, benchmark_tokens_per_s=747.1)
    assert wire.decode(wire.encode(p), ClientProfile) == p


@pytest.mark.parametrize(("field", "value"), [
    ("benchmark_tokens_per_s", -1.0), ("benchmark_tokens_per_s", 1e9), ("benchmark_tokens_per_s", float("nan")),
    ("benchmark_tokens_per_s", "fast"), ("gpu_memory_gb", float("inf")), ("disk_free_gb", -0.5), ("gpu", "x" * 129),
])
def test_out_of_bounds_values_are_refused(field: str, value: object) -> None:
    obj = wire.unpack(wire.encode(profile())) | {field: value}
    with pytest.raises(ProtocolError):
        wire.decode(wire.pack(obj), ClientProfile)


def test_store_keeps_the_benchmark_in_its_own_column_and_updates_it(store_target: str | Path) -> None:
    store = Store(store_target)
    cid = "c" * 32
    assert store.clients.register(cid, b"k" * 32, profile(benchmark_tokens_per_s=12.5).model_dump(), 1.0)
    assert store.clients.get(cid)["benchmark_tokens_per_s"] == 12.5
    assert not store.clients.register(cid, b"k" * 32, profile(benchmark_tokens_per_s=30.0).model_dump(), 2.0)
    (row,) = store.clients.all()
    assert row.benchmark_tokens_per_s == 30.0 and row.profile["benchmark_tokens_per_s"] == 30.0
    store.clients.register("d" * 32, b"j" * 32, profile().model_dump(), 3.0)  # no benchmark reported
    assert store.clients.get("d" * 32)["benchmark_tokens_per_s"] is None
    store.close()


def test_a_database_created_before_the_column_gains_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE clients(client_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, profile TEXT NOT NULL, "
                 "registered_at REAL NOT NULL, last_seen REAL NOT NULL, accepted INTEGER NOT NULL DEFAULT 0, "
                 "rejected INTEGER NOT NULL DEFAULT 0, credit REAL NOT NULL DEFAULT 0, banned INTEGER NOT NULL "
                 "DEFAULT 0)")
    conn.execute("INSERT INTO clients VALUES(?,?,?,?,?,0,0,0,0)", ("e" * 32, b"k", "{}", 1.0, 1.0))
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.clients.get("e" * 32)["benchmark_tokens_per_s"] is None
    store.clients.register("e" * 32, b"k", profile(benchmark_tokens_per_s=5.0).model_dump(), 2.0)
    assert store.clients.get("e" * 32)["benchmark_tokens_per_s"] == 5.0
    store.close()
