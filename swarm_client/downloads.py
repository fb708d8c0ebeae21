"""The snapshot downloads a client makes besides the one a job needs: prefetching the version the coordinator
expects it to work on next (push-pull), pulling it while idle, and showing a transfer's progress.

Prefetch by need: a newer version is fetched ahead of a job only when a lease reply says ``prefetch``; any other
client fetches a version when a job needs it, so an idle swarm does not download every version. The fetch runs in
the background while the client generates with the version it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shared.errors import EchoSwarmError
from shared.messages import LeaseResponse
from swarm_client.blob_fetch import Transfer
from swarm_client.reporting import Reporter
from swarm_client.snapshots import SnapshotCache

#: the join loop's lines keep the logger name they always had in client.log (grep-able across versions)
logger = logging.getLogger("swarm_client.runner")

PULL_WAIT_S = 30.0  # longest an idle client waits for an announced version to arrive before asking again


class Downloads:
    """One run's background prefetch and its download progress, said and shown through ``reporter``."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.prefetch: asyncio.Task[object] | None = None
        self.ready_version = -1  # the newest version fetched and verified ahead of need (push-pull prefetch)
        self.prefetch_target = -1  # the newest version a lease reply asked this client to prefetch
        self._decile = -1

    def on_progress(self, transfer: Transfer | None) -> None:
        """The panel shows the transfer live; without a panel, a line at every tenth of a file."""
        stats = self.reporter.stats
        stats.download = "" if transfer is None else transfer.describe()
        if transfer is None or self.reporter.display.live or not transfer.total:
            self._decile = -1
            return
        decile = 10 * transfer.done // transfer.total
        if decile != self._decile:
            self._decile = decile
            self.reporter.say(f"downloading {stats.download}")

    def consider(self, resp: LeaseResponse, held: int, cache: SnapshotCache, run_id: str) -> bool:
        """Prefetch by need: start fetching the version the reply asks for when it says ``prefetch`` and is newer
        than ``held``. One runs at a time, and one asked for while another is running follows it. A failed prefetch
        is only logged (the job that needs the version fetches it again). True when the reply asked for a version
        newer than ``held``: an idle client then waits for it."""
        if not resp.prefetch or resp.current_version <= held:
            return False
        self.prefetch_target = max(self.prefetch_target, resp.current_version)
        if self.prefetch is None or self.prefetch.done():
            self.prefetch = asyncio.create_task(self._prefetch(cache, run_id))
        return True

    async def _prefetch(self, cache: SnapshotCache, run_id: str) -> object:
        """Fetch ``prefetch_target`` (and any newer one asked for meanwhile); the last folder, or None."""
        folder: object = None
        while self.ready_version < self.prefetch_target:
            version = self.prefetch_target
            try:
                folder = await cache.ensure(run_id, version, None)
            except (EchoSwarmError, OSError) as exc:
                logger.info("prefetch of version %d failed: %s", version, exc)
                return None
            self.ready_version = max(self.ready_version, version)
        return folder

    async def pulled(self, version: int) -> bool:
        """Wait (at most ``PULL_WAIT_S``) for the prefetch of an announced version; True once it is in hand.
        An idle client pulls before asking again, so its next job is generated with the newest weights."""
        if self.prefetch is not None and not self.prefetch.done():
            self.reporter.set_state("fetching")
            await asyncio.wait([self.prefetch], timeout=PULL_WAIT_S)
        return self.ready_version >= version

    def cancel(self) -> None:
        """No more prefetching (the run has finished): a fetch in progress is cancelled."""
        if self.prefetch is not None and not self.prefetch.done():
            self.prefetch.cancel()

    async def stop(self) -> None:
        """The client stops: cancel a fetch in progress and wait until it has let go of the cache."""
        if self.prefetch is not None and not self.prefetch.done():
            self.prefetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.prefetch
