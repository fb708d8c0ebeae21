"""The jobs not yet done, indexed by what a lease decision asks of them (pure, no I/O).

A lease decision (core.scheduling.decide_slot) asks the queue four things at a time ``now``: how many jobs hold a slot
(core.scheduling.occupies_slot), the oldest job that may be reissued (core.leases.choose_job), how many leases in
flight are expected back within a window (core.scheduling.supply_before, pacing's rule 4) and how many live leases
have holders of unknown pace (rule 3). Read job by job, each answer costs the queue's length, B·(S+1): 130 jobs at
S = 64 and B = 2, and every waiting client's re-check pays it again for the same jobs.

Each of these is a threshold in time per job — a job holds its slot until :func:`slot_end`, may be reissued from
:func:`core.leases.leasable_from`, is expected back at its ``expected_at`` — so sorting the jobs once by those times
makes every answer a binary search at whatever ``now`` it is asked, valid until the jobs themselves change. The
coordinator's issuer builds one per set of jobs it sees and asks it for as many decisions as come before that set
changes (coordinator.api.issuer). A slot's end and a job's first leasable time are the rules themselves
(core.scheduling.occupies_slot and core.leases.leasable read them); tests/unit/test_queue_index.py checks every
answer against the job-by-job rules as written before the index, on random queues.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Container, Sequence

from coordinator.core.leases import JobState, LeaseView, choose_job, leasable_from, lease_live


def slot_end(job: LeaseView, current: int, bound: int) -> float:
    """Until when ``job`` holds a queue slot while the policy is at ``current`` (core.scheduling.occupies_slot: its
    result still trainable within ``bound`` and a lease of it live and not overdue, or its result being verified);
    -inf when it holds none at any time."""
    if job.version is not None and current - job.version > bound:
        return -math.inf
    if job.verifying:
        return math.inf
    first = min(job.lease_deadline, job.due_at if job.due_at is not None else math.inf) \
        if job.state is JobState.LEASED and job.lease_deadline is not None else -math.inf
    r = job.replica
    second = min(r.deadline, r.due_at if r.due_at is not None else math.inf) \
        if r is not None and job.state is not JobState.DONE else -math.inf
    return max(first, second)


class QueueIndex:
    """The jobs not yet done (``jobs``, in creation order) at policy version ``current`` under staleness bound
    ``bound``, sorted by the times at which each one's answers change. ``paced``: the clients whose pace is known
    (rule 3 counts the live leases of the others)."""

    def __init__(self, jobs: Sequence[LeaseView], current: int, bound: int, paced: Container[str] = ()) -> None:
        self.jobs = jobs
        self.paced = paced
        self.current = current
        self.bound = bound
        ends = [slot_end(j, current, bound) for j in jobs]
        self._ends = sorted(e for e in ends if e > -math.inf)
        # choose_job at any time: by the time each job becomes leasable, the oldest one among those leasable by then
        order = sorted(range(len(jobs)), key=lambda i: leasable_from(jobs[i]))
        self._free_from = [leasable_from(jobs[i]) for i in order]
        self._oldest: list[int] = []
        for i in order:
            best = self._oldest[-1] if self._oldest else None
            key = (jobs[i].created_at, i)
            self._oldest.append(i if best is None or key < (jobs[best].created_at, best) else best)
        # rule 4's supply: leases expected back while they still hold their slot, by when; the few whose expected
        # time is past their slot's end (a pace beyond the lease's deadline) are checked one by one
        self._verifying = sum(1 for j, e in zip(jobs, ends, strict=True) if j.verifying and e > -math.inf)
        self._expected = sorted(j.expected_at for j, e in zip(jobs, ends, strict=True)
                                if not j.verifying and j.expected_at is not None and j.expected_at < e)
        self._late = [(j.expected_at, e) for j, e in zip(jobs, ends, strict=True)
                      if not j.verifying and j.expected_at is not None and e > -math.inf and j.expected_at >= e]
        # rule 3: the deadlines of the leases of holders of unknown pace, all and per holder
        self._unpaced: list[float] = []
        self._unpaced_of: dict[str, list[float]] = {}
        for j in jobs:
            if lease_live(j, -math.inf) and j.lease_client is not None and j.lease_client not in paced:
                self._unpaced.append(j.lease_deadline)  # type: ignore[arg-type]  # lease_live: not None
                self._unpaced_of.setdefault(j.lease_client, []).append(j.lease_deadline)  # type: ignore[arg-type]
        self._unpaced.sort()
        for deadlines in self._unpaced_of.values():
            deadlines.sort()
        self.unproven = [j for j in jobs if j.unproven]  # the jobs a replica may go to (core.scheduling.choose_replica)

    def queued(self, now: float) -> int:
        """How many jobs hold a slot at ``now`` (core.scheduling.occupies_slot)."""
        return len(self._ends) - bisect.bisect_right(self._ends, now)

    def oldest_leasable(self, now: float, withheld: frozenset[str] = frozenset()) -> LeaseView | None:
        """core.leases.choose_job at ``now`` over the jobs not in ``withheld`` (those are rare: a client refused a
        result of them; then job by job)."""
        if withheld:
            return choose_job([j for j in self.jobs if j.job_id not in withheld], now)
        k = bisect.bisect_right(self._free_from, now)
        return self.jobs[self._oldest[k - 1]] if k else None

    def supply_before(self, now: float, by: float) -> int:
        """The leases in flight that hold a slot at ``now`` and whose holders are expected back by ``by``, and the
        results being verified (core.scheduling.supply_before, without the untrained results)."""
        counted = bisect.bisect_right(self._expected, by) - bisect.bisect_left(self._expected, now) if by >= now else 0
        return self._verifying + counted + sum(1 for x, end in self._late if now < end and now <= x <= by)

    def exploring(self, now: float, asker: str | None = None) -> int:
        """Live leases at ``now`` held by clients of unknown pace other than ``asker`` (pacing's rule 3)."""
        own = self._unpaced_of.get(asker, []) if asker is not None else []
        return (len(self._unpaced) - bisect.bisect_right(self._unpaced, now)) - (len(own) - bisect.bisect_right(own, now))
