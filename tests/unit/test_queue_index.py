"""coordinator/core/queue_index.py answers what the job-by-job rules answer, at any time after it was built: on random
queues (leases live, expired, overdue, released, done; replicas; results being verified; versions past the bound;
holders expected back before and after their lease's deadline), the count of jobs holding a slot, the oldest job that
may be reissued, the supply a lease decision weighs and the leases of unknown pace equal a pass over the jobs with
the rules as they were written before the index (occupies_slot, choose_job, supply_before, pacing's rule 3)."""

from __future__ import annotations

import random

import pytest

from coordinator.core.leases import JobState, LeaseView, Replica
from coordinator.core.queue_index import QueueIndex


def occupies(j: LeaseView, now: float, current: int, bound: int) -> bool:
    """core.scheduling.occupies_slot as a pass over one job (its definition before the index)."""
    trainable = j.version is None or current - j.version <= bound
    if j.verifying:
        return trainable
    live = j.state is JobState.LEASED and j.lease_deadline is not None and now < j.lease_deadline
    first = live and (j.due_at is None or now < j.due_at)
    r = j.replica
    second = (r is not None and j.state is not JobState.DONE and now < r.deadline
              and (r.due_at is None or now < r.due_at))
    return (first or second) and trainable


def leasable(j: LeaseView, now: float) -> bool:
    live = j.state is JobState.LEASED and j.lease_deadline is not None and now < j.lease_deadline
    replica = j.state is not JobState.DONE and j.replica is not None and now < j.replica.deadline
    return j.state is not JobState.DONE and not live and not replica and not j.verifying


def random_job(rng: random.Random, k: int, current: int) -> LeaseView:
    state = rng.choice([JobState.OPEN, JobState.LEASED, JobState.LEASED, JobState.LEASED, JobState.DONE])
    leased_at = rng.uniform(0.0, 50.0)
    client = rng.choice(["a", "b", "c", "d", None]) if state is not JobState.OPEN or rng.random() < 0.5 else None
    deadline = leased_at + rng.choice([20.0, 60.0]) if client is not None else None
    pace = rng.choice([None, 1.0, 5.0, 30.0, 80.0])  # 80 s: expected back after a 60 s deadline
    replica = None
    if rng.random() < 0.2:
        r_at = rng.uniform(0.0, 50.0)
        replica = Replica(f"r{k}", "e", r_at + 40.0, current, rng.choice([None, r_at + 10.0]))
    return LeaseView(f"j{k}", state, rng.choice([None, current, current - 1, current - 3, current - 5]),
                     rng.choice([0.0, 1.0, 2.0, float(k)]), f"l{k}" if client else None, client, deadline,
                     due_at=None if pace is None or deadline is None else leased_at + max(5.0, 3 * pace),
                     expected_at=None if pace is None or deadline is None else leased_at + pace,
                     verifying=rng.random() < 0.1, replica=replica, unproven=rng.random() < 0.3)


@pytest.mark.parametrize("seed", range(40))
def test_the_index_answers_what_a_pass_over_the_jobs_answers(seed: int) -> None:
    rng = random.Random(seed)
    current, bound = 10, rng.choice([0, 2, 4])
    jobs = [random_job(rng, k, current) for k in range(rng.randrange(0, 25))]
    paced = {"a", "c"}
    index = QueueIndex(jobs, current, bound, paced)
    for _ in range(40):
        now = rng.choice([rng.uniform(-5.0, 150.0), *(j.lease_deadline or 0.0 for j in jobs[:3])])
        assert index.queued(now) == sum(occupies(j, now, current, bound) for j in jobs)
        withheld = frozenset(rng.sample([j.job_id for j in jobs], min(len(jobs), rng.choice([0, 0, 1, 2]))))
        free = [j for j in jobs if leasable(j, now) and j.job_id not in withheld]
        assert index.oldest_leasable(now, withheld) is (min(free, key=lambda j: j.created_at) if free else None)
        by = now + rng.uniform(-5.0, 60.0)
        assert index.supply_before(now, by) == sum(
            1 for j in jobs if occupies(j, now, current, bound)
            and (j.verifying or j.expected_at is not None and now <= j.expected_at <= by))
        asker = rng.choice(["a", "b", "d", None])
        assert index.exploring(now, asker) == sum(
            1 for j in jobs if j.state is JobState.LEASED and j.lease_deadline is not None and now < j.lease_deadline
            and j.lease_client is not None and j.lease_client not in paced and j.lease_client != asker)


def test_an_empty_queue() -> None:
    index = QueueIndex([], 3, 2)
    assert (index.queued(0.0), index.oldest_leasable(0.0), index.supply_before(0.0, 9.0), index.exploring(0.0)) == \
        (0, None, 0, 0)
