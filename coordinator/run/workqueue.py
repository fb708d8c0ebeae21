"""Verification and evaluation requests between role processes, through the store's ``work`` table.

The API process asks for a recompute by writing a request row; a verifier worker (:mod:`coordinator.roles.verifier`,
in its own process or the same one) claims a batch of rows, answers them, and the API picks the answer up. The
learner asks for held-out evaluations the same way. Requests and answers are the records coordinator.store.hops
declares for each kind, encoded and decoded by their type. Going through the database, not
a socket, is what lets any role be killed and restarted on its own: a claim runs out and another worker (or the
restarted one) takes the row; a restarted API drops the requests nobody waits for any more.

A :class:`Bell` wakes the waiting side at once: within one process directly, between the processes of one host
through coordinator.run.doorbell. Every waiter also looks at the store every ``POLL_S`` (roles on other hosts of a
PostgreSQL store rely on that alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.core.verify import TokenStats
from coordinator.errors import VersionGone
from coordinator.run.doorbell import Doorbell, folder_for
from coordinator.store.hops import RECOMPUTE, Ans, Engine, RecomputeRequest, Req, WorkKind
from coordinator.store.store import Store
from coordinator.store.work_rows import WorkState
from shared.sampler import Segment

if TYPE_CHECKING:
    from coordinator.run.doorbell import Doorbell

#: Seconds between looks at the store when another process may have changed it.
POLL_S = 0.02


class Bell:
    """Wakes every waiter in this process when a role changed the store (new result, new version, an answer); once
    :meth:`connect`-ed, also every other role process of the run on this host (coordinator.run.doorbell)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._doorbell: Doorbell | None = None

    def connect(self, run_dir: Path, name: str) -> bool:
        """Ring and be rung across processes (call on the running loop); False: this process polls only."""
        folder = folder_for(run_dir)
        if folder is None or self._doorbell is not None:
            return self._doorbell is not None
        doorbell = Doorbell(folder, name, self._wake)
        if doorbell.open():
            self._doorbell = doorbell
        return self._doorbell is not None

    def close(self) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None

    def ring(self) -> None:
        self._wake()
        if self._doorbell is not None:
            self._doorbell.send()

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next ring or ``timeout`` seconds. A cancellation always ends it: ``asyncio.timeout``, not
        ``asyncio.wait_for``, whose Python 3.11 version returns normally when the task is cancelled in the loop
        iteration its awaited event completes (CPython gh-86296), and a role loop cancelled within two iterations of
        a ring (the learner's cancelled step rings on shutdown) would then wait again for ever, hanging the
        shutdown that awaits it."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()


class VerifierUnavailable(RuntimeError):
    """No verifier answered in time (none running, or all busy far beyond normal)."""


class VerificationError(RuntimeError):
    """A verifier failed on this request (its message says why)."""


@dataclass
class RemoteStats:
    recompute_s: float = 0.0  # seconds this process waited for recompute answers


class RemoteVerifier:
    """The API's handle on the verifier role: the same calls as :class:`coordinator.engine.verifier.Verifier`, answered by
    whichever verifier worker claims the request."""

    def __init__(self, store: Store, bell: Bell, *, wait_s: float) -> None:
        self.store = store
        self.bell = bell
        self.wait_s = wait_s
        self.stats = RemoteStats()
        self.requester = "api"  # the asking API process's name (Coordinator.api_name), kept with each request

    async def recompute_stats(self, prompts: list[list[int]], completions: list[list[int]], version: int,
                              segments: list[list[Segment]] | None = None, *, engine: Engine = "torch",
                              group: int = 1, precision: str | None = None) -> TokenStats:
        """``engine``: "llama" recomputes with llama.cpp on the version's GGUF file of ``precision`` (None: the
        run's default; a llama.cpp client's result, coordinator.engine.llama_verifier, which replays the client's
        evaluations: ``group`` completions per prompt); "torch-bf16" replays a bf16 torch client's generations in
        bf16 (coordinator.engine.torch_replay; the ``segments`` say which rows were generated together, ``group``
        and ``precision`` are not used); "torch" one float32 pass from its safetensors."""
        t0 = time.monotonic()
        try:
            answer = await self.ask(RECOMPUTE, version, RecomputeRequest(
                prompts=prompts, completions=completions, segments=segments, engine=engine, group=group,
                precision=precision))
        finally:
            self.stats.recompute_s += time.monotonic() - t0
        if answer.gone or answer.stats is None:
            raise VersionGone(f"policy version {version} is no longer kept for verification")
        return answer.stats.token_stats()

    async def ask(self, kind: WorkKind[Req, Ans], version: int, request: Req) -> Ans:
        """Queue ``request`` (a verifier decodes it by ``kind``) and wait for its answer."""
        if kind.answer is None:
            raise TypeError(f"nobody answers a {kind.name} request: submit it to the store instead")
        item = self.store.work.submit(kind, version, request, time.time(), self.requester)
        self.bell.ring()
        give_up = time.monotonic() + self.wait_s
        try:
            while True:
                row = self.store.work.item(item)
                if row is None:
                    raise VerificationError("the request was dropped (the verifier queue was reset)")
                if row["state"] == WorkState.DONE:
                    return kind.answer.decode(row["answer"])
                if row["state"] == WorkState.FAILED:
                    raise VerificationError(str(row["error"]))
                if time.monotonic() > give_up:
                    raise VerifierUnavailable(f"no verifier answered within {self.wait_s:.0f}s")
                await self.bell.wait(POLL_S)
        finally:
            self.store.work.delete([item])

    def close(self) -> None:
        """Nothing to release: requests in flight are deleted by their waiters."""


def engine_of(rclass: str) -> Engine:
    """The engine that recomputes a result of class ``rclass`` (core.trust.recompute_class): llama.cpp for every
    "llama-<precision>", the bf16 replay for "torch-bf16", the float32 torch pass otherwise."""
    return "llama" if rclass.startswith("llama-") else "torch-bf16" if rclass == "torch-bf16" else "torch"
