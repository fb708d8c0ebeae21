"""The clients long-polling for work, kept in rule 1's order (core.pacing): the issuer's waiting set.

Every long-polling lease request re-checks when something changes (a version, a lease released or expired), so a
swarm of W waiting clients would cost W decisions each time — 10,000 at the swarm sizes the project is for — though
only a few of them can be given anything. A slot goes to a client only while fewer strictly faster clients wait than
there are free slots (core.pacing.may_take_slot), a replica only while fewer faster measured clients wait than there
are jobs to replicate (core.scheduling.choose_replica), and both are bounded by the queue's B·(S+1) jobs. So the
waiting clients are kept sorted by rank (core.pacing.rank, then the order they began waiting, as the long polls
re-check), and :meth:`Waiting.candidates` names the few at the head that a re-check could serve: the decisions a
wake-up costs do not grow with the swarm (coordinator.api.leasing wakes the others without a decision; bench/
swarm_sim.py re-checks only the candidates). Counting the faster waiting clients is a binary search.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from sortedcontainers import SortedList

from coordinator.core import pacing

#: A waiting client as listed in the sorted sets: its rank (core.pacing.Rank), then its wait number.
_Entry = tuple[float, int, int]


class Waiting:
    """The waiting clients. ``window``: how far down rule 1's order a client may stand and still be served (None:
    no speed-aware issuance, first come first served: every waiting client is a candidate)."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self._requests: dict[str, int] = {}  # long-polling clients → requests waiting
        self._paces: SortedList = SortedList()  # the entries of the waiting clients of known pace
        self._proven: SortedList = SortedList()  # those of them whose pace is measured (replicas go to them)
        self._listed: dict[str, _Entry | None] = {}  # each one's entry as listed there (None: unknown pace)
        self._unknown: dict[str, None] = {}  # the waiting clients of unknown pace, in the order they began waiting
        self._no: dict[str, int] = {}  # each waiting client's wait number, and who holds it
        self._by_no: dict[int, str] = {}
        self._next_no = 0

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._requests

    def clients(self) -> Iterable[str]:
        return self._requests.keys()

    def begin(self, client_id: str, rank: pacing.Rank | None) -> None:
        """A lease request of ``client_id`` (ranked ``rank``) starts long-polling; requests of one client are
        counted, and it keeps its place from its first."""
        if client_id not in self._requests:
            self._no[client_id] = self._next_no
            self._by_no[self._next_no] = client_id
            self._next_no += 1
            self._list(client_id, rank)
        self._requests[client_id] = self._requests.get(client_id, 0) + 1

    def end(self, client_id: str) -> None:
        """A lease request of ``client_id`` stops waiting (one that never began changes nothing)."""
        if client_id not in self._requests:
            return
        left = self._requests.pop(client_id) - 1
        if left > 0:
            self._requests[client_id] = left
        else:
            self._unlist(client_id)
            del self._by_no[self._no.pop(client_id)]

    def rerank(self, client_id: str, rank: pacing.Rank | None) -> None:
        """A waiting client's rank changed (its pace, or the floor under declared paces)."""
        if client_id in self._requests:
            self._unlist(client_id)
            self._list(client_id, rank)

    def _list(self, client_id: str, rank: pacing.Rank | None) -> None:
        entry = self._listed[client_id] = None if rank is None else (rank[0], rank[1], self._no[client_id])
        if entry is None:
            self._unknown[client_id] = None
        else:
            self._paces.add(entry)
            if entry[1] == 0:  # measured (core.pacing.rank)
                self._proven.add(entry)

    def _unlist(self, client_id: str) -> None:
        entry = self._listed.pop(client_id, None)  # the entry it was listed with, whatever its pace is by now
        self._unknown.pop(client_id, None)
        if entry is not None:
            self._paces.remove(entry)
            if entry[1] == 0:
                self._proven.remove(entry)

    def faster(self, rank: pacing.Rank | None, *, proven: bool = False) -> int:
        """How many waiting clients (measured ones only, with ``proven``) rank strictly ahead of ``rank`` (unknown:
        last; core.pacing.faster_count over the waiting set, by binary search). A client's own rank is not strictly
        ahead of itself, and an unknown one is not counted at all."""
        entries = self._proven if proven else self._paces
        return len(entries) if rank is None else int(entries.bisect_left(rank))

    def any_proven(self) -> bool:
        return bool(self._proven)

    def candidates(self) -> list[str]:
        """The waiting clients a re-check could give a job, a replica or a prefetch to, in the order they are
        served (rank, equals in the order they began waiting, unknown paces last): the head of the order and of
        the measured clients' order, ``window`` each (and equals of the last), and the first ``window`` of unknown
        pace while fewer than ``window`` of known pace wait (an unknown pace is served after every known one).
        Every other waiting client would be refused. Without a window, every waiting client in arrival order."""
        if self.window is None:
            return list(self._requests)
        n = self.window
        picked = set(self._head(self._paces, n)) | set(self._head(self._proven, n))
        order = [self._by_no[e[2]] for e in sorted(picked)]
        if len(self._paces) < n:
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
        """Is this client one of :meth:`candidates` (or not waiting at all)? O(log W) in the W waiting clients."""
        if self.window is None or client_id not in self._requests:
            return True
        entry = self._listed.get(client_id)
        if entry is None:
            return len(self._paces) < self.window
        rank = (entry[0], entry[1])
        return self.faster(rank) < self.window or entry[1] == 0 and self.faster(rank, proven=True) < self.window
