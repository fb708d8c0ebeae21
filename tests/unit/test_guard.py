"""The trust boundary's state on a real SQLite store: registration gate, rate limits, quarantine, replicas,
and the audit log."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.jobs import JobPlan
from coordinator.guard import Guard, replica_id_for
from coordinator.store import Store
from shared.errors import ProtocolError, Reason

T0 = 1_000_000.0
A, B = "a" * 32, "b" * 32


def make(tmp_path: Path, **cfg: object) -> tuple[Guard, Store]:
    store = Store(tmp_path / "db.sqlite")
    for cid in (A, B):
        store.register_client(cid, b"k" * 32, {"backend": "torch", "device": "cpu"}, T0)
    return Guard(CoordinatorConfig.model_validate(cfg), store), store


def refused(reason: Reason, fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)  # type: ignore[operator]
    assert info.value.reason is reason
    return info.value.message


def test_invite_mode_needs_a_listed_token(tmp_path: Path) -> None:
    token = "let-me-in"
    guard, _ = make(tmp_path, registration={"mode": "invite", "invite_sha256": [hashlib.sha256(token.encode()).hexdigest()]})
    assert "private" in refused(Reason.REGISTRATION_CLOSED, guard.check_registration, "1.2.3.4", "", T0, True)
    assert "not valid" in refused(Reason.REGISTRATION_CLOSED, guard.check_registration, "1.2.3.4", "nope", T0, True)
    guard.check_registration("1.2.3.4", token, T0, True)


def test_invite_mode_without_invites_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="invite_sha256 is empty"):
        CoordinatorConfig.model_validate({"registration": {"mode": "invite"}})


def test_registration_flood_is_limited_per_address_but_known_identities_are_not(tmp_path: Path) -> None:
    guard, _ = make(tmp_path, limits={"registration_burst": 3, "registrations_per_address_per_min": 60})
    for _ in range(3):
        guard.check_registration("10.0.0.1", "", T0, True)
    assert "slow down" in refused(Reason.RATE_LIMITED, guard.check_registration, "10.0.0.1", "", T0, True)
    guard.check_registration("10.0.0.2", "", T0, True)  # another address has its own budget
    guard.check_registration("10.0.0.1", "", T0, False)  # re-registering a known identity: not limited
    guard.check_registration("10.0.0.1", "", T0 + 1.0, True)  # refilled at 1/s


def test_identity_and_address_limits(tmp_path: Path) -> None:
    guard, _ = make(tmp_path, limits={"per_identity_rps": 1, "per_identity_burst": 2, "per_address_rps": 0})
    guard.check_identity(A, T0)
    guard.check_identity(A, T0)
    refused(Reason.RATE_LIMITED, guard.check_identity, A, T0)
    guard.check_identity(B, T0)
    for _ in range(1000):
        guard.check_address("127.0.0.1", T0)  # rate 0: off


def test_quarantine_after_repeated_invalid_results_per_backend_class(tmp_path: Path) -> None:
    guard, _ = make(tmp_path, trust={"quarantine_after": 2, "quarantine_s": 50})
    guard.record_invalid(A, "torch/cpu", T0)
    guard.check_quarantine(A, "torch/cpu", T0)
    guard.record_invalid(A, "torch/cpu", T0)
    msg = refused(Reason.QUARANTINED, guard.check_quarantine, A, "torch/cpu", T0 + 10)
    assert "2 times in a row" in msg and "40s" in msg
    guard.check_quarantine(A, "llama/cpu", T0 + 10)  # another backend class is judged on its own
    guard.check_quarantine(B, "torch/cpu", T0 + 10)
    guard.check_quarantine(A, "torch/cpu", T0 + 50)  # over
    assert guard.standings()[0]["invalid_total"] == 2


def test_replica_goes_to_another_client_and_holds_the_original(tmp_path: Path) -> None:
    guard, store = make(tmp_path)
    store.create_job(JobPlan("j1", 0, (0, 1), 7), 2, T0)
    assert store.lease_job("j1", "L1", A, T0 + 60, 0, T0)
    assert store.accept_result(job_id="j1", lease_id="L1", client_id=A, version=0, content_sha256="c" * 64,
                               payload=b"x", rewards=[1.0, 0.0, 0.0, 1.0], n_tokens=8, credit=8.0, now=T0)
    guard.add_replica("j1", 0, A, "torch/cpu", T0, hold=True)
    assert store.pending() == [] and guard.held_count() == 1  # held out of training
    assert guard.lease_replica(A, "R1", T0 + 60, T0) is None  # never to the original's client
    rep = guard.lease_replica(B, "R1", T0 + 60, T0)
    assert rep is not None and rep.replica_id == replica_id_for("j1") == "j1-r" and rep.view.lease_client == B
    assert guard.close_replica(rep, "R1", B, "original_invalid", "d" * 64, 8.0, T0 + 1, True, "mismatch")
    # the invalid original left the buffer, the job reopened, A's credit was revoked, B was credited
    assert store.pending() == [] and store.accepted_result("j1") is None
    assert store.get_job("j1").view.state.value == "open"  # type: ignore[union-attr]
    credits = {c["client_id"]: c["credit"] for c in store.clients()}
    assert credits == {A: 0.0, B: 8.0}
    outcomes = [(r["client_id"], r["outcome"], r["reason"]) for r in store.audit(job_id="j1")]
    assert outcomes == [(A, "invalidated", "replica_mismatch"), (A, "accepted", "ok")]
    assert store.audit(client_id=B)[0]["outcome"] == "replica_accepted"


def test_hold_lapses_and_unverifiable_replicas_expire(tmp_path: Path) -> None:
    guard, store = make(tmp_path)
    store.create_job(JobPlan("j1", 0, (0,), 7), 2, T0)
    store.lease_job("j1", "L1", A, T0 + 60, 0, T0)
    store.accept_result(job_id="j1", lease_id="L1", client_id=A, version=0, content_sha256="c" * 64, payload=b"x",
                        rewards=[1.0, 0.0], n_tokens=4, credit=4.0, now=T0)
    guard.add_replica("j1", 0, A, "torch/cpu", T0, hold=True)
    assert guard.expire_replicas(0, T0 + 10, hold_s=60) == 0 and store.pending() == []
    assert guard.expire_replicas(0, T0 + 60, hold_s=60) == 1 and [p.job_id for p in store.pending()] == ["j1"]
    guard.expire_replicas(1, T0 + 61, hold_s=60)  # version 0 pruned: nobody can replay it any more
    assert guard.replicas_summary() == {"unverified": 1}


def test_audit_records_rejections_with_version_and_hash_and_filters(tmp_path: Path) -> None:
    _, store = make(tmp_path)
    store.record_rejection(A, "j9", "logprob_mismatch", "made up", "e" * 64, T0, version=3)
    store.record_rejection(B, None, "malformed", "garbage", "f" * 64, T0 + 1)
    (row,) = store.audit(client_id=A)
    assert (row["job_id"], row["version"], row["outcome"], row["reason"], row["content_sha256"]) == \
        ("j9", 3, "rejected", "logprob_mismatch", "e" * 64)
    assert [r["client_id"] for r in store.audit()] == [B, A]
    assert store.audit(reason="malformed", since=T0 + 0.5)[0]["client_id"] == B
    assert store.audit(since=T0 + 5) == []
    json.dumps(store.audit())  # plain values, ready for an admin API
