"""How a leased job ends: its result submitted (in the background, while the next job generates), or the lease
released so the job is reissued at once — and the back-off after a streak of refusals that were about the
coordinator's state rather than this client's result.

At most one submission is in flight, so a refusal is seen one job later at worst; a refusal that ends the client
(banned, quarantined) propagates from :meth:`Submissions.settle`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from shared.endpoints import RELEASE, RESULTS
from shared.errors import EchoSwarmError, ProtocolError, Reason
from shared.messages import Job, ReleaseRequest, ResultSubmission
from swarm_client.api import CoordinatorClient, refusal_code
from swarm_client.lifetime import Lifetime
from swarm_client.reporting import Reporter

STOP_CODES = {"banned", "quarantined"}  # refusals that end the client: retrying cannot help
#: Refusals that say nothing about this client's result (the coordinator's timing or state: a version pruned, a
#: verifier busy, a lease run out or reissued): retried as usual, but after a streak of them the client backs off
#: (:func:`setback_delay`) instead of computing one job after another that meets the same refusal.
SETBACKS = {Reason.VERSION_RETIRED, Reason.UNAVAILABLE, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER,
            Reason.JOB_COMPLETED, Reason.REWARD_FAILED}
SETBACK_GRACE = 2  # setbacks in a row taken without a pause
SETBACK_MAX_S = 300.0
HISTORY = 20  # results kept in the status for the control page


def setback_delay(streak: int) -> float:
    """Seconds to wait before the next lease after ``streak`` setbacks in a row: none for the first SETBACK_GRACE,
    then 5 s doubling up to SETBACK_MAX_S. An accepted result ends the streak."""
    return 0.0 if streak <= SETBACK_GRACE else min(SETBACK_MAX_S, 5.0 * 2 ** (streak - SETBACK_GRACE - 1))


class Submissions:
    """One run's results and releases. ``url``: the coordinator's, for the ``lifetime`` ledger; ``reporter``: the
    counters, history and lines a verdict updates; ``stop``: what ends a back-off early."""

    def __init__(self, url: str, reporter: Reporter, lifetime: Lifetime, stop: threading.Event) -> None:
        self.url = url
        self.reporter = reporter
        self.lifetime = lifetime
        self.stop = stop
        # called with (monotonic seconds, job, tokens) for each accepted result: bench/client_overhead.py times
        # the real loop with it
        self.on_result: Callable[[float, Job, int], None] | None = None
        self._submitting: asyncio.Task[None] | None = None  # the previous job's result, submitted in the background
        self._setbacks = 0  # refusals in a row that were not about this client's result (SETBACKS)

    @property
    def in_flight(self) -> bool:
        return self._submitting is not None

    async def send(self, api: CoordinatorClient, job: Job, sub: ResultSubmission, n_tok: int, elapsed: float) -> None:
        """Submit ``sub`` in the background, once the previous submission has been answered."""
        await self.settle()
        self._submitting = asyncio.create_task(self._submit(api, job, sub, n_tok, elapsed))

    async def settle(self) -> None:
        """Wait for the submission in flight, if any; a refusal that ends the client propagates from here."""
        task, self._submitting = self._submitting, None
        if task is not None:
            await task

    async def _submit(self, api: CoordinatorClient, job: Job, sub: ResultSubmission, n_tok: int,
                      elapsed: float) -> None:
        stats = self.reporter.stats
        job_id, lease_id = job.job_id, job.lease_id
        entry: dict[str, object] = {"at": time.time(), "job": job_id, "version": job.version, "tokens": n_tok,
                                    "seconds": round(elapsed, 2)}
        try:
            res = await api.call(RESULTS, sub)
            self._setbacks = 0
            stats.accepted += 1
            stats.credit = res.total_credit
            stats.tokens += n_tok
            self.lifetime.result(self.url, stats.run_id, job.client_id, accepted=True, total_credit=res.total_credit)
            entry |= {"outcome": "accepted", "credit": res.credit}
            if self.on_result is not None:
                self.on_result(time.monotonic(), job, n_tok)
        except ProtocolError as exc:
            if refusal_code(exc) in STOP_CODES:
                raise
            stats.rejected += 1
            self.lifetime.result(self.url, stats.run_id, job.client_id, accepted=False)
            self._setbacks = self._setbacks + 1 if exc.reason in SETBACKS else 0
            code = refusal_code(exc)
            stats.rejections[code] = stats.rejections.get(code, 0) + 1
            entry |= {"outcome": code, "credit": 0.0}
            self.reporter.say(f"result for {job_id} refused ({code}): {exc.message}")
            if exc.reason not in (Reason.JOB_COMPLETED, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER):
                await self.release(api, job_id, lease_id)
        stats.history = [*stats.history, entry][-HISTORY:]
        stats.tokens_per_s = n_tok / max(elapsed, 1e-9)
        self.reporter.display.update(line=True)
        self.reporter.write_status()

    async def release(self, api: CoordinatorClient, job_id: str, lease_id: str) -> None:
        """Hand a leased job back so the coordinator reissues it at once (best effort: else after its deadline)."""
        try:
            await asyncio.wait_for(api.call(RELEASE, ReleaseRequest(job_id=job_id, lease_id=lease_id)), timeout=5)
        except (TimeoutError, EchoSwarmError) as exc:
            self.reporter.say(f"could not release job {job_id} ({exc}); it will be reissued after its deadline")

    async def back_off(self) -> bool:
        """After a streak of refusals on the coordinator's side, wait before the next job (setback_delay); True if
        the client was stopped meanwhile."""
        if (pause := setback_delay(self._setbacks)) <= 0:
            return False
        self.reporter.warn(f"{self._setbacks} results in a row refused for reasons on the coordinator's side; "
                           f"waiting {pause:g}s before the next job")
        self.reporter.set_state("backing off")
        await asyncio.to_thread(self.stop.wait, pause)
        return self.stop.is_set()
