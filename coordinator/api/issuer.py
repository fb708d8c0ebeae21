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

import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from sortedcontainers import SortedList

from coordinator.core import pacing
from coordinator.core.leases import LeaseView
from coordinator.core.queue_index import QueueIndex
from coordinator.core.scheduling import LeaseDecision, SyncPolicy, decide_lease

#: A waiting client as listed in the sorted waiting sets: its rank (core.pacing.Rank), then its wait number.
_Entry = tuple[float, int, int]


class Issuer:
    def __init__(self, policy: SyncPolicy, *, lease_timeout_s: float, speed_aware: bool = True) -> None:
        self.policy = policy
        self.lease_timeout_s = lease_timeout_s
        self.speed_aware = speed_aware
        self.pace: dict[str, float] = {}  # seconds from lease to result, per client (core.pacing)
        self._pace_observed: set[str] = set()  # clients whose pace comes from results, not a declaration
        self._waiting: dict[str, int] = {}  # long-polling clients → requests waiting
        # the waiting clients whose pace is known as (rank, wait number): core.pacing.rank, then the order they began
        # waiting (equals are served in that order, as the long polls re-check); each one's as listed there
        self._waiting_paces: SortedList = SortedList()
        self._waiting_proven: SortedList = SortedList()  # those of them whose pace is measured (replicas go to them)
        self._listed: dict[str, _Entry | None] = {}
        self._unknown: dict[str, None] = {}  # the waiting clients of unknown pace, in the order they began waiting
        self._wait_no: dict[str, int] = {}  # each waiting client's wait number, and who holds it
        self._by_no: dict[int, str] = {}
        self._next_no = 0
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
        """Change a client's pace, and where it waits, its place among the waiting clients' paces."""
        waiting = client_id in self._waiting
        if waiting:
            self._unlist(client_id)
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
        if waiting:
            self._list(client_id)
        if self._floor() != floor:  # the declared paces below the floor move with it: a pass over the waiting
            # newcomers (clients not yet measured: few, and only when the fastest measured pace changes)
            for cid in [c for c in self._listed if c not in self._pace_observed and c != client_id]:
                self._unlist(cid)
                self._list(cid)

    def _list(self, client_id: str) -> None:
        key = self.rank(client_id)
        entry = self._listed[client_id] = None if key is None else (key[0], key[1], self._wait_no[client_id])
        if entry is None:
            self._unknown[client_id] = None
        else:
            self._waiting_paces.add(entry)
            if entry[1] == 0:  # measured (core.pacing.rank)
                self._waiting_proven.add(entry)

    def _unlist(self, client_id: str) -> None:
        entry = self._listed.pop(client_id, None)  # the entry it was listed with, whatever ``pace`` says by now
        self._unknown.pop(client_id, None)
        if entry is not None:
            self._waiting_paces.remove(entry)
            if entry[1] == 0:
                self._waiting_proven.remove(entry)

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
            self._wait_no[client_id] = self._next_no
            self._by_no[self._next_no] = client_id
            self._next_no += 1
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
            del self._by_no[self._wait_no.pop(client_id)]

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

    def window(self) -> int:
        """How far down rule 1's order a waiting client may stand and still be given something: a slot goes to a
        client only while fewer strictly faster ones wait than there are free slots (core.pacing.may_take_slot),
        and a replica only while fewer faster measured ones wait than there are jobs to replicate
        (core.scheduling.choose_replica); both are at most the queue's B·(S+1). The factor 2: within one wake-up
        a replica given to a faster client takes it out of the waiting set without taking a slot, so a slower one
        moves up while the free slots stay; at most one replica per job in the queue. Everyone, without speed-aware
        issuance (first come, first served)."""
        if not self.speed_aware:
            return len(self._waiting)
        return 2 * self.policy.jobs_per_step * (self.policy.bound + 1)

    def candidates(self) -> list[str]:
        """The waiting clients a re-check could give a job, a replica or a prefetch (``next_in_line``) to, in the
        order the coordinator serves them (rule 1's rank, equals in the order they began waiting, unknown paces
        last); every other waiting client would be refused, so it need not re-check. About 3 × :meth:`window`
        clients (and equals of the last) however many wait: the decisions per wake-up do not grow with the swarm. Without speed-aware
        issuance, every waiting client in the order they began waiting."""
        if not self.speed_aware:
            return list(self._waiting)
        n = self.window()
        picked = set(self._head(self._waiting_paces, n)) | set(self._head(self._waiting_proven, n))
        order = [self._by_no[e[2]] for e in sorted(picked)]
        if len(self._waiting_paces) < n:  # an unknown pace is served after every known one (rule 1)
            order += list(itertools.islice(self._unknown, n))
        return order

    @staticmethod
    def _head(entries: SortedList, n: int) -> list[_Entry]:
        """The first ``n`` entries, and any after them that rank equal to the n-th (rule 1 counts only strictly
        faster clients as ahead, so equals of the last one may still be served)."""
        head: list[_Entry] = list(entries.islice(0, n))
        if len(head) == n and n > 0:
            last = head[-1][:2]
            head += itertools.takewhile(lambda e: e[:2] == last, entries.islice(n))
        return head

    def in_window(self, client_id: str) -> bool:
        """Could a re-check of this waiting client's request give it anything (one of :meth:`candidates`)? O(log W)
        in the W waiting clients."""
        if not self.speed_aware or client_id not in self._waiting:
            return True
        n = self.window()
        entry = self._listed.get(client_id)
        if entry is None:
            return len(self._waiting_paces) < n
        key = entry[:2]
        return (self._waiting_paces.bisect_left(key) < n
                or entry[1] == 0 and self._waiting_proven.bisect_left(key) < n)

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
        return pacing.ClientSpeed(pace_s=self.pace.get(client_id), faster_waiting=self._faster_waiting(mine),
                                  exploring=index.exploring(now, client_id), step_s=self.version_interval,
                                  proven=proven, faster_proven_waiting=int(self._waiting_proven.bisect_left(mine))
                                  if proven and mine is not None else 0)

    def index(self, views: Sequence[LeaseView], version: int,
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
        index = self.index(views, version, verifying)
        speed = self.speed_of(client_id, index, now) if self.speed_aware else None
        return decide_lease(index, queued, now, version, held_version, self.policy, speed, withheld, client_id)
