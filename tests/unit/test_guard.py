"""The trust boundary's state on a real store (SQLite and PostgreSQL): registration gate, rate limits, quarantine, replicas,
and the audit log."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from coordinator.api.guard import Guard
from coordinator.config import CoordinatorConfig
from coordinator.core.jobs import JobPlan
from coordinator.core.replicas import Party
from coordinator.store.store import Store
from shared.errors import ProtocolError, Reason

T0 = 1_000_000.0
A, B = "a" * 32, "b" * 32


def make(target: str | Path, **cfg: object) -> tuple[Guard, Store]:
    store = Store(target)
    for cid in (A, B):
        store.register_client(cid, b"k" * 32, {"backend": "torch", "device": "cpu"}, T0)
    return Guard(CoordinatorConfig.model_validate(cfg), store), store


def refused(reason: Reason, fn: object, *args: object, **kw: object) -> str:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)  # type: ignore[operator]
    assert info.value.reason is reason
    return info.value.message


def test_invite_mode_needs_a_listed_token(store_target: str | Path) -> None:
    token = "let-me-in"
    guard, _ = make(store_target, registration={"mode": "invite", "invite_sha256": [hashlib.sha256(token.encode()).hexdigest()]})
    assert "private" in refused(Reason.REGISTRATION_CLOSED, guard.check_registration, "1.2.3.4", "", T0, True)
    assert "not valid" in refused(Reason.REGISTRATION_CLOSED, guard.check_registration, "1.2.3.4", "nope", T0, True)
    guard.check_registration("1.2.3.4", token, T0, True)


def test_a_hold_covers_a_replica_lease_and_one_reissue() -> None:
    cfg = CoordinatorConfig.model_validate({"jobs": {"lease_timeout_s": 120}})
    assert cfg.trust.hold_for(cfg.jobs.lease_timeout_s) == 300.0  # derived: 2.5 × the lease
    assert CoordinatorConfig.model_validate({"jobs": {"lease_timeout_s": 20}, "trust": {"hold_s": 40}}).trust.hold_s == 40
    with pytest.raises(ValueError, match=r"trust.hold_s \(60\) is shorter .* raise trust.hold_s to at least 240"):
        CoordinatorConfig.model_validate({"jobs": {"lease_timeout_s": 120}, "trust": {"hold_s": 60}})


def test_invite_mode_without_invites_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="invite_sha256 is empty"):
        CoordinatorConfig.model_validate({"registration": {"mode": "invite"}})


def test_registration_flood_is_limited_per_address_but_known_identities_are_not(store_target: str | Path) -> None:
    guard, _ = make(store_target, limits={"registration_burst": 3, "registrations_per_address_per_min": 60})
    for _ in range(3):
        guard.check_registration("10.0.0.1", "", T0, True)
    assert "slow down" in refused(Reason.RATE_LIMITED, guard.check_registration, "10.0.0.1", "", T0, True)
    guard.check_registration("10.0.0.2", "", T0, True)  # another address has its own budget
    guard.check_registration("10.0.0.1", "", T0, False)  # re-registering a known identity: not limited
    guard.check_registration("10.0.0.1", "", T0 + 1.0, True)  # refilled at 1/s


def test_identity_and_address_limits(store_target: str | Path) -> None:
    guard, _ = make(store_target, limits={"per_identity_rps": 1, "per_identity_burst": 2, "per_address_rps": 0})
    guard.check_identity(A, T0)
    guard.check_identity(A, T0)
    refused(Reason.RATE_LIMITED, guard.check_identity, A, T0)
    guard.check_identity(B, T0)
    for _ in range(1000):
        guard.check_address("127.0.0.1", T0)  # rate 0: off


def test_quarantine_is_per_identity(store_target: str | Path) -> None:
    guard, _ = make(store_target, trust={"quarantine_after": 2, "quarantine_s": 50})
    guard.record_invalid(A, T0)
    guard.check_quarantine(A, T0)
    guard.record_invalid(A, T0)  # whatever backend the refused request claimed: the identity's streak
    msg = refused(Reason.QUARANTINED, guard.check_quarantine, A, T0 + 10)
    assert "2 times in a row" in msg and "40s" in msg
    guard.check_quarantine(B, T0 + 10)
    guard.check_quarantine(A, T0 + 50)  # over
    assert sum(r["invalid_total"] for r in guard.standings()) == 2


def test_the_class_is_established_by_the_coordinator_and_pinned(store_target: str | Path) -> None:
    guard, store = make(store_target)
    C = "c" * 32
    for device in ("tpu:v5", "xpu", "gpu"):
        msg = refused(Reason.SCHEMA, guard.class_for_registration, C, "torch", device, True)
        assert "torch on cpu, cuda, mps" in msg and "--device" in msg
    assert guard.class_for_registration(C, "torch", "cuda:RTX 3060", True) == "torch/cuda"
    store.register_client(C, b"k" * 32, {"backend": "torch", "device": "cuda:RTX 3060"}, T0,
                          backend_class="torch/cuda", address="10.0.0.3")
    assert guard.pinned_class(C) == "torch/cuda"
    msg = refused(Reason.SCHEMA, guard.class_for_registration, C, "llama", "cpu", False)
    assert "pinned to backend class torch/cuda" in msg and "new identity" in msg
    assert guard.class_for_registration(C, "torch", "cuda:another name", False) == "torch/cuda"
    # a refresh never changes the pinned class, even if a caller passed another
    store.register_client(C, b"k" * 32, {"backend": "llama", "device": "cpu"}, T0 + 1, backend_class="llama/cpu",
                          address="10.0.0.4")
    assert guard.pinned_class(C) == "torch/cuda"
    assert guard.party(C) == Party(C, frozenset({"10.0.0.3", "10.0.0.4"}), T0)
    assert guard.pinned_class(A) == "torch/cpu"  # registered before classes were pinned: from its profile


def accepted(store: Store, job: str, client: str, now: float = T0) -> None:
    store.create_job(JobPlan(job, int(job[1:]), (0, 1), 7), 2, now)
    assert store.lease_job(job, "L" + job, client, now + 60, 0, now)
    assert store.accept_result(job_id=job, lease_id="L" + job, client_id=client, version=0, content_sha256="c" * 64,
                               payload=b"x", rewards=[1.0, 0.0, 0.0, 1.0], n_tokens=8, credit=8.0, now=now)


def peers(target: str | Path, **cfg: object) -> tuple[Guard, Store, dict[str, str]]:
    """An original's client O and candidate replayers: I (independent), S (same address), U (same burst),
    N (independent but without verified work), L (independent, another class)."""
    store = Store(target)
    ids = {k: k.lower() * 32 for k in "OISUNL"}
    spec = {"O": ("1.1.1.1", T0, "torch/cuda"), "I": ("2.2.2.2", T0 + 600, "torch/cuda"),
            "S": ("1.1.1.1", T0 + 600, "torch/cuda"), "U": ("3.3.3.3", T0 + 5, "torch/cuda"),
            "N": ("4.4.4.4", T0 + 900, "torch/cuda"), "L": ("5.5.5.5", T0 + 900, "llama/cpu")}
    for k, (addr, at, bclass) in spec.items():
        backend, device = bclass.split("/")
        store.register_client(ids[k], b"k" * 32, {"backend": backend, "device": device}, at, backend_class=bclass,
                              address=addr)
    guard = Guard(CoordinatorConfig.model_validate(cfg), store)
    for k in "OISUL":
        for _ in range(3):  # trust.replicator_min_valid
            guard.record_valid(ids[k])
    return guard, store, ids


def test_replicas_go_only_to_independent_established_peers_of_the_class_under_a_fresh_id(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    accepted(store, "j1", ids["O"])
    now = T0 + 1000
    for k in "ISUNL":
        guard.seen(ids[k], now)
    assert guard.peer_available(ids["O"], "torch/cuda", now, 30.0)
    rid = guard.add_replica("j1", 0, ids["O"], "torch/cuda", now, now + 300, "peer")
    assert rid == "j2" and not rid.endswith("-r")  # the next number of the job stream, like any fresh job
    assert store.next_seq() == 3  # and the stream never reuses it
    assert store.pending() == [] and guard.held_count() == 1  # held out of training
    for k in "OSUNL":  # itself, same address, same burst, no verified work, another class: never
        assert guard.lease_replica(ids[k], "R" + k, now + 60, now) is None, k
    rep = guard.lease_replica(ids["I"], "RI", now + 60, now)
    assert rep is not None and rep.replica_id == "j2" and rep.job_id == "j1" and rep.view.lease_client == ids["I"]
    assert guard.close_replica(rep, "RI", ids["I"], "original_invalid", "d" * 64, 8.0, now + 1, True, "mismatch")
    # the invalid original left the buffer, the job reopened, O's credit was revoked, I was credited
    assert store.pending() == [] and store.accepted_result("j1") is None
    assert store.get_job("j1").view.state.value == "open"  # type: ignore[union-attr]
    credits = {c["client_id"]: c["credit"] for c in store.clients()}
    assert credits[ids["O"]] == 0.0 and credits[ids["I"]] == 8.0
    outcomes = [(r["client_id"], r["outcome"], r["reason"]) for r in store.audit(job_id="j1")]
    assert outcomes == [(ids["O"], "invalidated", "replica_mismatch"), (ids["O"], "accepted", "ok")]
    assert store.audit(client_id=ids["I"])[0]["outcome"] == "replica_accepted"


def test_idle_or_dependent_identities_do_not_make_results_wait(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    now = T0 + 1000
    for k in "OSUNL":  # active, but none of them could judge O's result
        guard.seen(ids[k], now)
    assert not guard.peer_available(ids["O"], "torch/cuda", now, 30.0)
    guard.seen(ids["I"], now - 31)  # the independent one, not active within the window
    assert not guard.peer_available(ids["O"], "torch/cuda", now, 30.0)
    guard.seen(ids["I"], now)
    assert guard.peer_available(ids["O"], "torch/cuda", now, 30.0)
    guard.record_invalid(ids["I"], now)  # a failure since: no longer established
    assert not guard.peer_available(ids["O"], "torch/cuda", now, 30.0)


def test_an_inconclusive_replay_keeps_the_hold_and_asks_someone_else(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    accepted(store, "j1", ids["O"])
    now = T0 + 1000
    rid = guard.add_replica("j1", 0, ids["O"], "torch/cuda", now, now + 300, "peer")
    rep = guard.lease_replica(ids["I"], "RI", now + 60, now)
    assert rep is not None
    assert guard.reopen_replica(rep, "RI", ids["I"], "d" * 64, now + 1, "disagrees")
    assert store.pending() == [] and guard.held_count() == 1  # still held
    assert guard.lease_replica(ids["I"], "RI2", now + 60, now + 2) is None  # not the same replayer again
    (row,) = store.audit(client_id=ids["I"])
    assert (row["job_id"], row["outcome"]) == (rid, "replica_inconclusive")


def test_a_held_result_without_a_conclusive_judgement_is_dropped_uncredited(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    accepted(store, "j1", ids["O"])
    accepted(store, "j3", ids["O"])
    now = T0 + 1000
    guard.add_replica("j1", 0, ids["O"], "torch/cuda", now, now + 300, "peer")
    rid3 = guard.add_replica("j3", 0, ids["O"], "torch/cuda", now, now + 300, "arbiter")
    rep = guard.lease_replica(ids["I"], "RI", now + 60, now)  # an accomplice could sit on it: the hold outlasts
    assert rep is not None
    assert guard.expire_replicas(0, now + 299) == 0 and store.pending() == []
    # the arbiter's replay of j3 is still under way: it is not dropped for its time, only j1 is
    assert guard.expire_replicas(0, now + 300, in_progress=frozenset({rid3})) == 1
    assert store.pending() == [] and store.accepted_result("j1") is None  # never trained unverified
    assert store.get_job("j1").view.state.value == "open"  # type: ignore[union-attr]
    (row,) = [r for r in store.audit(job_id="j1") if r["outcome"] != "accepted"]
    assert (row["outcome"], row["reason"]) == ("dropped_unverified", "no_conclusive_check")
    assert {c["client_id"]: c["accepted"] for c in store.clients()}[ids["O"]] == 1  # j3 still counted
    guard.expire_replicas(1, now + 301)  # version 0 pruned: j3 can never be replayed now, dropped too
    assert store.accepted_result("j3") is None and guard.replicas_summary() == {"dropped": 2}


def test_unheld_replicas_expire_unverified_when_their_version_is_pruned(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    accepted(store, "j1", ids["O"])
    guard.add_replica("j1", 0, ids["O"], "torch/cuda", T0, None, "peer")
    assert [p.job_id for p in store.pending()] == ["j1"]  # not held
    guard.expire_replicas(1, T0 + 61)
    assert guard.replicas_summary() == {"unverified": 1} and store.accepted_result("j1") is not None


def test_arbiter_judgement_releases_or_takes_back_the_original(store_target: str | Path) -> None:
    guard, store, ids = peers(store_target)
    accepted(store, "j1", ids["O"])
    accepted(store, "j3", ids["O"])
    r1 = guard.add_replica("j1", 0, ids["O"], "torch/cuda", T0, T0 + 300, "arbiter")
    r3 = guard.add_replica("j3", 0, ids["O"], "torch/cuda", T0, T0 + 300, "arbiter")
    assert {r.replica_id for r in guard.awaiting_arbiter()} == {r1, r3}
    for k in "ISUNL":  # the coordinator's own replicas never leave it
        assert guard.lease_replica(ids[k], "R" + k, T0 + 60, T0) is None
    rep1, rep3 = guard.get_replica(r1), guard.get_replica(r3)
    assert rep1 is not None and rep3 is not None
    assert guard.close_arbitrated(rep1, False, T0 + 1, "agree")
    assert guard.close_arbitrated(rep3, True, T0 + 1, "disagrees")
    assert not guard.close_arbitrated(rep3, True, T0 + 1, "twice")
    assert [p.job_id for p in store.pending()] == ["j1"] and store.accepted_result("j3") is None


def test_audit_records_rejections_with_version_and_hash_and_filters(store_target: str | Path) -> None:
    _, store = make(store_target)
    store.record_rejection(A, "j9", "logprob_mismatch", "made up", "e" * 64, T0, version=3)
    store.record_rejection(B, None, "malformed", "garbage", "f" * 64, T0 + 1)
    (row,) = store.audit(client_id=A)
    assert (row["job_id"], row["version"], row["outcome"], row["reason"], row["content_sha256"]) == \
        ("j9", 3, "rejected", "logprob_mismatch", "e" * 64)
    assert [r["client_id"] for r in store.audit()] == [B, A]
    assert store.audit(reason="malformed", since=T0 + 0.5)[0]["client_id"] == B
    assert store.audit(since=T0 + 5) == []
    json.dumps(store.audit())  # plain values, ready for an admin API
