"""The issuer: which client gets which job, and when — the API role's in-memory issuance state around the pure
rules of :mod:`coordinator.core.scheduling` and :mod:`coordinator.core.pacing`.

It knows each client's pace (a declared self-benchmark until a result is observed), who is long-polling for work,
who was woken for the current version, and how fast versions come. It holds no I/O: the API
(:class:`coordinator.api.service.Coordinator`) feeds it the jobs from the store and acts on its decisions, and
``bench/swarm_sim.py`` drives this same object with simulated clients, so the simulation cannot drift from
what the coordinator does.

Every long-polling request re-checks on each new version, so one version costs as many decisions as there are
clients waiting. The waiting clients are kept in rule 1's order (coordinator.api.waiting), so counting the faster ones
is a binary search and a wake-up re-checks only the few at the head that could be served (``waiters.candidates``);
the jobs a decision reads are indexed once per set of jobs (core.queue_index), so a decision costs O(log W + log Q)
in the W waiting clients and the queue's Q jobs (bench/swarm_sim.py ``--decision-cost`` measures it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from sortedcontainers import SortedList

from coordinator.api.waiting import Waiting
from coordinator.core import pacing
from coordinator.core.leases import LeaseView
from coordinator.core.queue_index import QueueIndex
from coordinator.core.scheduling import LeaseDecision, SyncPolicy, decide_lease


class Issuer:
    def __init__(self, policy: SyncPolicy, *, lease_timeout_s: float, speed_aware: bool = True) -> None:
        self.policy = policy
        self.lease_timeout_s = lease_timeout_s
        self.speed_aware = speed_aware
        self.pace: dict[str, float] = {}  # seconds from lease to result, per client (core.pacing)
        self._pace_observed: set[str] = set()  # clients whose pace comes from results, not a declaration
        # the long-polling clients in rule 1's order (coordinator.api.waiting); the head a re-check could serve is at
        # most twice the queue's B·(S+1): within one wake-up a replica given to a faster client takes it out of the
        # waiting set without taking a slot, so a slower one moves up while the free slots stay (one replica per job)
        self.waiters = Waiting(2 * policy.jobs_per_step * (policy.bound + 1) if speed_aware else None)
        self._measured: SortedList = SortedList()  # the measured paces (the fastest is the declared paces' floor)
        self._measured_ids: set[str] = set()
        self._woken: set[str] = set()  # clients a new version woke to pull it (next_in_line), for that version
        self._woken_version = -1
        self.version_interval: float | None = None  # recent seconds between policy versions
        self._version_at: float | None = None
        self._pace_changes = 0  # how often a pace changed: an index of the jobs (self.index) holds due times of paces
        self._index_kept: tuple[tuple[object, ...], QueueIndex] | None = None

    # -- what the issuer observes -------------------------------------------------------------------------
    def declare(self, client_id: str, pace_s: float | None) -> None:
        """A declared self-benchmark seeds the pace until a result is seen (never overrides an observed one)."""
        if pace_s is not None and client_id not in self.pace:
            self._set_pace(client_id, pace_s)

    def forget(self, client_ids: list[str]) -> None:
        """Identities the store removed (Store.clients.expire_idle): their declared pace goes too."""
        for cid in client_ids:
            self._set_pace(cid, None)
            self._pace_observed.discard(cid)

    def rank(self, client_id: str) -> pacing.Rank | None:
        """Where ``client_id`` stands in rule 1's order (core.pacing.rank: a declared pace is believed no faster
        than the fastest measured one, and a measured client goes first among equals)."""
        return pacing.rank(self.pace.get(client_id), client_id in self._pace_observed, self._floor())

    def _floor(self) -> float:
        """The fastest pace any result has shown: no declaration ranks a client ahead of it."""
        return self._measured[0] if self._measured else 0.0

    def _set_pace(self, client_id: str, pace_s: float | None) -> None:
        """Change a client's pace, and where it waits, its place among the waiting clients."""
        floor = self._floor()
        self._pace_changes += 1
        old = self.pace.get(client_id)
        if old is not None and client_id in self._measured_ids:
            self._measured.remove(old)
            self._measured_ids.discard(client_id)
        if pace_s is None:
            self.pace.pop(client_id, None)
        else:
            self.pace[client_id] = pace_s
            if client_id in self._pace_observed:
                self._measured.add(pace_s)
                self._measured_ids.add(client_id)
        self.waiters.rerank(client_id, self.rank(client_id))
        if self._floor() != floor:  # the declared paces below the floor move with it: a pass over the waiting
            # newcomers (clients not yet measured: few, and only when the fastest measured pace changes)
            for cid in [c for c in self.waiters.clients() if c not in self._pace_observed and c != client_id]:
                self.waiters.rerank(cid, self.rank(cid))

    def observe(self, client_id: str, view: LeaseView, now: float) -> None:
        """Lease-to-result seconds of an accepted result update the client's pace."""
        if view.lease_deadline is None:
            return
        leased_at = view.lease_deadline - self.lease_timeout_s
        # the first observation replaces a declared (untrusted, optimistic) self-benchmark outright
        previous = self.pace.get(client_id) if client_id in self._pace_observed else None
        self._pace_observed.add(client_id)  # before the pace is set: it is listed in the observed tier
        self._set_pace(client_id, pacing.update_pace(previous, now - leased_at))

    def new_version(self, now: float) -> None:
        """A version became current at ``now`` (monotonic seconds): how fast versions come."""
        if self._version_at is not None:
            self.version_interval = pacing.update_pace(self.version_interval, now - self._version_at)
        self._version_at = now

    def begin_wait(self, client_id: str) -> None:
        """A lease request of ``client_id`` starts long-polling (requests of one client are counted)."""
        self.waiters.begin(client_id, self.rank(client_id))

    def end_wait(self, client_id: str) -> None:
        self.waiters.end(client_id)

    @contextmanager
    def waiting(self, client_id: str) -> Iterator[None]:
        """While a lease request of ``client_id`` long-polls."""
        self.begin_wait(client_id)
        try:
            yield
        finally:
            self.end_wait(client_id)

    # -- decisions ----------------------------------------------------------------------------------------
    def next_in_line(self, client_id: str, version: int) -> bool:
        """Is this client among the B fastest of those waiting for work when ``version`` appeared (unknown pace
        counts as slowest)? Only they are woken by a new version to pull it: in a large idle swarm the others
        would download every version for nothing while faster clients take the work, so pulls per version stay
        bounded by B. Clients already woken for this version still count as ahead, so the outcome does not
        depend on the order in which the waiting requests re-check.

        A measured client counts only measured ones as ahead of it: an unproven client's job goes to a measured one
        as a replica when needed (core.scheduling.choose_replica), so claims — fresh identities declaring any speed
        — cannot keep the measured clients from pulling the version they will work on. So at most B measured and
        B others are woken per version."""
        if self._woken_version != version:
            self._woken_version, self._woken = version, set()
        b = self.policy.jobs_per_step
        proven = client_id in self._pace_observed
        woken_others = [c for c in self._woken if c != client_id and (not proven or c in self._pace_observed)]
        if len(woken_others) >= b:
            return False  # the B woken so far (ties, unknown paces) are ahead of it
        mine = self.rank(client_id)
        waiting = self.waiters.faster(mine, proven=True) if proven and mine is not None else self.waiters.faster(mine)
        ahead = waiting + pacing.faster_count(mine, (self.rank(c) for c in woken_others if c not in self.waiters))
        if ahead >= b:
            return False  # B faster ones waiting or woken are ahead of it
        self._woken.add(client_id)
        return True

    def proven(self, client_id: str) -> bool:
        """Is this client's pace measured by its own results (not a declaration)?"""
        return client_id in self._pace_observed

    def proven_waiting(self) -> bool:
        """Is a client of measured pace long-polling for work (one a replica could go to)?"""
        return self.waiters.any_proven()

    def with_due(self, view: LeaseView) -> LeaseView:
        """The lease with the times its holder is expected back and overdue (core.pacing), if its pace is known;
        whether that holder is unproven (core.scheduling.choose_replica); its replica's due time."""
        if view.lease_client is None or view.lease_deadline is None:
            return view
        pace = self.pace.get(view.lease_client)
        unproven = view.lease_client not in self._pace_observed
        if (pace is None and view.due_at is None and view.expected_at is None and view.replica is None
                and unproven == view.unproven):
            return view  # nothing to estimate: no copy
        leased_at = view.lease_deadline - self.lease_timeout_s
        replica = view.replica
        if replica is not None:
            replica = replace(replica, due_at=pacing.due_at(replica.deadline - self.lease_timeout_s,
                                                            self.pace.get(replica.client), self.version_interval))
        return LeaseView(view.job_id, view.state, view.version, view.created_at, view.lease_id, view.lease_client,
                         view.lease_deadline, pacing.due_at(leased_at, pace, self.version_interval),
                         pacing.expected_back(leased_at, pace), view.verifying, replica, unproven)

    def speed_of(self, client_id: str, views: Sequence[LeaseView] | QueueIndex, now: float) -> pacing.ClientSpeed:
        index = views if isinstance(views, QueueIndex) else QueueIndex(views, 0, self.policy.bound, self.pace)
        mine = self.rank(client_id)
        proven = client_id in self._pace_observed
        return pacing.ClientSpeed(pace_s=self.pace.get(client_id), faster_waiting=self.waiters.faster(mine),
                                  exploring=index.exploring(now, client_id), step_s=self.version_interval,
                                  proven=proven, faster_proven_waiting=self.waiters.faster(mine, proven=True)
                                  if proven and mine is not None else 0)

    def _index(self, views: Sequence[LeaseView], version: int,
              verifying: frozenset[str] = frozenset()) -> QueueIndex:
        """The jobs not yet done as this issuer's decisions read them — those in ``verifying`` marked, each lease with
        its due times and whether its holder is proven (:meth:`with_due`) — indexed (core.queue_index) at
        ``version``. Every waiting client's re-check reads the same jobs, so the index is kept for as long as the
        jobs, the version, the jobs being verified, the paces and the version interval stay what they were: a
        decision then costs O(log Q) in the queue's Q jobs, not Q (comparing the jobs with the kept ones is one pass
        at C speed, identical objects first)."""
        key = (tuple(views), version, verifying, self._pace_changes, self.version_interval)
        if self._index_kept is not None and self._index_kept[0] == key:
            return self._index_kept[1]
        if verifying:
            views = [replace(v, verifying=True) if v.job_id in verifying else v for v in views]
        if self.speed_aware:
            views = [self.with_due(v) for v in views]
        index = QueueIndex(views, version, self.policy.bound, self.pace)
        self._index_kept = (key, index)
        return index

    def decide(self, client_id: str, views: Sequence[LeaseView], queued: int, now: float, version: int,
               held_version: int, withheld: frozenset[str] = frozenset(),
               verifying: frozenset[str] = frozenset()) -> LeaseDecision | None:
        """core.scheduling.decide_lease with this client's speed, every lease's due times and whether its holder is
        proven, and the jobs whose result is being verified (``verifying``: never reissued, and each keeps its slot
        in the queue). A decision with ``replica`` is a second lease on a live job (core.scheduling.choose_replica)."""
        index = self._index(views, version, verifying)
        speed = self.speed_of(client_id, index, now) if self.speed_aware else None
        return decide_lease(index, queued, now, version, held_version, self.policy, speed, withheld, client_id)
