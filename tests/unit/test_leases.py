from __future__ import annotations

import pytest

from coordinator.core.leases import (
    JobState,
    LeaseCheck,
    LeaseView,
    check_lease,
    choose_job,
    deadline_for,
    kept_versions,
    leasable,
    lease_live,
)

T0 = 1000.0


def view(job_id: str = "j0", state: JobState = JobState.OPEN, version: int | None = 1, created_at: float = T0,
         lease_id: str | None = None, client: str | None = None, deadline: float | None = None) -> LeaseView:
    return LeaseView(job_id, state, version, created_at, lease_id, client, deadline)


def leased(deadline: float = T0 + 60, **kw: object) -> LeaseView:
    return view(state=JobState.LEASED, lease_id="L1", client="alice", deadline=deadline, **kw)  # type: ignore[arg-type]


# ---- lease_live -----------------------------------------------------------------------------------------
def test_lease_live_until_deadline_exclusive() -> None:
    job = leased(deadline=T0 + 60)
    assert lease_live(job, T0)
    assert lease_live(job, T0 + 59.999)
    assert not lease_live(job, T0 + 60)  # expires exactly at the deadline
    assert not lease_live(job, T0 + 61)


@pytest.mark.parametrize("job", [view(), view(state=JobState.DONE, lease_id="L", client="c", deadline=T0 + 60),
                                 view(state=JobState.LEASED, lease_id="L", client="c", deadline=None)])
def test_lease_not_live_unless_leased_with_deadline(job: LeaseView) -> None:
    assert not lease_live(job, T0)


def test_deadline_for() -> None:
    assert deadline_for(T0, 120.0) == T0 + 120.0


# ---- leasable -------------------------------------------------------------------------------------------
def test_open_job_is_leasable() -> None:
    assert leasable(view(), T0)


def test_never_leased_job_has_no_version_and_is_leasable() -> None:
    fresh = view(version=None)
    assert fresh.version is None
    assert leasable(fresh, T0)


def test_live_lease_not_leasable_until_deadline() -> None:
    job = leased(deadline=T0 + 60)
    assert not leasable(job, T0)
    assert not leasable(job, T0 + 59.9)
    assert leasable(job, T0 + 60)  # expired exactly at the deadline
    assert leasable(job, T0 + 61)


def test_released_job_is_leasable() -> None:
    released = view(state=JobState.OPEN, lease_id="L1", client="alice", deadline=None)
    assert leasable(released, T0)


def test_done_job_never_leasable() -> None:
    done = view(state=JobState.DONE, lease_id="L1", client="alice", deadline=T0 + 60)
    for now in (T0, T0 + 60, T0 + 1e6):
        assert not leasable(done, now)


@pytest.mark.parametrize("version", [None, 0, 1, 100])
def test_bound_version_does_not_affect_leasability(version: int | None) -> None:
    # versions are bound (or re-bound) at lease time, so an expired job of any version can be reissued
    assert leasable(view(version=version), T0)
    assert leasable(leased(deadline=T0 - 1, version=version), T0)
    assert not leasable(leased(deadline=T0 + 1, version=version), T0)


# ---- choose_job -----------------------------------------------------------------------------------------
def test_choose_oldest_leasable() -> None:
    jobs = [
        view("j2", created_at=T0 + 2),
        view("j0", created_at=T0 + 5),
        view("j1", created_at=T0 + 1),
    ]
    chosen = choose_job(jobs, T0 + 10)
    assert chosen is not None and chosen.job_id == "j1"


def test_choose_breaks_created_at_ties_by_the_given_order() -> None:
    # the store lists jobs by sequence number, so equal timestamps go to the earlier job (j9 before j10,
    # which a comparison of the ids as text would get wrong)
    jobs = [view("j9"), view("j10"), view("j11")]
    chosen = choose_job(jobs, T0)
    assert chosen is not None and chosen.job_id == "j9"


def test_choose_skips_live_and_done() -> None:
    jobs = [
        view("a", state=JobState.LEASED, lease_id="L", client="c", deadline=T0 + 100, created_at=T0 - 30),
        view("b", state=JobState.DONE, created_at=T0 - 20),
        view("c", created_at=T0),
    ]
    chosen = choose_job(jobs, T0 + 1)
    assert chosen is not None and chosen.job_id == "c"


def test_choose_ignores_bound_version() -> None:
    jobs = [view("new", version=5, created_at=T0 + 1), view("old", version=0, created_at=T0),
            view("unbound", version=None, created_at=T0 + 2)]
    chosen = choose_job(jobs, T0 + 10)
    assert chosen is not None and chosen.job_id == "old"


def test_choose_prefers_expired_older_job_over_fresh_work() -> None:
    expired = view("old", state=JobState.LEASED, lease_id="L", client="c", deadline=T0 + 10, created_at=T0)
    fresh = view("new", created_at=T0 + 5)
    assert choose_job([fresh, expired], T0 + 9).job_id == "new"  # type: ignore[union-attr]
    assert choose_job([fresh, expired], T0 + 10).job_id == "old"  # type: ignore[union-attr]


def test_choose_none_when_nothing_leasable() -> None:
    assert choose_job([], T0) is None
    assert choose_job([view(state=JobState.DONE), leased()], T0) is None


# ---- check_lease ----------------------------------------------------------------------------------------
def test_holder_ok_before_deadline_expired_at_deadline() -> None:
    job = leased(deadline=T0 + 60)
    assert check_lease(job, "alice", "L1", T0) is LeaseCheck.OK
    assert check_lease(job, "alice", "L1", T0 + 59.999) is LeaseCheck.OK
    assert check_lease(job, "alice", "L1", T0 + 60) is LeaseCheck.EXPIRED
    assert check_lease(job, "alice", "L1", T0 + 1000) is LeaseCheck.EXPIRED


def test_other_client_or_lease_id_not_holder() -> None:
    job = leased()
    assert check_lease(job, "mallory", "L1", T0) is LeaseCheck.NOT_HOLDER
    assert check_lease(job, "alice", "L0", T0) is LeaseCheck.NOT_HOLDER


def test_reissued_lease_makes_old_holder_not_holder() -> None:
    # alice's lease L1 expired, the job was reissued to alice herself under a new lease id
    reissued = view(state=JobState.LEASED, lease_id="L2", client="alice", deadline=T0 + 200)
    assert check_lease(reissued, "alice", "L1", T0 + 100) is LeaseCheck.NOT_HOLDER
    assert check_lease(reissued, "alice", "L2", T0 + 100) is LeaseCheck.OK
    # ... or to bob: alice is not the holder, not "expired"
    to_bob = view(state=JobState.LEASED, lease_id="L2", client="bob", deadline=T0 + 200)
    assert check_lease(to_bob, "alice", "L1", T0 + 100) is LeaseCheck.NOT_HOLDER


def test_done_reported_before_anything_else() -> None:
    done = view(state=JobState.DONE, lease_id="L1", client="alice", deadline=T0 + 60)
    assert check_lease(done, "alice", "L1", T0) is LeaseCheck.DONE
    assert check_lease(done, "mallory", "nope", T0) is LeaseCheck.DONE
    assert check_lease(done, "alice", "L1", T0 + 1e6) is LeaseCheck.DONE


def test_released_lease_is_expired_for_its_holder() -> None:
    # store.jobs.release keeps lease_id/client but reopens the job and clears the deadline
    released = view(state=JobState.OPEN, lease_id="L1", client="alice", deadline=None)
    assert check_lease(released, "alice", "L1", T0) is LeaseCheck.EXPIRED


def test_never_leased_job_not_holder() -> None:
    assert check_lease(view(), "alice", "L1", T0) is LeaseCheck.NOT_HOLDER


def test_kept_versions_are_the_window_and_every_live_leases_version() -> None:
    def bound(version: int, deadline: float) -> LeaseView:
        return view(f"j{version}", JobState.LEASED, version, 0.0, "l", "c", deadline)

    assert kept_versions(9, 4, [], now=100.0) == {6, 7, 8, 9}
    # a slow client still holding a lease on version 2: its version stays verifiable until the lease ends
    assert kept_versions(9, 4, [bound(2, 120.0)], now=100.0) == {2, 6, 7, 8, 9}
    assert kept_versions(9, 4, [bound(2, 90.0)], now=100.0) == {6, 7, 8, 9}  # expired: pruned as usual
    done = view("d", JobState.DONE, 1, 0.0)
    assert kept_versions(2, 4, [done], now=100.0) == {0, 1, 2}


def test_kept_versions_keep_every_version_waiting_for_its_evaluation() -> None:
    """A held-out evaluation asked of a busy verifier must find its version still on disk, however far the learner
    moved meanwhile; the newest is kept anyway, and a version not yet published is no reason to keep anything."""
    assert kept_versions(9, 2, [], now=100.0, evaluating=[1, 5, 9]) == {1, 5, 8, 9}
    assert kept_versions(9, 2, [], now=100.0, evaluating=[12]) == {8, 9}
