"""Results being verified, so that a resend of one joins its verification instead of starting another.

A client whose upload gets no answer within its request timeout (the verifiers busy with other work: minutes at a
7 B shape) sends the same result again. Verifying each copy would spend the recompute again, and every copy after
the first accepted one would then be refused (its lease closed by the first), counting refusals against an honest
volunteer. Here a submission is keyed by who sent it, for which job, and the sha256 of its body bytes; while one is
in verification, a submission with the same key waits for that verification and gets its verdict — the same
acceptance, or the same refusal (recorded once, by the verification itself). Each verification runs as a task of
its own, so a client that hangs up does not cancel it: its verdict is recorded and waits in the store for the next
resend (a resend after the acceptance is answered from the store, coordinator.api.intake.Intake.submit).

Per API process: a resend that reaches another API process of the same store is verified there (and then refused
or answered from the store, as before this existed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, KeysView

from shared.messages import SubmitResponse

#: (client id, job id, sha256 of the submitted body)
Key = tuple[str, str, str]


class Verdicts:
    """The verifications in flight in this API process, and how many submissions started or joined one."""

    def __init__(self) -> None:
        self._running: dict[Key, asyncio.Task[SubmitResponse]] = {}
        self.started = 0  # submissions whose verification this process ran
        self.joined = 0  # submissions that waited for a verification already running for the same result

    async def once(self, key: Key, verify: Callable[[], Awaitable[SubmitResponse]]) -> SubmitResponse:
        """``verify()``'s verdict for ``key``: started now, or the one already running for the same result."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(verify())
            self._running[key] = task
            self.started += 1
            task.add_done_callback(lambda done: self._done(key, done))
        else:
            self.joined += 1
        # shield: a waiter cancelled (its client hung up) leaves the verification running for the others
        return await asyncio.shield(task)

    def _done(self, key: Key, task: asyncio.Task[SubmitResponse]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: a refusal nobody waited for any more is no "never retrieved" warning

    def __len__(self) -> int:
        return len(self._running)

    async def close(self) -> None:
        """Cancel what is still being verified (the API is stopping; the clients resend to its successor)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Verifying:
    """Jobs whose result is being verified (job id → submissions in verification): never reissued meanwhile
    (coordinator.api.leasing), so a lease that runs out while the coordinator is busy verifying does not cost the
    honest holder."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    @contextlib.contextmanager
    def held(self, job_id: str) -> Iterator[None]:
        """While a submission for ``job_id`` is in verification."""
        self._count[job_id] = self._count.get(job_id, 0) + 1
        try:
            yield
        finally:
            left = self._count.pop(job_id) - 1
            if left > 0:
                self._count[job_id] = left

    def jobs(self) -> KeysView[str]:
        return self._count.keys()
