"""Durability without holding the write lock through an fsync (coordinator.store.db, durability): SQLite commits reach
the WAL unsynced, and the API fsyncs it after the commit and before the reply that tells a client about it.
A lease, whose state can be re-created, never waits for an fsync. Real coordinator on loopback, real SQLite;
``os.fsync`` is wrapped to record which files were flushed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from shared import wire
from shared.messages import ReleaseRequest, SubmitResponse
from tests.integration.conftest import LiveCoordinator
from tests.integration.ops_helpers import honest_result, lease, register


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the files the API's durability flush fsynced (its "api-sync" thread), in order. Other fsyncs of the
    process — the in-process learner's own sync after publishing, a previous test's leftovers — are not the reply
    path's and are not counted."""
    seen: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        if threading.current_thread().name.startswith("api-sync"):
            try:
                seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
            except OSError:
                seen.append("?")
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def test_an_accepted_result_is_fsynced_before_its_reply_and_a_lease_is_not(live_coordinator: LiveCoordinator,
                                                                           fsyncs: list[str]) -> None:
    live = live_coordinator
    client = register(live)
    job = lease(client, live.coordinator.public_key)
    result = honest_result(live, job)
    fsyncs.clear()
    other = lease(client, live.coordinator.public_key)  # no fsync on a lease's path, nor a release's
    status, _ = client.post("/v1/release", ReleaseRequest(job_id=other.job_id, lease_id=other.lease_id))
    assert status == 200
    assert "coordinator.sqlite-wal" not in fsyncs and "coordinator.sqlite" not in fsyncs, fsyncs

    status, raw = client.post("/v1/results", result)
    assert status == 200, raw
    assert wire.decode(raw, SubmitResponse).accepted
    # the reply came after the WAL holding the accepted result was flushed to disk
    assert "coordinator.sqlite-wal" in fsyncs, fsyncs
