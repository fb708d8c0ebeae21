"""A lease is bound to the newest version the learner committed, even when the API's own view lags behind it.

Why: the learner prunes versions ``snapshots.keep_last`` behind its current one, keeping those under a live lease
(core.leases.kept_versions) — but it can only keep a lease it has seen. An API whose watch lags (a busy event loop)
once bound new leases to the version it last saw, which the learner could prune right after, under the client's
lease (CI, stop 27: an honest download ended in HTTP 404). The API now reads the store's newest version per lease.
"""

from __future__ import annotations

import asyncio

from shared import wire
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import wait_until
from tests.integration.ops_helpers import fetch_snapshot, honest_result, lease, register


def test_a_lease_binds_the_learners_newest_version_when_the_apis_watch_lags(live_coordinator: LiveCoordinator
                                                                           ) -> None:
    live = live_coordinator
    coord = live.coordinator
    assert live.loop is not None
    client = register(live)
    fetch_snapshot(live, 0)
    jobs = [lease(client, coord.public_key), lease(client, coord.public_key)]

    async def stop_watch() -> None:  # the API no longer follows the learner on its own
        watcher = coord._watcher
        assert watcher is not None
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(stop_watch(), live.loop).result(30)
    for job in jobs:
        status, raw = client.post("/v1/results", wire.encode(honest_result(live, job)))
        assert status == 200, raw
    # two results fill one step: the learner commits version 1, which this API has not seen
    wait_until(lambda: coord.store.versions.current() == 1, 120, "the learner to commit version 1")
    assert coord.version == 0

    job = lease(client, coord.public_key)
    assert job.version == 1 and coord.version == 1
