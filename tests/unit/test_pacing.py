"""coordinator/core/pacing.py and its use in core.scheduling.decide_lease: speed-aware issuance."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.core.leases import JobState, LeaseView
from coordinator.core.pacing import (
    HORIZON_SHARE,
    OVERDUE_FACTOR,
    OVERDUE_FLOOR_S,
    PACE_WEIGHT,
    ClientSpeed,
    due_at,
    expected_back,
    faster_count,
    may_take_slot,
    update_pace,
    within_horizon,
)
from coordinator.core.scheduling import LeaseDecision, SyncPolicy, decide_lease, occupies_slot, supply_before

ASYNC1 = SyncPolicy("async-push-pull", 1, 2)  # B = 2, S = 1: four slots
SEQ = SyncPolicy("sequential-pull", 1, 2)


def lease(job_id: str, version: int, client: str = "x", deadline: float = 1e9, due: float | None = None,
          expected: float | None = None) -> LeaseView:
    return LeaseView(job_id, JobState.LEASED, version, 0.0, f"l-{job_id}", client, deadline, due, expected)


# ---- pace estimate ----------------------------------------------------------------------------------------
def test_first_observation_replaces_unknown() -> None:
    assert update_pace(None, 7.5) == 7.5


def test_pace_is_exponentially_weighted_by_hand() -> None:
    assert update_pace(10.0, 20.0) == pytest.approx(10.0 * (1 - PACE_WEIGHT) + 20.0 * PACE_WEIGHT)
    assert update_pace(10.0, 20.0) == pytest.approx(13.0)  # with PACE_WEIGHT = 0.3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_pace_ignores_nonsense_observations(bad: float) -> None:
    assert update_pace(4.0, bad) == 4.0


def test_faster_count_treats_unknown_as_slowest() -> None:
    assert faster_count(5.0, [1.0, 5.0, 9.0, None]) == 1  # strictly faster only
    assert faster_count(None, [1.0, None, 30.0]) == 2


def test_due_at_hand_value_and_unknown() -> None:
    assert due_at(100.0, 2.0, 1.5) == pytest.approx(100.0 + OVERDUE_FACTOR * 2.0 + 1.5)
    # a pace of milliseconds (tiny model, optimistic self-benchmark) never makes a lease overdue at once
    assert due_at(100.0, 0.02, 0.1) == pytest.approx(100.0 + OVERDUE_FLOOR_S)
    assert due_at(100.0, None, 1.5) is None


def test_horizon_allows_half_a_step_of_slack_and_asks_the_job_back_within_its_share() -> None:
    assert within_horizon(1.5 * HORIZON_SHARE, 1.0, 1)
    assert not within_horizon(1.5 * HORIZON_SHARE + 0.01, 1.0, 1)
    assert not within_horizon(0.5 * HORIZON_SHARE + 0.01, 1.0, 0)


def test_the_horizon_margin_grows_with_the_horizon() -> None:
    """Issue 32: at S = 16 a job of 13 s on a learner publishing every second (a recent mean) is refused — versions
    come faster as the supply grows, and at 16.5 s of horizon it would come back at the edge — while at S = 2 a job
    of 1.9 s still gets in: a share of the horizon, not a number of steps, so small bounds keep their fast clients."""
    assert 0.5 < HORIZON_SHARE < 1.0
    assert not within_horizon(16.5 * HORIZON_SHARE + 0.1, 1.0, 16)
    assert within_horizon(16.5 * HORIZON_SHARE, 1.0, 16)
    assert within_horizon(1.0, 1.0, 2) and within_horizon(2.5 * HORIZON_SHARE, 1.0, 2)


# ---- may_take_slot ------------------------------------------------------------------------------------------
def test_slot_goes_to_faster_waiters_first() -> None:
    speed = ClientSpeed(pace_s=3.0, faster_waiting=2, step_s=10.0)
    assert not may_take_slot(speed, free=2, queued=0, jobs_per_step=2, versions_left=None)
    assert may_take_slot(speed, free=3, queued=0, jobs_per_step=2, versions_left=None)


def test_unknown_clients_explore_one_at_a_time_unless_the_learner_starves() -> None:
    busy = ClientSpeed(pace_s=None, exploring=1, step_s=1.0)
    assert not may_take_slot(busy, free=2, queued=2, jobs_per_step=2, versions_left=1)
    assert may_take_slot(busy, free=3, queued=1, jobs_per_step=2, versions_left=1)  # fewer than B queued
    assert may_take_slot(ClientSpeed(pace_s=None), free=2, queued=2, jobs_per_step=2, versions_left=1)


def test_horizon_applies_only_once_the_next_batch_is_covered() -> None:
    slow = ClientSpeed(pace_s=50.0, step_s=1.0)
    assert not may_take_slot(slow, free=2, queued=2, jobs_per_step=2, versions_left=1)
    assert may_take_slot(slow, free=3, queued=1, jobs_per_step=2, versions_left=1)
    assert may_take_slot(slow, free=2, queued=2, jobs_per_step=2, versions_left=None)  # sequential: no horizon
    assert may_take_slot(ClientSpeed(pace_s=50.0), free=2, queued=2, jobs_per_step=2, versions_left=1)  # no step yet


# ---- decide_lease with speed --------------------------------------------------------------------------------
def test_slow_client_is_refused_when_the_batch_is_covered() -> None:
    active = [lease("j0", 5), lease("j1", 5)]
    slow = ClientSpeed(pace_s=10.0, step_s=1.0)
    assert decide_lease(active, 0, 0.0, 5, 5, ASYNC1, slow) is None
    assert decide_lease(active, 0, 0.0, 5, 5, ASYNC1, None) is not None  # plain issuance would hand it out
    fast = ClientSpeed(pace_s=1.0, step_s=1.0)
    assert decide_lease(active, 0, 0.0, 5, 5, ASYNC1, fast) is not None


def test_too_slow_for_the_held_version_refreshes_to_current() -> None:
    policy = SyncPolicy("async-push-pull", 2, 2)
    speed = ClientSpeed(pace_s=2.0, step_s=1.0)  # fits (2 + .5) steps from current, not (1 + .5) from held
    decision = decide_lease([lease("j0", 6), lease("j1", 6)], 0, 0.0, 6, 5, policy, speed)
    assert decision is not None and decision.version == 6
    quick = decide_lease([lease("j0", 6), lease("j1", 6)], 0, 0.0, 6, 5, policy, ClientSpeed(pace_s=1.0, step_s=1.0))
    assert quick is not None and quick.version == 5  # keeps the version it holds


def test_overdue_and_untrainable_leases_give_their_slot_back() -> None:
    assert occupies_slot(lease("j", 5, due=10.0), 9.9, 5, ASYNC1)
    assert not occupies_slot(lease("j", 5, due=10.0), 10.0, 5, ASYNC1)  # overdue
    assert occupies_slot(lease("j", 4), 0.0, 5, ASYNC1)
    assert not occupies_slot(lease("j", 3), 0.0, 5, ASYNC1)  # can only be credited now
    full = [lease(f"j{i}", 5) for i in range(4)]
    assert decide_lease(full, 0, 0.0, 5, 5, ASYNC1) is None
    overdue = [*full[:3], lease("j3", 5, due=1.0)]
    decision = decide_lease(overdue, 0, 2.0, 5, 5, ASYNC1)
    assert decision is not None and decision.job_id is None  # a new job: the overdue one is still leased


def test_a_job_whose_result_is_being_verified_keeps_its_slot_and_is_not_reissued() -> None:
    """The verifier's delay is not a vanished holder: past its due time and its lease deadline, a job in verification
    still fills its slot (sequential pull plans no job beyond the version's batch) and counts as supply."""
    late = lease("j1", 5, deadline=1.0, due=1.0)
    verifying = replace(late, verifying=True)
    assert not occupies_slot(late, 2.0, 5, SEQ)
    assert occupies_slot(verifying, 2.0, 5, SEQ)
    assert not occupies_slot(replace(verifying, version=4), 2.0, 5, SEQ)  # past the bound: credited only, as ever
    batch = [lease("j0", 5), late]
    assert decide_lease(batch, 0, 2.0, 5, 5, SEQ) == LeaseDecision("j1", 5)  # an expired lease is reissued
    assert decide_lease([batch[0], verifying], 0, 2.0, 5, 5, SEQ) is None  # in verification: neither reissued nor replaced
    assert supply_before([verifying], 1, 2.0, 5, ASYNC1, back_at=3.0, step_s=1.0) == 2
    assert supply_before([late], 1, 2.0, 5, ASYNC1, back_at=3.0, step_s=1.0) == 1


def test_sequential_uses_fastest_first_but_no_horizon() -> None:
    active = [lease("j0", 5)]
    assert decide_lease(active, 0, 0.0, 5, 5, SEQ, ClientSpeed(pace_s=99.0, step_s=1.0)) is not None
    assert decide_lease(active, 0, 0.0, 5, 5, SEQ, ClientSpeed(pace_s=99.0, faster_waiting=1)) is None


# ---- the simulation that drives this code --------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm_sim():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import swarm_sim

    return swarm_sim


@pytest.mark.parametrize("staleness", [2, 4])
def test_simulation_keeps_the_learner_busy_once_capacity_exceeds_consumption(swarm_sim, staleness: int) -> None:  # type: ignore[no-untyped-def]
    row = swarm_sim.simulate(200, staleness, steps=300)  # the sweep's length: includes the start-up
    assert row["capacity_jobs_per_s"] > row["consumption_jobs_per_s"]
    assert row["learner_busy_fraction"] >= 0.95
    assert row["staleness_max"] <= staleness


def test_simulation_speed_aware_beats_first_come_first_served(swarm_sim) -> None:  # type: ignore[no-untyped-def]
    aware = swarm_sim.simulate(100, 2, steps=150)
    plain = swarm_sim.simulate(100, 2, steps=150, speed_aware=False)
    assert aware["learner_busy_fraction"] > 2 * plain["learner_busy_fraction"]
    assert max(aware["staleness_max"], plain["staleness_max"]) <= 2


def test_declared_pace_from_self_benchmark() -> None:
    from coordinator.core.pacing import declared_pace

    assert declared_pace(500.0, 1000) == pytest.approx(2.0)
    assert declared_pace(None, 1000) is None
    assert declared_pace(0.0, 1000) is None
    assert declared_pace(math.inf, 1000) is None


def test_a_job_refused_from_a_client_goes_to_someone_else() -> None:
    """An honest deterministic client refused on a job would be refused again with the same seed and version:
    it gets the next reissuable job, or fresh work, and the refused one waits for another client."""
    released = [LeaseView("j0", JobState.OPEN, None, 0.0), LeaseView("j1", JobState.OPEN, None, 1.0)]
    assert decide_lease(released, 0, 0.0, 5, 5, SEQ).job_id == "j0"  # type: ignore[union-attr]
    assert decide_lease(released, 0, 0.0, 5, 5, SEQ, withheld=frozenset({"j0"})).job_id == "j1"  # type: ignore[union-attr]
    fresh = decide_lease(released, 0, 0.0, 5, 5, SEQ, withheld=frozenset({"j0", "j1"}))
    assert fresh is not None and fresh.job_id is None  # a newly planned job instead


def test_just_in_time_waits_while_accepted_results_cover_the_learner() -> None:
    """Rule 4: a client of pace 2 steps is not needed while B·(2 + 1) = 6 accepted results wait for the
    learner; handing it a job now would only make that job staler."""
    from coordinator.core.pacing import needed_ahead

    assert needed_ahead(2.0, 1.0, 2) == 6 and needed_ahead(2.1, 1.0, 2) == 8 and needed_ahead(0.5, 1.0, 2) == 4
    speed = ClientSpeed(pace_s=2.0, step_s=1.0)
    kw = {"free": 4, "queued": 6, "jobs_per_step": 2, "versions_left": 4}
    assert may_take_slot(speed, **kw, ahead=5)  # type: ignore[arg-type]
    assert not may_take_slot(speed, **kw, ahead=6)  # type: ignore[arg-type]
    assert may_take_slot(speed, **kw, ahead=None)  # type: ignore[arg-type]
    # through decide_lease: S = 4, B = 2 (10 slots); 6 accepted results waiting, 2 leases out
    policy = SyncPolicy("async-push-pull", 4, 2)
    active = [lease("j0", 5), lease("j1", 5)]
    assert decide_lease(active, 6, 0.0, 5, 5, policy, speed) is None
    assert decide_lease(active, 5, 0.0, 5, 5, policy, speed) is not None
    assert decide_lease(active, 6, 0.0, 5, 5, policy, None) is not None  # plain issuance fills the queue


def test_expected_back_hand_value_and_unknown() -> None:
    assert expected_back(100.0, 2.5) == 102.5
    assert expected_back(100.0, None) is None


def test_supply_counts_only_leases_expected_back_half_a_step_before_the_asking_client() -> None:
    """Rule 4's supply at t = 10, for a job that would be back at 12 with steps of 1 s: the 3 accepted results
    plus the in-flight leases expected back in [10, 11.5]. Not counted: one expected at 11.8 (too close to
    be relied on), one at 20 (a slow holder), one already late (9: its holder may be gone), one of unknown pace,
    and one overdue."""
    policy = SyncPolicy("async-push-pull", 4, 2)
    active = [lease("a", 5, expected=10.5), lease("b", 5, expected=11.5), lease("c", 5, expected=11.8),
              lease("d", 5, expected=20.0), lease("e", 5, expected=9.0), lease("f", 5),
              lease("g", 5, expected=10.2, due=9.5)]
    assert supply_before(active, 3, 10.0, 5, policy, back_at=12.0, step_s=1.0) == 3 + 2
    # a lease whose version can no longer be trained holds no slot, so it is no supply either
    assert supply_before([lease("h", 0, expected=10.5)], 0, 10.0, 5, policy, back_at=12.0, step_s=1.0) == 0


def test_just_in_time_counts_work_in_flight_that_returns_first() -> None:
    """S = 4, B = 2, a client of pace 0.8 s with steps of 1 s: the learner takes B·(⌈0.8⌉ + 1) = 4 results
    before its job could be back. Two accepted results and two leases expected back within 0.3 s cover that,
    so it waits; if those leases were expected later than its own job, it is given one."""
    policy = SyncPolicy("async-push-pull", 4, 2)
    speed = ClientSpeed(pace_s=0.8, step_s=1.0)
    soon = [lease("j0", 5, expected=100.2), lease("j1", 5, expected=100.3)]
    late = [lease("j0", 5, expected=105.0), lease("j1", 5, expected=105.0)]
    assert decide_lease(soon, 2, 100.0, 5, 5, policy, speed) is None
    assert decide_lease(late, 2, 100.0, 5, 5, policy, speed) is not None
    assert decide_lease(soon, 1, 100.0, 5, 5, policy, speed) is not None  # one short of the demand
