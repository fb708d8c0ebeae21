"""The issuer: which client gets which job, and when — the API role's in-memory issuance state around the pure
rules of :mod:`coordinator.core.scheduling` and :mod:`coordinator.core.pacing`.

It knows each client's pace (a declared self-benchmark until a result is observed), who is long-polling for work,
who was woken for the current version, and how fast versions come. It holds no I/O: the API
(:class:`coordinator.api.service.Coordinator`) feeds it the jobs from the store and acts on its decisions, and
``bench/swarm_sim.py`` drives this same object with simulated clients, so the simulation cannot drift from
what the coordinator does.

Every long-polling request re-checks on each new version, so one version costs as many decisions as there are
clients waiting: a decision must not itself cost more with more of them. The paces of the waiting clients are kept
sorted (sortedcontainers.SortedList), so "how many waiting clients are faster than this one" is a binary search,
not a pass over the waiting set; a decision costs O(log W) in the W waiting clients (bench/swarm_sim.py measures it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from sortedcontainers import SortedList

from coordinator.core import pacing
from coordinator.core.leases import LeaseView, lease_live
from coordinator.core.scheduling import LeaseDecision, SyncPolicy, decide_lease


class Issuer:
    def __init__(self, policy: SyncPolicy, *, lease_timeout_s: float, speed_aware: bool = True) -> None:
        self.policy = policy
        self.lease_timeout_s = lease_timeout_s
        self.speed_aware = speed_aware
        self.pace: dict[str, float] = {}  # seconds from lease to result, per client (core.pacing)
        self._pace_observed: set[str] = set()  # clients whose pace comes from results, not a declaration
        self._waiting: dict[str, int] = {}  # long-polling clients → requests waiting
        # the ranks (core.pacing.rank) of the waiting clients whose pace is known, sorted; each one's as listed there
        self._waiting_paces: SortedList = SortedList()
        self._waiting_proven: SortedList = SortedList()  # those of them whose pace is measured (replicas go to them)
        self._listed: dict[str, pacing.Rank | None] = {}
        self._measured: SortedList = SortedList()  # the measured paces (the fastest is the declared paces' floor)
        self._measured_ids: set[str] = set()
        self._woken: set[str] = set()  # clients a new version woke to pull it (next_in_line), for that version
        self._woken_version = -1
        self.version_interval: float | None = None  # recent seconds between policy versions
        self._version_at: float | None = None

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
        """Change a client's pace, and where it waits, its place among the waiting clients' paces."""
        waiting = client_id in self._waiting
        if waiting:
            self._unlist(client_id)
        floor = self._floor()
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
        if waiting:
            self._list(client_id)
        if self._floor() != floor:  # the declared paces below the floor move with it: a pass over the waiting
            # newcomers (clients not yet measured: few, and only when the fastest measured pace changes)
            for cid in [c for c in self._listed if c not in self._pace_observed and c != client_id]:
                self._unlist(cid)
                self._list(cid)

    def _list(self, client_id: str) -> None:
        key = self._listed[client_id] = self.rank(client_id)
        if key is not None:
            self._waiting_paces.add(key)
            if key[1] == 0:  # measured (core.pacing.rank)
                self._waiting_proven.add(key)

    def _unlist(self, client_id: str) -> None:
        pace = self._listed.pop(client_id, None)  # the pace it was listed with, whatever ``pace`` says by now
        if pace is not None:
            self._waiting_paces.remove(pace)
            if pace[1] == 0:
                self._waiting_proven.remove(pace)

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
        if client_id not in self._waiting:
            self._list(client_id)
        self._waiting[client_id] = self._waiting.get(client_id, 0) + 1

    def end_wait(self, client_id: str) -> None:
        if client_id not in self._waiting:
            return
        left = self._waiting.pop(client_id) - 1
        if left > 0:
            self._waiting[client_id] = left
        else:
            self._unlist(client_id)

    @contextmanager
    def waiting(self, client_id: str) -> Iterator[None]:
        """While a lease request of ``client_id`` long-polls."""
        self.begin_wait(client_id)
        try:
            yield
        finally:
            self.end_wait(client_id)

    def waiting_clients(self) -> Iterable[str]:
        return self._waiting.keys()

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
        waiting = int(self._waiting_proven.bisect_left(mine)) if proven and mine is not None else \
            self._faster_waiting(mine)
        ahead = waiting + pacing.faster_count(mine, (self.rank(c) for c in woken_others if c not in self._waiting))
        if ahead >= b:
            return False  # B faster ones waiting or woken are ahead of it
        self._woken.add(client_id)
        return True

    def _faster_waiting(self, key: pacing.Rank | None) -> int:
        """How many waiting clients rank strictly ahead of ``key`` (unknown = last; core.pacing.faster_count over
        the waiting set, by binary search). The asking client, if it waits, is never counted: its own rank is not
        strictly ahead of itself, and an unknown one is not counted at all."""
        if key is None:
            return len(self._waiting_paces)
        return int(self._waiting_paces.bisect_left(key))

    def proven(self, client_id: str) -> bool:
        """Is this client's pace measured by its own results (not a declaration)?"""
        return client_id in self._pace_observed

    def proven_waiting(self) -> bool:
        """Is a client of measured pace long-polling for work (one a replica could go to)?"""
        return bool(self._waiting_proven)

    def with_due(self, view: LeaseView) -> LeaseView:
        """The lease with the times its holder is expected back and overdue (core.pacing), if its pace is known;
        whether that holder is unproven (core.scheduling.choose_replica); its replica's due time."""
        if view.lease_client is None or view.lease_deadline is None:
            return view
        pace = self.pace.get(view.lease_client)
        unproven = view.lease_client not in self._pace_observed
        if (pace is None and view.due_at is None and view.expected_at is None and view.replica is None
                and unproven == view.unproven):
            return view  # nothing to estimate (and a decision reads every active job: no copy)
        leased_at = view.lease_deadline - self.lease_timeout_s
        replica = view.replica
        if replica is not None:
            replica = replace(replica, due_at=pacing.due_at(replica.deadline - self.lease_timeout_s,
                                                            self.pace.get(replica.client), self.version_interval))
        return LeaseView(view.job_id, view.state, view.version, view.created_at, view.lease_id, view.lease_client,
                         view.lease_deadline, pacing.due_at(leased_at, pace, self.version_interval),
                         pacing.expected_back(leased_at, pace), view.verifying, replica, unproven)

    def speed_of(self, client_id: str, views: list[LeaseView], now: float) -> pacing.ClientSpeed:
        exploring = sum(1 for v in views if lease_live(v, now) and v.lease_client not in self.pace
                        and v.lease_client != client_id)
        mine = self.rank(client_id)
        proven = client_id in self._pace_observed
        return pacing.ClientSpeed(pace_s=self.pace.get(client_id), faster_waiting=self._faster_waiting(mine),
                                  exploring=exploring, step_s=self.version_interval, proven=proven,
                                  faster_proven_waiting=int(self._waiting_proven.bisect_left(mine))
                                  if proven and mine is not None else 0)

    def decide(self, client_id: str, views: list[LeaseView], queued: int, now: float, version: int,
               held_version: int, withheld: frozenset[str] = frozenset(),
               verifying: frozenset[str] = frozenset()) -> LeaseDecision | None:
        """core.scheduling.decide_lease with this client's speed, every lease's due times and whether its holder is
        proven, and the jobs whose result is being verified (``verifying``: never reissued, and each keeps its slot
        in the queue). A decision with ``replica`` is a second lease on a live job (core.scheduling.choose_replica)."""
        if verifying:
            views = [replace(v, verifying=True) if v.job_id in verifying else v for v in views]
        speed = None
        if self.speed_aware:
            views = [self.with_due(v) for v in views]
            speed = self.speed_of(client_id, views, now)
        return decide_lease(views, queued, now, version, held_version, self.policy, speed, withheld, client_id)
