"""coordinator/core/scheduling.py: admission, version binding, batching and staleness weights."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.leases import JobState, LeaseView
from coordinator.core.pacing import ClientSpeed
from coordinator.core.scheduling import (
    LeaseDecision,
    Pending,
    SyncPolicy,
    admits,
    bind_version,
    decide_lease,
    expected_staleness_at_admission,
    select_batch,
    staleness_weight,
)


def seq(b: int = 2, s: int = 2) -> SyncPolicy:
    return SyncPolicy("sequential-pull", s, b)


def asyn(b: int = 2, s: int = 2) -> SyncPolicy:
    return SyncPolicy("async-push-pull", s, b)


def colo(b: int = 2, s: int = 2) -> SyncPolicy:
    return SyncPolicy("colocated", s, b)


# ---- SyncPolicy.bound -----------------------------------------------------------------------------------
@pytest.mark.parametrize("s", [1, 2, 4, 64])
def test_bound_is_max_staleness_only_for_async(s: int) -> None:
    assert asyn(s=s).bound == s
    assert seq(s=s).bound == 0  # max_staleness is ignored outside async push-pull
    assert colo(s=s).bound == 0


# ---- admits ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b", [1, 2, 3, 8])
@pytest.mark.parametrize("make", [seq, colo], ids=["sequential", "colocated"])
def test_admits_boundary_bound_zero(b: int, make: Callable[..., SyncPolicy]) -> None:
    policy = make(b=b, s=4)
    assert admits(0, policy)
    assert admits(b - 1, policy)  # B·(0+1) − 1
    assert not admits(b, policy)  # B·(0+1)
    assert not admits(b + 1, policy)
    assert not admits(10 * b, policy)


@pytest.mark.parametrize("b", [1, 2, 3, 8])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_admits_boundary_async(b: int, s: int) -> None:
    policy = asyn(b=b, s=s)
    cap = b * (s + 1)
    assert admits(0, policy)
    assert admits(cap - 1, policy)
    assert not admits(cap, policy)
    assert not admits(cap + 1, policy)
    assert [q for q in range(3 * cap) if admits(q, policy)] == list(range(cap))


def test_expected_staleness_at_admission() -> None:
    policy = asyn(b=4, s=2)
    assert [expected_staleness_at_admission(q, policy) for q in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    # at the admission limit, a job is expected to be trained exactly S steps later
    for b, s in itertools.product([1, 2, 5], [1, 2, 4]):
        policy = asyn(b=b, s=s)
        assert expected_staleness_at_admission(b * (s + 1) - 1, policy) == s


# ---- bind_version ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [seq, colo], ids=["sequential", "colocated"])
def test_bind_version_bound_zero_always_current(make: Callable[..., SyncPolicy]) -> None:
    policy = make(b=2, s=4)
    for current, held, queued in itertools.product(range(6), range(-1, 8), range(6)):
        assert bind_version(current, held, queued, policy) == current


@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("s", [1, 2, 4])
def test_bind_version_async_rule(b: int, s: int) -> None:
    policy = asyn(b=b, s=s)
    for current, held, queued in itertools.product(range(8), range(8), range(b * (s + 1) + 2)):
        got = bind_version(current, held, queued, policy)
        if held > current:
            assert got == current
        elif current - held + queued // b <= s:
            assert got == held
        else:
            assert got == current


def test_bind_version_async_examples() -> None:
    policy = asyn(b=2, s=2)
    assert bind_version(5, 5, 0, policy) == 5
    assert bind_version(5, 4, 0, policy) == 4   # 1 + 0 ≤ 2
    assert bind_version(5, 3, 0, policy) == 3   # 2 + 0 ≤ 2
    assert bind_version(5, 3, 1, policy) == 3   # 2 + ⌊1/2⌋ = 2
    assert bind_version(5, 3, 2, policy) == 5   # 2 + ⌊2/2⌋ = 3 > 2
    assert bind_version(5, 4, 3, policy) == 4   # 1 + 1 = 2
    assert bind_version(5, 4, 4, policy) == 5   # 1 + 2 = 3 > 2
    assert bind_version(5, 2, 0, policy) == 5   # 3 > 2 already
    assert bind_version(5, 0, 0, policy) == 5


@pytest.mark.parametrize("lag", [0, 1, 2, 5])
def test_bind_version_keeps_a_held_version_only_within_max_held_lag(lag: int) -> None:
    """Staleness per result (issue 32): with S = 16 a held version up to 16 behind would still be trainable, but the
    lease names it only while it is at most ``max_held_lag`` behind; beyond, the client refreshes to the current one."""
    policy = SyncPolicy("async-push-pull", 16, 2, max_held_lag=lag)
    for held in range(0, 21):
        got = bind_version(20, held, 0, policy)
        assert got == (held if 20 - held <= lag else 20), (held, got)
    assert bind_version(20, 19, 31, policy) == (19 if lag >= 1 else 20)  # 1 + ⌊31/2⌋ = 16 ≤ S: the queue allows it
    assert bind_version(20, 19, 32, policy) == 20  # 1 + 16 > S: the bound refuses whatever the lag allows


@pytest.mark.parametrize("held", [-1, 6, 7, 100])
def test_bind_version_no_or_future_snapshot_gets_current(held: int) -> None:
    for queued in range(6):
        assert bind_version(5, held, queued, asyn(b=2, s=4)) == 5
    assert bind_version(0, held, 0, asyn()) == 0


def test_bind_version_never_names_a_future_version() -> None:
    for policy in (seq(), asyn(b=1, s=1), asyn(b=3, s=4), colo()):
        for current, held, queued in itertools.product(range(5), range(-1, 8), range(16)):
            v = bind_version(current, held, queued, policy)
            assert v <= current
            assert v in (current, held)


# ---- select_batch ---------------------------------------------------------------------------------------
def P(job_id: str, version: int, at: float = 0.0) -> Pending:
    return Pending(job_id, version, at)


def test_select_batch_oldest_first_by_version_time_then_id() -> None:
    pending = [P("e", 3, 1.0), P("a", 3, 5.0), P("d", 2, 9.0), P("c", 3, 1.0), P("b", 2, 7.0)]
    batch, too_stale = select_batch(pending, 3, asyn(b=5, s=2))
    assert [p.job_id for p in batch] == ["b", "d", "c", "e", "a"]
    assert too_stale == []


def test_select_batch_takes_exactly_b() -> None:
    pending = [P(f"j{k}", 4, float(10 - k)) for k in range(7)]
    batch, too_stale = select_batch(pending, 4, asyn(b=3, s=1))
    assert [p.job_id for p in batch] == ["j6", "j5", "j4"]  # earliest received
    assert too_stale == []


def test_select_batch_older_version_first_even_if_received_later() -> None:
    pending = [P("fresh", 5, 1.0), P("old", 4, 100.0)]
    batch, _ = select_batch(pending, 5, asyn(b=1, s=1))
    assert batch == [P("old", 4, 100.0)]


def test_select_batch_order_independent_of_input_order() -> None:
    pending = [P(f"j{k}", k % 3 + 2, float(k % 4)) for k in range(12)]
    expected = select_batch(pending, 4, asyn(b=5, s=2))
    rng = random.Random(0)
    for _ in range(20):
        shuffled = pending[:]
        rng.shuffle(shuffled)
        batch, too_stale = select_batch(shuffled, 4, asyn(b=5, s=2))
        assert batch == expected[0]
        assert sorted(too_stale, key=lambda p: p.job_id) == sorted(expected[1], key=lambda p: p.job_id)


@pytest.mark.parametrize("b", [1, 2, 4])
def test_select_batch_empty_below_b(b: int) -> None:
    policy = asyn(b=b, s=2)
    pending = [P(f"j{k}", 3, float(k)) for k in range(b - 1)]
    assert select_batch(pending, 3, policy) == ([], [])
    assert select_batch([], 3, policy) == ([], [])
    batch, _ = select_batch([*pending, P("last", 3, 99.0)], 3, policy)
    assert len(batch) == b


def test_select_batch_too_stale_do_not_count_toward_b() -> None:
    policy = asyn(b=3, s=1)
    pending = [P("s1", 0), P("s2", 1), P("ok1", 2), P("ok2", 3)]  # current 3: staleness 3, 2, 1, 0
    batch, too_stale = select_batch(pending, 3, policy)
    assert batch == []
    assert {p.job_id for p in too_stale} == {"s1", "s2"}


def test_select_batch_reports_too_stale_and_never_trains_them() -> None:
    policy = asyn(b=2, s=2)
    pending = [P("a", 7), P("b", 8), P("c", 10), P("d", 9), P("e", 5), P("f", 10)]
    batch, too_stale = select_batch(pending, 10, policy)
    assert {p.job_id for p in too_stale} == {"a", "e"}  # staleness 3 and 5 > 2
    assert [p.job_id for p in batch] == ["b", "d"]  # staleness exactly 2 is within the bound
    assert not set(batch) & set(too_stale)
    assert all(10 - p.version <= 2 for p in batch)


def test_select_batch_boundary_staleness() -> None:
    policy = asyn(b=1, s=2)
    assert select_batch([P("x", 3)], 5, policy) == ([P("x", 3)], [])  # staleness 2 = S
    assert select_batch([P("x", 2)], 5, policy) == ([], [P("x", 2)])  # staleness 3 = S + 1


@pytest.mark.parametrize("make", [seq, colo], ids=["sequential", "colocated"])
def test_select_batch_bound_zero_only_current_version(make: Callable[..., SyncPolicy]) -> None:
    policy = make(b=2, s=4)
    pending = [P("old1", 4, 0.0), P("cur1", 5, 2.0), P("old2", 3, 1.0), P("cur2", 5, 1.0)]
    batch, too_stale = select_batch(pending, 5, policy)
    assert [p.job_id for p in batch] == ["cur2", "cur1"]
    assert {p.job_id for p in too_stale} == {"old1", "old2"}
    # a single current result is not enough, however many older ones there are
    assert select_batch([P("old1", 4), P("old2", 4), P("cur", 5)], 5, policy)[0] == []


def test_select_batch_does_not_mutate_input() -> None:
    pending = [P("b", 2, 1.0), P("a", 1, 2.0), P("c", 0, 0.0)]
    copy = list(pending)
    select_batch(pending, 2, asyn(b=2, s=1))
    assert pending == copy


# ---- staleness_weight -----------------------------------------------------------------------------------
def test_staleness_weight_values() -> None:
    assert staleness_weight(0, 0.5) == 1.0
    assert staleness_weight(1, 0.5) == 0.5
    assert staleness_weight(3, 0.5) == 0.125
    assert staleness_weight(2, 0.9) == pytest.approx(0.81)
    assert [staleness_weight(s, 1.0) for s in range(10)] == [1.0] * 10  # decay 1: stale rollouts count fully


def test_staleness_weight_decreases_with_staleness() -> None:
    weights = [staleness_weight(s, 0.7) for s in range(8)]
    assert weights == sorted(weights, reverse=True)
    assert all(0 < w <= 1 for w in weights)


@pytest.mark.parametrize("s", [-1, -5])
def test_staleness_weight_negative_raises(s: int) -> None:
    with pytest.raises(ValueError, match="future policy version"):
        staleness_weight(s, 0.5)
    with pytest.raises(ValueError):
        staleness_weight(s, 1.0)


# ---- the admission rule, simulated ----------------------------------------------------------------------
@dataclass
class Swarm:
    """Clients lease while the rule admits; results return in any order; the learner trains eagerly."""

    policy: SyncPolicy
    current: int = 0
    clock: float = 0.0
    next_job: int = 0
    leased: list[tuple[str, int]] = field(default_factory=list)  # (job_id, bound version), in lease order
    pending: list[Pending] = field(default_factory=list)
    trained: dict[str, int] = field(default_factory=dict)  # job_id -> staleness when trained
    too_stale: dict[str, int] = field(default_factory=dict)  # job_id -> staleness when set aside
    returned: int = 0

    @property
    def queued(self) -> int:
        return len(self.leased) + len(self.pending)

    def lease(self, held: int) -> None:
        assert admits(self.queued, self.policy)
        version = bind_version(self.current, held, self.queued, self.policy)
        assert version <= self.current
        assert version == self.current or (self.policy.bound > 0 and version == held)
        self.leased.append((f"j{self.next_job}", version))
        self.next_job += 1
        assert self.queued <= self.policy.jobs_per_step * (self.policy.bound + 1)

    def give_back(self, index: int, learn: bool = True) -> None:
        job_id, version = self.leased.pop(index)
        self.clock += 1.0
        self.pending.append(Pending(job_id, version, self.clock))
        self.returned += 1
        if learn:
            self.learn()

    def can_learn(self) -> bool:
        return bool(select_batch(self.pending, self.current, self.policy)[0])

    def learn(self, at_most: int | None = None) -> None:
        """Take batches while there are B eligible results (at most ``at_most`` of them)."""
        steps = 0
        while at_most is None or steps < at_most:
            batch, too_stale = select_batch(self.pending, self.current, self.policy)
            for p in too_stale:
                assert p.job_id not in self.trained and p.job_id not in self.too_stale
                self.too_stale[p.job_id] = self.current - p.version
            gone = {p.job_id for p in batch} | {p.job_id for p in too_stale}
            self.pending = [p for p in self.pending if p.job_id not in gone]
            if not batch:
                return
            assert len(batch) == self.policy.jobs_per_step
            for p in batch:
                assert p.job_id not in self.trained and p.job_id not in self.too_stale
                self.trained[p.job_id] = self.current - p.version
            self.current += 1
            steps += 1


policies = st.one_of(
    st.builds(SyncPolicy, st.just("sequential-pull"), st.integers(1, 4), st.integers(1, 4)),
    st.builds(SyncPolicy, st.just("colocated"), st.integers(1, 4), st.integers(1, 4)),
    st.builds(SyncPolicy, st.just("async-push-pull"), st.integers(1, 4), st.integers(1, 4)),
)


def simulate(data: st.DataObject, policy: SyncPolicy, *, in_order: bool, eager: bool, n_actions: int) -> Swarm:
    """``eager``: the learner trains the moment B results are eligible. Otherwise it trains one batch at
    moments hypothesis chooses, as the real learner does while results keep arriving during a step."""
    swarm = Swarm(policy)
    for _ in range(n_actions):
        actions = []
        if admits(swarm.queued, policy):
            actions.append("lease")
        if swarm.leased:
            actions.append("return")
        if not eager and swarm.can_learn():
            actions.append("learn")
        if not actions:
            pytest.fail(f"deadlock: queued={swarm.queued}, pending={len(swarm.pending)}, leased=0")
        action = data.draw(st.sampled_from(actions), label="action")
        if action == "lease":
            # the version the client holds: none yet, any published one, or (bogus) one from the future
            swarm.lease(data.draw(st.integers(-1, swarm.current + 1), label="held"))
        elif action == "return":
            index = 0 if in_order else data.draw(st.integers(0, len(swarm.leased) - 1), label="which returns")
            swarm.give_back(index, learn=eager)
        else:
            swarm.learn(at_most=1)
    # drain: every outstanding job comes back (in lease order), and the learner takes what it can
    while swarm.leased:
        swarm.give_back(0)
    swarm.learn()
    return swarm


def check_invariants(swarm: Swarm) -> None:
    policy = swarm.policy
    assert all(0 <= s <= policy.bound for s in swarm.trained.values()), swarm.trained
    assert all(s > policy.bound for s in swarm.too_stale.values())
    # every returned result is trained once, set aside once, or still waiting (fewer than B of them)
    assert not set(swarm.trained) & set(swarm.too_stale)
    assert len(swarm.trained) + len(swarm.too_stale) + len(swarm.pending) == swarm.returned
    assert len(swarm.pending) < policy.jobs_per_step
    assert len(swarm.trained) == swarm.current * policy.jobs_per_step


@settings(max_examples=150)
@given(data=st.data(), policy=policies, eager=st.booleans(), n_actions=st.integers(0, 150))
def test_simulated_swarm_never_trains_beyond_the_bound(data: st.DataObject, policy: SyncPolicy, eager: bool,
                                                       n_actions: int) -> None:
    swarm = simulate(data, policy, in_order=False, eager=eager, n_actions=n_actions)
    check_invariants(swarm)
    if policy.bound == 0:
        # sequential pull: every outstanding job is for the current version, whatever the return order
        assert swarm.too_stale == {}
        assert set(swarm.trained.values()) <= {0}


@settings(max_examples=150)
@given(data=st.data(), policy=policies, eager=st.booleans(), n_actions=st.integers(0, 150))
def test_simulated_swarm_in_order_produces_nothing_too_stale(data: st.DataObject, policy: SyncPolicy,
                                                             eager: bool, n_actions: int) -> None:
    swarm = simulate(data, policy, in_order=True, eager=eager, n_actions=n_actions)
    check_invariants(swarm)
    assert swarm.too_stale == {}, f"stale work was issued: {swarm.too_stale}"


def test_simulated_async_reaches_its_bound_and_uses_the_pipeline() -> None:
    # a saturated in-order pipeline: keep B·(S+1) jobs out, return the oldest, repeat
    policy = asyn(b=2, s=2)
    swarm = Swarm(policy)
    for _ in range(200):
        while admits(swarm.queued, policy):
            swarm.lease(held=-1)
        swarm.give_back(0)
    check_invariants(swarm)
    assert swarm.too_stale == {}
    assert max(swarm.trained.values()) == 2  # rollouts up to S old are trained on
    assert swarm.current >= 90


def test_simulated_slow_client_result_is_set_aside() -> None:
    # B = 1, S = 1: the first job's client is slow; everyone else keeps the learner moving
    policy = asyn(b=1, s=1)
    swarm = Swarm(policy)
    swarm.lease(held=-1)  # j0, bound to version 0, held by the slow client
    for _ in range(3):
        swarm.lease(held=swarm.current)
        swarm.give_back(len(swarm.leased) - 1)
    assert swarm.current == 3
    swarm.give_back(0)  # j0 returns, 3 versions old
    assert swarm.too_stale == {"j0": 3}
    assert "j0" not in swarm.trained
    assert swarm.pending == []


# ---- decide_lease: a released, expired or abandoned job keeps its key and version (issue 37) --------------------
def _open(job_id: str, version: int | None, created_at: float = 0.0) -> LeaseView:
    """A job released or expired after a lease bound it to ``version`` (None: never leased)."""
    return LeaseView(job_id, JobState.OPEN, version, created_at)


def _live(job_id: str, version: int) -> LeaseView:
    return LeaseView(job_id, JobState.LEASED, version, 0.0, f"l-{job_id}", "x", 1e9)


def test_a_released_job_is_reissued_at_its_version_while_its_result_would_be_trained() -> None:
    """Async S = 2: the job released at version 5 goes out again at 5 (the same tokens from whoever takes it) while
    a result at 5 admitted now would still be trained, whatever version the asking client holds; once it would not
    (current − 5 + the queue's steps > S), at the version the rules bind."""
    policy = asyn(b=2, s=2)
    assert decide_lease([_open("j0", 5)], 0, 0.0, 6, 6, policy) == LeaseDecision("j0", 5)
    assert decide_lease([_open("j0", 5)], 0, 0.0, 7, -1, policy) == LeaseDecision("j0", 5)  # 7 − 5 + 0 = 2
    queued = [_open("j0", 5), _live("j1", 7), _live("j2", 7)]  # 7 − 5 + 2 // 2 = 3 > 2
    assert decide_lease(queued, 0, 0.0, 7, 7, policy) == LeaseDecision("j0", 7)
    assert decide_lease([_open("j0", 5)], 0, 0.0, 8, 6, policy) == LeaseDecision("j0", 6)  # past S: the held one
    assert decide_lease([_open("j0", None)], 0, 0.0, 8, 6, policy) == LeaseDecision("j0", 6)  # never leased


def test_sequential_pull_reissues_a_released_job_within_the_step_at_the_current_version() -> None:
    policy = seq(b=2)
    assert decide_lease([_open("j0", 5), _live("j1", 5)], 0, 0.0, 5, 4, policy) == LeaseDecision("j0", 5)
    assert decide_lease([_open("j0", 4)], 0, 0.0, 5, 4, policy) == LeaseDecision("j0", 5)  # the step is over


def test_a_client_too_slow_for_a_released_jobs_version_gets_new_work_and_leaves_the_job() -> None:
    """The released job is kept for a client that can return it in time at its version; a slow one is bound as the
    rules bind it, to a new job."""
    policy = asyn(b=2, s=2)
    slow = ClientSpeed(pace_s=2.0, step_s=1.0)  # fits (2 − lag + ½) steps: lag 0 only
    jobs = [_open("j0", 5), _live("j1", 6), _live("j2", 6)]
    assert decide_lease(jobs, 0, 0.0, 6, 6, policy, slow) == LeaseDecision(None, 6)
    assert decide_lease(jobs, 0, 0.0, 6, 6, policy, ClientSpeed(pace_s=0.5, step_s=1.0)) == LeaseDecision("j0", 5)
