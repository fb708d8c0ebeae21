"""The replica rule (coordinator.core.scheduling.choose_replica, issue 37): a measured client refused a slot gets a
second lease on a job an unproven client holds — never on a measured client's, never a second one per job — and with
no unproven lease live every decision is what it was without the rule."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from coordinator.api.issuer import Issuer
from coordinator.core.leases import (
    JobState,
    LeaseView,
    Replica,
    held_by,
    holds_lease,
    kept_versions,
    leasable,
)
from coordinator.core.pacing import ClientSpeed
from coordinator.core.scheduling import (
    LeaseDecision,
    SyncPolicy,
    choose_replica,
    decide_lease,
    decide_slot,
    occupies_slot,
)

SEQ = SyncPolicy("sequential-pull", 0, 2)
ASYNC = SyncPolicy("async-push-pull", 2, 2)
NOW = 100.0
MEASURED = ClientSpeed(pace_s=2.0, step_s=1.0, proven=True)


def leased(job_id: str, client: str, *, unproven: bool = False, version: int = 5, due: float | None = NOW + 5,
           created: float = 0.0, replica: Replica | None = None) -> LeaseView:
    return LeaseView(job_id, JobState.LEASED, version, created, f"L-{job_id}", client, NOW + 300, due, None,
                     replica=replica, unproven=unproven)


def full(unproven_first: bool = True) -> list[LeaseView]:
    """Sequential pull's B = 2 slots of version 5, both held."""
    return [leased("j0", "sybil", unproven=unproven_first), leased("j1", "honest", created=1.0)]


def test_a_measured_client_refused_a_slot_gets_a_replica_of_the_unproven_clients_job() -> None:
    jobs = full()
    assert decide_slot(jobs, 0, NOW, 5, 5, SEQ, MEASURED) is None  # the queue is full
    assert decide_lease(jobs, 0, NOW, 5, 5, SEQ, MEASURED, asker="me") == LeaseDecision("j0", 5, replica=True)


def test_never_a_replica_of_a_measured_clients_job() -> None:
    assert decide_lease(full(unproven_first=False), 0, NOW, 5, 5, SEQ, MEASURED, asker="me") is None


def test_never_a_second_replica() -> None:
    jobs = full()
    jobs[0] = replace(jobs[0], replica=Replica("R", "other", NOW + 200, 5))
    assert decide_lease(jobs, 0, NOW, 5, 5, SEQ, MEASURED, asker="me") is None
    # …until that replica has ended (released, or run out)
    jobs[0] = replace(jobs[0], replica=Replica("R", "other", NOW - 1, 5))
    assert decide_lease(jobs, 0, NOW, 5, 5, SEQ, MEASURED, asker="me") == LeaseDecision("j0", 5, replica=True)


def test_only_a_measured_client_gets_one_and_never_of_its_own_job() -> None:
    declared = ClientSpeed(pace_s=1e-7, step_s=1.0, proven=False)
    assert decide_lease(full(), 0, NOW, 5, 5, SEQ, declared, asker="me") is None
    assert decide_lease(full(), 0, NOW, 5, 5, SEQ, ClientSpeed(), asker="me") is None  # unknown pace
    assert decide_lease(full(), 0, NOW, 5, 5, SEQ, MEASURED, asker="sybil") is None
    assert decide_lease(full(), 0, NOW, 5, 5, SEQ, None, asker="me") is None  # not speed-aware: no rule 1–4, no replica


def test_the_replica_holder_must_be_expected_back_before_the_first_lease_is_overdue() -> None:
    slow = replace(MEASURED, pace_s=6.0)  # due at NOW + 5
    assert decide_lease(full(), 0, NOW, 5, 5, SEQ, slow, asker="me") is None
    # an unproven lease that no longer holds a slot (overdue) is not replicated: its slot went back to the queue
    overdue = [replace(full()[0], due_at=NOW - 1), full()[1]]
    assert choose_replica(overdue, NOW, 5, SEQ, MEASURED, "me") is None


def test_faster_measured_waiters_come_first() -> None:
    assert choose_replica(full(), NOW, 5, SEQ, replace(MEASURED, faster_proven_waiting=1), "me") is None
    jobs = [leased("j0", "s0", unproven=True), leased("j1", "s1", unproven=True, created=1.0)]
    assert choose_replica(jobs, NOW, 5, SEQ, replace(MEASURED, faster_proven_waiting=1), "me") == jobs[0]


def test_async_horizon_applies_to_a_replica() -> None:
    jobs = [leased(f"j{k}", "sybil" if k == 0 else f"h{k}", unproven=k == 0, version=3, created=float(k))
            for k in range(6)]
    assert decide_slot(jobs, 0, NOW, 5, 5, ASYNC, MEASURED) is None
    assert decide_lease(jobs, 0, NOW, 5, 5, ASYNC, MEASURED, asker="me") is None  # v3 at current 5: 0 left, 2 s pace
    fast = replace(MEASURED, pace_s=0.4)
    assert decide_lease(jobs, 0, NOW, 5, 5, ASYNC, fast, asker="me") == LeaseDecision("j0", 3, replica=True)


def test_a_replica_keeps_the_jobs_slot_past_the_first_leases_due_time() -> None:
    job = replace(full()[0], due_at=NOW - 1, replica=Replica("R", "me", NOW + 300, 5, due_at=NOW + 4))
    assert occupies_slot(job, NOW, 5, SEQ)  # so no (B + 1)-th job of the version is planned
    gone = Replica("R", "me", NOW + 300, 5, due_at=NOW - 0.5)  # its holder overdue too
    assert not occupies_slot(replace(job, replica=gone), NOW, 5, SEQ)
    assert not leasable(replace(job, lease_deadline=NOW - 1), NOW)  # not reissued while its replica runs
    assert kept_versions(9, 1, [replace(job, version=2, replica=Replica("R", "me", NOW + 1, 2))], NOW) == {2, 9}


def test_held_by_shows_the_replica_holder_its_own_lease() -> None:
    job = replace(full()[0], replica=Replica("R", "me", NOW + 7, 5))
    mine = held_by(job, "me", "R")
    assert (mine.lease_client, mine.lease_id, mine.lease_deadline, mine.replica) == ("me", "R", NOW + 7, None)
    assert held_by(job, "me", "L-j0") is job and held_by(job, "sybil", "L-j0") is job
    assert holds_lease(job, "me", "R") and holds_lease(job, "sybil", "L-j0") and not holds_lease(job, "me", "L-j0")


@pytest.mark.parametrize("policy", [SEQ, ASYNC, SyncPolicy("async-push-pull", 1, 3)])
def test_nothing_changes_without_unproven_leases(policy: SyncPolicy) -> None:
    rng = random.Random(7)
    for _ in range(2000):
        current = rng.randint(0, 6)
        jobs = []
        for k in range(rng.randint(0, 8)):
            state = rng.choice([JobState.LEASED, JobState.LEASED, JobState.OPEN])
            version = rng.randint(max(0, current - 3), current)
            deadline = NOW + rng.choice([-5.0, 50.0])
            jobs.append(LeaseView(f"j{k}", state, version, float(k), f"L{k}", f"c{k}", deadline,
                                  rng.choice([None, NOW - 1, NOW + 3]), rng.choice([None, NOW + 1, NOW - 2])))
        speed = rng.choice([None, ClientSpeed(pace_s=rng.choice([None, 0.5, 3.0]), faster_waiting=rng.randint(0, 3),
                                              step_s=rng.choice([None, 1.0]), proven=rng.random() < 0.7)])
        args = (jobs, rng.randint(0, 4), NOW, current, rng.randint(-1, current), policy, speed)
        assert decide_lease(*args, asker="me") == decide_slot(*args)


def test_the_issuer_gives_a_measured_client_a_replica_of_a_claimed_speeds_job() -> None:
    issuer = Issuer(SEQ, lease_timeout_s=300.0)
    issuer.declare("sybil", 1e-7)  # 10^7 tokens/s, claimed
    issuer.observe("honest", leased("jx", "honest", due=None), NOW - 300 + 2.0)  # one result, 2 s after its lease
    issuer.new_version(NOW - 10)
    issuer.new_version(NOW - 9)
    jobs = [replace(leased("j0", "sybil", due=None), lease_deadline=NOW + 299.5),
            replace(leased("j1", "other", due=None, created=1.0), lease_deadline=NOW + 299.0)]
    assert issuer.decide("honest", jobs, 0, NOW, 5, 5) == LeaseDecision("j0", 5, replica=True)
    assert issuer.decide("sybil2", jobs, 0, NOW, 5, 5) is None  # a claim never gets one
    issuer.declare("sybil2", 1e-7)
    assert issuer.decide("sybil2", jobs, 0, NOW, 5, 5) is None
