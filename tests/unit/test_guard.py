"""The trust boundary's state on a real store (SQLite and PostgreSQL): registration gate, rate limits, quarantine,
the pinned class and the audit log."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from coordinator.api.guard import Guard
from coordinator.config import CoordinatorConfig
from coordinator.core.jobs import JobPlan
from coordinator.core.reporting import Sample, dropped_bias
from coordinator.store.records import as_json
from coordinator.store.store import Store
from shared.errors import ProtocolError, Reason

T0 = 1_000_000.0
A, B = "a" * 32, "b" * 32


def make(target: str | Path, **cfg: object) -> tuple[Guard, Store]:
    store = Store(target)
    for cid in (A, B):
        store.clients.register(cid, b"k" * 32, {"backend": "torch", "device": "cpu"}, T0)
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
    assert sum(r.invalid_total for r in guard.standings()) == 2


def test_the_class_is_established_by_the_coordinator_and_pinned(store_target: str | Path) -> None:
    guard, store = make(store_target)
    C = "c" * 32
    for device in ("tpu:v5", "xpu", "gpu"):
        msg = refused(Reason.SCHEMA, guard.class_for_registration, C, "torch", device, True)
        assert "torch on cpu, cuda, mps" in msg and "--device" in msg
    assert guard.class_for_registration(C, "torch", "cuda:RTX 3060", True) == "torch/cuda"
    store.clients.register(C, b"k" * 32, {"backend": "torch", "device": "cuda:RTX 3060"}, T0,
                           backend_class="torch/cuda", address="10.0.0.3")
    assert guard.pinned_class(C) == "torch/cuda"
    msg = refused(Reason.SCHEMA, guard.class_for_registration, C, "llama", "cpu", False)
    assert "pinned to backend class torch/cuda" in msg and "new identity" in msg
    assert guard.class_for_registration(C, "torch", "cuda:another name", False) == "torch/cuda"
    # a refresh never changes the pinned class, even if a caller passed another
    store.clients.register(C, b"k" * 32, {"backend": "llama", "device": "cpu"}, T0 + 1, backend_class="llama/cpu",
                           address="10.0.0.4")
    assert guard.pinned_class(C) == "torch/cuda"
    row = store.clients.get(C)
    assert row is not None and (row["address"], row["last_address"]) == ("10.0.0.3", "10.0.0.4")
    assert guard.pinned_class(A) == "torch/cpu"  # registered before classes were pinned: from its profile


def test_an_accepted_result_raises_trust_and_clears_the_failure_streak(store_target: str | Path) -> None:
    """Every accepted result is conclusive now (each token checked against the keyed sampler): it counts as valid
    evidence, so refusals far apart never add up to a quarantine."""
    guard, _ = make(store_target, trust={"quarantine_after": 2, "quarantine_s": 50})
    guard.record_invalid(A, T0)
    assert guard.trust(A).consecutive_invalid == 1
    guard.record_valid(A)
    assert (guard.trust(A).consecutive_valid, guard.trust(A).consecutive_invalid) == (1, 0)
    guard.record_invalid(A, T0 + 1)
    guard.check_quarantine(A, T0 + 1)  # one failure since the last valid result: not quarantined


def _reported(store: Store, client: str, version: int, rewards: list[float], now: float) -> None:
    """One accepted result of ``client`` at ``version`` with these per-completion rewards."""
    seq = store.jobs.next_seq()
    store.jobs.create(JobPlan(f"j{seq}", seq, (0, 1), 7), 2, now)
    assert store.jobs.lease(f"j{seq}", f"L{seq}", client, now + 60, version, now)
    assert store.results.accept(job_id=f"j{seq}", lease_id=f"L{seq}", client_id=client, version=version,
                                content_sha256="c" * 64, payload=b"x", rewards=rewards, n_tokens=8, credit=8.0,
                                now=now)


def _abandoned(store: Store, client: str, n: int, now: float) -> None:
    for _ in range(n):
        seq = store.jobs.next_seq()
        store.jobs.create(JobPlan(f"j{seq}", seq, (0, 1), 7), 2, now)
        assert store.jobs.lease(f"j{seq}", f"L{seq}", client, now + 60, 0, now)
        assert store.jobs.release(f"j{seq}", f"L{seq}", client)


def test_selective_reporting_lowers_trust_once_per_cooldown(store_target: str | Path) -> None:
    """B returns only its well-scored results (and abandons the rest); A returns everything. The rule, applied
    after B's accepted results with the clock passed in, lowers B's trust with an audit line saying why, once
    per cooldown, and quarantines it once that happens quarantine_after times — whatever accepted results came
    between (each is part of the pattern); A is never touched."""
    guard, store = make(store_target, trust={"quarantine_after": 2, "quarantine_s": 50, "reporting_min_leases": 20,
                                             "reporting_min_results": 10, "reporting_cooldown_s": 100})
    for v in range(10):
        for _ in range(3):
            _reported(store, A, v, [1.0, 0.0, 0.0, 0.0], T0)  # A: reward 0.25, as everyone's expectation
        _reported(store, B, v, [1.0, 1.0, 0.0, 1.0], T0)  # B: only the ones that scored well
    assert guard.check_reporting(B, T0) is None  # no lease abandoned yet: the rewards are not even compared
    _abandoned(store, B, 12, T0)  # 12 of 22 leases without a result
    guard.record_valid(B)
    why = guard.check_reporting(B, T0 + 1)
    assert why is not None and "12 of 22 leases" in why
    assert (guard.trust(B).consecutive_valid, guard.trust(B).quarantines) == (0, 0)  # the valid streak reset
    (row,) = store.audit.lines(client_id=B, outcome="flagged")
    assert (row.reason, row.detail) == ("selective_reporting", why)
    assert guard.check_reporting(B, T0 + 50) is None  # within the cooldown: the same evidence counts once
    for _ in range(5):
        guard.record_valid(B)  # accepted results in between do not clear the flags
    assert guard.check_reporting(B, T0 + 101) is not None  # the next period: quarantined (quarantine_after = 2)
    assert "in a row" in refused(Reason.QUARANTINED, guard.check_quarantine, B, T0 + 102)
    assert guard.check_reporting(A, T0 + 200) is None and guard.trust(A).consecutive_invalid == 0
    rep = guard.reporting(B)
    assert (rep.leased, rep.unreturned, rep.bias.results) == (22, 12, 10) and rep.bias.excess == pytest.approx(0.5)


def test_selective_reporting_in_a_small_run_is_seen_in_what_the_dropped_jobs_scored(store_target: str | Path
                                                                                    ) -> None:
    """One job per version and two clients: no version ever has 3 other results, so the comparison with the other
    volunteers at the same versions never applies. B keeps only the jobs that score at least 0.5 and releases the
    rest; A takes each released job next, at the same version (reissued with its key there: the very sample B saw)
    and returns it. The store's drops let the rule compare B's returned rewards with its dropped jobs' as A
    returned them: B is flagged for that, A (which dropped nothing) is not; B dropping the same share at random
    is not flagged."""
    guard, store = make(store_target, trust={"reporting_min_leases": 20, "reporting_min_results": 10})
    rng = random.Random(5)
    for v in range(60):
        rewards = [float(rng.random() < 0.4) for _ in range(4)]
        selective_b = v < 40  # the first 40 versions B drops by reward; the last 20 it would drop at random
        drop = sum(rewards) / 4 < 0.5 if selective_b else rng.random() < 0.5
        seq = store.jobs.next_seq()
        store.jobs.create(JobPlan(f"j{seq}", seq, (0, 1), 7), 2, T0)
        holder, lease_id = B, f"L{seq}"
        assert store.jobs.lease(f"j{seq}", lease_id, B, T0 + 60, v, T0)
        if drop:
            assert store.jobs.release(f"j{seq}", lease_id, B)
            holder, lease_id = A, f"L{seq}b"
            assert store.jobs.lease(f"j{seq}", lease_id, A, T0 + 60, v, T0)
        assert store.results.accept(job_id=f"j{seq}", lease_id=lease_id, client_id=holder, version=v,
                                    content_sha256=f"{seq:064x}", payload=b"x", rewards=rewards, n_tokens=8,
                                    credit=8.0, now=T0)
        if v == 39:
            rep = guard.reporting(B)
            assert rep.bias.results == 0  # never 3 other results at a version: the first comparison is silent
            assert min(rep.dropped.returned, rep.dropped.dropped) >= 10 and rep.dropped.z > 6, rep.dropped
            why = guard.check_reporting(B, T0 + 1)
            assert why is not None and "jobs dropped" in why, why
            assert guard.check_reporting(A, T0 + 1) is None
            (row,) = store.audit.lines(client_id=B, outcome="flagged")
            assert row.reason == "selective_reporting"
    # the same drops at random (B's last 20 versions, on their own): nothing to see
    returned = [r for r in store.conn.execute("SELECT client_id, version, mean_reward FROM results WHERE "
                                              "version >= 40").fetchall()]
    kept = [float(r[2]) for r in returned if r[0] == B]
    lost = [float(r[2]) for r in returned if r[0] == A]
    at_random = dropped_bias(Sample(len(kept), sum(kept), sum(x * x for x in kept)),
                             Sample(len(lost), sum(lost), sum(x * x for x in lost)))
    assert abs(at_random.z) < 3, at_random


def test_audit_records_rejections_with_version_and_hash_and_filters(store_target: str | Path) -> None:
    _, store = make(store_target)
    store.results.record_rejection(A, "j9", "logprob_mismatch", "made up", "e" * 64, T0, version=3)
    store.results.record_rejection(B, None, "malformed", "garbage", "f" * 64, T0 + 1)
    (row,) = store.audit.lines(client_id=A)
    assert (row.job_id, row.version, row.outcome, row.reason, row.content_sha256) == \
        ("j9", 3, "rejected", "logprob_mismatch", "e" * 64)
    assert [r.client_id for r in store.audit.lines()] == [B, A]
    assert store.audit.lines(reason="malformed", since=T0 + 0.5)[0].client_id == B
    assert store.audit.lines(since=T0 + 5) == []
    json.dumps([as_json(r) for r in store.audit.lines()])  # plain values, ready for an admin API
