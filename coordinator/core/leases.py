"""Job leases: who may work on a job, until when, and when it goes back into the pool.

A job is *open* (never leased, or its lease was released or expired), *leased* (one client, one lease id,
a deadline), or *done* (a result was accepted; never leased again). An expired lease is not an error: the
job is simply leasable again, and the old lease id stops being accepted.

A job leased to a client whose pace is not measured yet (*unproven*: a declared self-benchmark, or none) may have
one second lease, a :class:`Replica`, held by a measured client (BOINC's replication for unreliable hosts; issue 37):
the same job, key and version, so the same sample. Whichever holder's result is accepted first closes the job; the
other's is credited, never trained (coordinator.api.intake). A fresh identity that claims a speed, takes a job and
vanishes then delays nothing: the replica's holder returns the job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum


class JobState(StrEnum):
    OPEN = "open"
    LEASED = "leased"
    DONE = "done"


@dataclass(frozen=True)
class Replica:
    """The second lease on a job (module docstring): its own id, holder, deadline and version (the job's when it was
    given), and when its holder is overdue (core.pacing.due_at; None: not estimated)."""

    lease_id: str
    client: str
    deadline: float
    version: int
    due_at: float | None = None


@dataclass(frozen=True)
class LeaseView:
    """What the lease rules need to know about one job."""

    job_id: str
    state: JobState
    version: int | None  # bound when leased
    created_at: float
    lease_id: str | None = None
    lease_client: str | None = None
    lease_deadline: float | None = None
    due_at: float | None = None  # when the holder is overdue (core.pacing.due_at); None: not estimated
    expected_at: float | None = None  # when the holder is expected back (core.pacing.expected_back); None: unknown
    verifying: bool = False  # its result is here, being verified (coordinator.api.verdicts.Verifying)
    replica: Replica | None = None  # a second lease (module docstring); None: none was given, or it was released
    unproven: bool = False  # the first lease's holder has no measured pace yet (set by the issuer)


def lease_live(job: LeaseView, now: float) -> bool:
    """True while the job is leased and its deadline has not passed."""
    return job.state is JobState.LEASED and job.lease_deadline is not None and now < job.lease_deadline


def replica_live(job: LeaseView, now: float) -> bool:
    """True while the job is not done and its replica's deadline has not passed."""
    return job.state is not JobState.DONE and job.replica is not None and now < job.replica.deadline


def leasable(job: LeaseView, now: float) -> bool:
    """A job may be handed out if it is not done, nobody holds a live lease on it (its replica's included) and no
    result of it is being verified (one that is accepted would make a second holder's work a copy)."""
    return now >= leasable_from(job)


def leasable_from(job: LeaseView) -> float:
    """From when :func:`leasable` holds: once its lease and its replica's have run out; never (inf) for a job done or
    one whose result is being verified; always (-inf) for one never leased."""
    if job.state is JobState.DONE or job.verifying:
        return math.inf
    first = job.lease_deadline if job.state is JobState.LEASED and job.lease_deadline is not None else -math.inf
    return max(first, job.replica.deadline if job.replica is not None else -math.inf)


def held_by(job: LeaseView, client_id: str, lease_id: str) -> LeaseView:
    """The job as ``client_id``'s lease ``lease_id`` sees it: its replica's holder sees the replica as the job's
    lease (so :func:`check_lease` and the version checks read its own), anyone else the job as it is."""
    r = job.replica
    if r is None or r.client != client_id or r.lease_id != lease_id:
        return job
    state = job.state if job.state is JobState.DONE else JobState.LEASED
    return replace(job, state=state, version=r.version, lease_id=r.lease_id, lease_client=r.client,
                   lease_deadline=r.deadline, due_at=r.due_at, expected_at=None, replica=None, unproven=False)


def holds_lease(job: LeaseView, client_id: str, lease_id: str) -> bool:
    """Did ``client_id`` hold ``lease_id`` on this job, as its first lease or its replica (whatever its state now)?"""
    view = held_by(job, client_id, lease_id)
    return view.lease_client == client_id and view.lease_id == lease_id


def choose_job(jobs: list[LeaseView], now: float) -> LeaseView | None:
    """The oldest leasable job, so reissued work is finished before fresh work starts."""
    candidates = [j for j in jobs if leasable(j, now)]
    # min() keeps the first of equal keys, so callers that pass jobs in creation order break ties by that order
    return min(candidates, key=lambda j: j.created_at) if candidates else None


def deadline_for(now: float, lease_timeout_s: float) -> float:
    return now + lease_timeout_s


class LeaseCheck(StrEnum):
    OK = "ok"
    NOT_HOLDER = "not_holder"
    EXPIRED = "expired"
    DONE = "done"


def check_lease(job: LeaseView, client_id: str, lease_id: str, now: float) -> LeaseCheck:
    """Is ``client_id`` (with ``lease_id``) the current, unexpired holder of ``job``?

    Order matters: a completed job is reported as such even to its former holder; a lease id that is not
    the current one (the job was reissued) is "not holder" even if it once was.
    """
    if job.state is JobState.DONE:
        return LeaseCheck.DONE
    if job.lease_client != client_id or job.lease_id != lease_id:
        return LeaseCheck.NOT_HOLDER
    if job.state is not JobState.LEASED or job.lease_deadline is None or now >= job.lease_deadline:
        return LeaseCheck.EXPIRED
    return LeaseCheck.OK


def kept_versions(current: int, keep_last: int, jobs: list[LeaseView], now: float,
                  evaluating: Iterable[int] = ()) -> set[int]:
    """The published versions to keep on disk: the newest ``keep_last``, every version a live lease is bound
    to, and every version whose held-out evaluation was asked and is not done yet (``evaluating``). Why the
    second part: a slow honest client's result is verified against its job's version, and pruning that version
    under its lease would refuse the work for something the client did not do (its lease still runs). A lease is
    bounded by ``jobs.lease_timeout_s``, so this keeps at most that long a few more folders. Why the third: an
    operator's held-out curve must not depend on the verifier keeping up with the learner (async runs step
    faster than a busy verifier evaluates); those folders go once their evaluations are recorded."""
    keep = set(range(max(0, current - keep_last + 1), current + 1))
    keep.update(j.version for j in jobs if j.version is not None and j.version <= current and lease_live(j, now))
    keep.update(j.replica.version for j in jobs if j.replica is not None and j.replica.version <= current
                and replica_live(j, now))
    keep.update(v for v in evaluating if v <= current)
    return keep
