"""One machine, several runs: the generation slot handed between coordinators by resource share (BOINC's).

A volunteer attached to several coordinators (`join URL --attach URL2=SHARE`) has one machine: generating two jobs at
once would only make each slower (both backends want every core). So each run leases and fetches on its own, but
generation takes a *turn* on the machine, one run at a time, and when the machine is free the turn goes to the run
waiting with a job that is furthest behind its share — BOINC's "debt": a run's share of all the work done so far,
minus the work it had. A run with no job in hand does not compete, so a coordinator that has no work for the moment
(its learner stepping, its run finished) leaves the machine to the others instead of holding it; it comes first
again once it has a job.

**Work is counted in floating-point operations**: each generated token costs two per model parameter (a forward
pass's multiply-adds), as BOINC counts a project's recent estimated credit in FLOPs, not seconds. Seconds were tried
first: a run's jobs took up to 43 % longer per token than the other's on the same machine (each run's coordinator
verifying beside it, a run's first jobs warming its own model), so 3:1 in seconds gave 3.2–4.0:1 in results
(tests/integration/test_shares.py; tokens: 2.8–3.0). For runs of one model size that is a count of tokens, the unit of
the credit the coordinators grant; a run of a model four times the size gets a quarter of the tokens for the same
share, as its tokens cost four times the machine's work. A turn whose model size is unknown counts one per token.

**Only the run on the machine holds its model in memory** (BOINC's default: a suspended task leaves memory). When a
run's turn begins, every other run's model is unloaded (:meth:`Shares.holds_model`), and a run loads its own inside its
turn: two runs of a 7 B model would otherwise keep two copies in RAM for one generation at a time. A run's backend
is touched only inside its turns (the runner loads, benchmarks and generates there), so unloading it from another
run's turn never races with it. Switching costs a load from the local cache each time the machine changes runs;
`join --keep-models` (BOINC's "leave tasks in memory while suspended") keeps every run's model instead, for a
volunteer whose memory holds them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

logger = logging.getLogger(__name__)
GRACE_S = 5.0  # how long the machine waits for a run that is behind its share and fetching its next job


@dataclass
class RunShare:
    name: str
    share: float
    used: float = 0.0  # work this run had: floating-point operations (Turn.per_token × tokens)
    used_s: float = 0.0  # and generation seconds
    turns: int = 0
    fetching_since: float | None = None  # getting its next job (after a turn, until it has one or has none)

    def debt(self, total_used: float, total_share: float) -> float:
        return self.share / total_share * total_used - self.used


class Shares:
    """The machine's generation slot among the runs of one client process (one asyncio loop)."""

    def __init__(self, shares: dict[str, float], clock: Callable[[], float] = time.monotonic,
                 grace_s: float = GRACE_S, keep_models: bool = False) -> None:
        if not shares or any(s <= 0 for s in shares.values()):
            raise ValueError(f"every run needs a positive share, got {shares}")
        self.runs = {name: RunShare(name, share) for name, share in shares.items()}
        self.clock = clock
        self.grace_s = grace_s
        self.keep_models = keep_models  # every run's model stays loaded between its turns (no unloading)
        self._busy: str | None = None  # the run generating now
        self._waiting: list[str] = []  # runs with a job in hand, waiting for the machine, in arrival order
        self._changed = asyncio.Condition()
        self._unload: dict[str, Callable[[], None]] = {}  # each run's way to free its model (holds_model)
        self._loaded: set[str] = set()  # runs whose model may be in memory: those that had a turn since unloaded

    def holds_model(self, name: str, unload: Callable[[], None]) -> None:
        """``name``'s model is freed by ``unload`` (its backend's) whenever another run's turn begins (never with
        ``keep_models``)."""
        if not self.keep_models:
            self._unload[name] = unload

    def _next(self) -> tuple[str | None, float | None]:
        """(the waiting run to go now, or None; how long to wait before looking again, None: until told).

        The machine goes to the run furthest behind its share among those waiting with a job — or, when that is a
        run that has just had a turn and is fetching its next job, it waits up to ``grace_s`` for it: each run holds
        one job at a time, and without the wait the run that just finished would never be waiting when the machine
        frees, so the turns would alternate whatever the shares."""
        if self._busy is not None or not self._waiting:
            return None, None
        now = self.clock()
        total_used = sum(r.used for r in self.runs.values())
        total_share = sum(r.share for r in self.runs.values())
        fetching = [r.name for r in self.runs.values()
                    if r.fetching_since is not None and now - r.fetching_since < self.grace_s]
        candidates = self._waiting + [n for n in fetching if n not in self._waiting]
        best = max(candidates, key=lambda n: (self.runs[n].debt(total_used, total_share),
                                              -candidates.index(n)))
        if best in self._waiting:
            return best, None
        since = self.runs[best].fetching_since
        assert since is not None
        return None, max(0.0, since + self.grace_s - now)

    def no_job(self, name: str) -> None:
        """``name`` asked for work and got none (or stopped): the machine does not wait for it."""
        self.runs[name].fetching_since = None
        self._poke()

    def _poke(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):  # no running loop: nobody can be waiting
            asyncio.get_running_loop().create_task(notify())

    @asynccontextmanager
    async def turn(self, name: str) -> AsyncIterator[Turn]:
        """Wait for ``name``'s turn on the machine and hold it for the body (a job's generation), which reports the
        work it did (``Turn.tokens`` at ``Turn.per_token``): that counts against its share."""
        run = self.runs[name]
        async with self._changed:
            self._waiting.append(name)
            run.fetching_since = None
            self._changed.notify_all()
            try:
                while True:
                    go, wait_s = self._next()
                    if go == name:
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), wait_s)
            except BaseException:  # stopped while waiting: the others may now be next
                self._waiting.remove(name)
                self._changed.notify_all()
                raise
            self._waiting.remove(name)
            self._busy = name
        start, turn = self.clock(), Turn()
        try:
            for other in sorted(self._loaded - {name}):  # idle outside their turns: nothing else touches them
                await asyncio.to_thread(self._unload[other])
                self._loaded.discard(other)
                logger.info("unloaded %s's model: %s has the machine", other, name)
            if name in self._unload:
                self._loaded.add(name)
            yield turn
        finally:
            run.used += turn.tokens * turn.per_token
            run.used_s += self.clock() - start
            run.turns += 1
            run.fetching_since = self.clock()  # presumably back in a moment with its next job
            async with self._changed:
                self._busy = None
                self._changed.notify_all()

    def view(self) -> list[dict[str, object]]:
        """Each run's share, the share of the work (FLOPs) and of the generation time it had so far, and its turns
        (for status.json, `client status` and the control page)."""
        total = sum(r.used for r in self.runs.values()) or 1.0
        total_s = sum(r.used_s for r in self.runs.values()) or 1.0
        total_share = sum(r.share for r in self.runs.values())
        return [{"run": r.name, "share": r.share, "share_fraction": r.share / total_share,
                 "work_fraction": r.used / total, "time_fraction": r.used_s / total_s, "turns": r.turns}
                for r in self.runs.values()]


@dataclass
class Turn:
    """One turn on the machine: the body says how much work it did — tokens, and what each cost."""

    tokens: int = 0
    per_token: float = 1.0  # floating-point operations per generated token: 2 × the model's parameters
