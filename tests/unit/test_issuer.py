"""coordinator/api/issuer.py's index of the waiting clients' paces: whatever happens to the waiting set and to the
paces (waits begun and ended, several requests of one client, declarations, observed results, forgotten
identities, in any order), the counts a decision reads equal core.pacing.faster_count over the waiting set, as the
issuer computed them before it kept the index (a pass over every waiting client per decision)."""

from __future__ import annotations

import random

import pytest

from coordinator.api.issuer import Issuer
from coordinator.core import pacing
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.scheduling import SyncPolicy


def reference_next_in_line(issuer: Issuer, woken: set[str], cid: str) -> bool:
    """next_in_line as a pass over the waiting and woken clients (the issuer's rule before the index); a measured
    client counts only measured ones (issue 37: an unproven client's job is replicated to a measured one)."""
    counted = {c for c in set(issuer.waiters.clients()) | woken if c != cid and (not issuer.proven(cid)
                                                                                   or issuer.proven(c))}
    ahead = (issuer.rank(c) for c in counted)
    return not (len(woken & counted) >= issuer.policy.jobs_per_step
                or pacing.faster_count(issuer.rank(cid), ahead) >= issuer.policy.jobs_per_step)


@pytest.mark.parametrize("seed", range(12))
def test_the_waiting_index_counts_what_a_pass_over_the_waiting_clients_counts(seed: int) -> None:
    rng = random.Random(seed)
    issuer = Issuer(SyncPolicy("async-push-pull", 4, 2), lease_timeout_s=100.0)
    clients = [f"c{i}" for i in range(30)]
    waits: dict[str, int] = {}
    woken: set[str] = set()
    version = 0
    for _ in range(600):
        cid = rng.choice(clients)
        op = rng.randrange(8)
        if op in (0, 1):
            issuer.begin_wait(cid)
            waits[cid] = waits.get(cid, 0) + 1
        elif op == 2 and waits.get(cid):
            issuer.end_wait(cid)
            waits[cid] -= 1
        elif op == 3:  # ties are common: paces from a small set
            issuer.declare(cid, rng.choice([None, 1.0, 2.0, 2.0, 5.0]))
        elif op == 4:  # an accepted result of a lease taken at t = 0
            view = LeaseView("j", JobState.LEASED, 0, 0.0, "l", cid, 100.0)
            issuer.observe(cid, view, rng.choice([1.0, 3.0, 3.0, 8.0]))
        elif op == 5:
            issuer.forget([cid])
        elif op == 6:
            version += 1
            woken = set()
        else:
            expected = reference_next_in_line(issuer, woken, cid)
            assert issuer.next_in_line(cid, version) is expected
            if expected:
                woken.add(cid)
        waiting = {c for c, n in waits.items() if n > 0}
        assert set(issuer.waiters.clients()) == waiting
        for asker in clients[:6]:
            others = (issuer.rank(c) for c in waiting if c != asker)
            speed = issuer.speed_of(asker, [], 0.0)
            assert speed.faster_waiting == pacing.faster_count(issuer.rank(asker), others)
            proven = (issuer.rank(c) for c in waiting if c != asker and issuer.proven(c))
            assert speed.faster_proven_waiting == (pacing.faster_count(issuer.rank(asker), proven)
                                                   if issuer.proven(asker) else 0)
    for cid, n in waits.items():  # every wait ended: the index is empty again
        for _ in range(n):
            issuer.end_wait(cid)
    assert not list(issuer.waiters.clients())
    assert issuer.speed_of("c0", [], 0.0).faster_waiting == 0


def test_ending_a_wait_that_was_never_begun_changes_nothing() -> None:
    issuer = Issuer(SyncPolicy("async-push-pull", 2, 2), lease_timeout_s=100.0)
    issuer.declare("a", 1.0)
    issuer.end_wait("a")
    issuer.begin_wait("a")
    assert issuer.speed_of("b", [], 0.0).faster_waiting == 1  # an unknown pace counts as the slowest
    issuer.declare("c", 0.5)
    assert issuer.speed_of("c", [], 0.0).faster_waiting == 0
    issuer.end_wait("a")
    issuer.end_wait("a")  # once more than begun: nothing left to remove
    assert issuer.speed_of("b", [], 0.0).faster_waiting == 0


def _measured(issuer: Issuer, cid: str, pace: float) -> None:
    issuer.observe(cid, LeaseView("j", JobState.LEASED, 0, 0.0, "l", cid, 100.0), pace)


def test_a_declared_speed_is_believed_no_faster_than_the_fastest_measured_one() -> None:
    """A fresh identity declaring 10⁷ tokens/s (a pace of 10⁻⁷ s) ranks as the fastest measured client does, behind
    it; a declared pace slower than that floor keeps its place among the measured ones."""
    issuer = Issuer(SyncPolicy("async-push-pull", 2, 2), lease_timeout_s=100.0)
    _measured(issuer, "gpu", 2.0)
    _measured(issuer, "laptop", 9.0)
    issuer.declare("sybil", 1e-7)
    issuer.declare("apple", 5.0)
    assert issuer.rank("sybil") == (2.0, 1) and issuer.rank("apple") == (5.0, 1)
    for cid in ("gpu", "laptop", "sybil", "apple"):
        issuer.begin_wait(cid)
    assert issuer.speed_of("sybil", [], 0.0).faster_waiting == 1  # only the measured 2 s client
    assert issuer.speed_of("apple", [], 0.0).faster_waiting == 2  # the gpu, and the sybil at the floor
    assert issuer.speed_of("laptop", [], 0.0).faster_waiting == 3
    _measured(issuer, "gpu2", 1.0)  # a faster measurement lowers the floor: waiting declarations move with it
    assert issuer.rank("sybil") == (1.0, 1)
    assert issuer.speed_of("apple", [], 0.0).faster_waiting == 2  # (gpu2 is not waiting)
    issuer.begin_wait("gpu2")
    assert issuer.speed_of("sybil", [], 0.0).faster_waiting == 1


@pytest.mark.parametrize("seed", range(16))
def test_a_waiting_client_outside_the_candidates_would_be_given_nothing(seed: int) -> None:
    """Issue 32: a wake-up re-checks only Issuer.candidates (the head of rule 1's order). Every other waiting client,
    asked in any order, is refused a slot and a replica — so not waking it changes no decision — and in_window says
    which is which without a pass over the waiting set."""
    rng = random.Random(seed)
    s = rng.choice([0, 1, 2])
    issuer = Issuer(SyncPolicy("sequential-pull" if s == 0 else "async-push-pull", s, 2), lease_timeout_s=100.0)
    clients = [f"c{i}" for i in range(40)]
    for cid in clients:
        if rng.random() < 0.5:
            _measured(issuer, cid, rng.choice([1.0, 2.0, 2.0, 4.0, 30.0]))
        else:
            issuer.declare(cid, rng.choice([None, 0.5, 2.0, 6.0]))
        issuer.begin_wait(cid)
    for t in (0.0, 1.0, 2.0):
        issuer.new_version(t)
    views = [LeaseView(f"j{k}", JobState.LEASED, 2, float(k), f"l{k}", rng.choice(clients), 50.0,
                       unproven=rng.random() < 0.5) for k in range(rng.randrange(0, 2 * (s + 1)))]
    views += [LeaseView(f"o{k}", JobState.OPEN, None, 10.0 + k) for k in range(rng.randrange(0, 2))]
    candidates = issuer.waiters.candidates()
    assert len(candidates) == len(set(candidates)) and set(candidates) <= set(issuer.waiters.clients())
    assert issuer.waiters.window is not None and len(candidates) <= 3 * issuer.waiters.window + 6  # (and equals)
    for cid in clients:
        assert issuer.waiters.in_window(cid) is (cid in candidates)
        if cid not in candidates:
            assert issuer.decide(cid, views, rng.randrange(0, 2), 2.0, 2, rng.choice([-1, 1, 2])) is None
            assert not issuer.next_in_line(cid, 2)
    ranks = [issuer.rank(c) for c in candidates]
    known = [r for r in ranks if r is not None]
    assert known == sorted(known) and ranks == known + [None] * (len(ranks) - len(known))  # served in rule 1's order


def test_without_speed_aware_issuance_every_waiting_client_is_a_candidate() -> None:
    issuer = Issuer(SyncPolicy("async-push-pull", 1, 2), lease_timeout_s=100.0, speed_aware=False)
    for i in range(50):
        issuer.declare(f"c{i}", float(i))
        issuer.begin_wait(f"c{i}")
    assert issuer.waiters.candidates() == [f"c{i}" for i in range(50)] and issuer.waiters.in_window("c49")
