"""The coordinator's shutdown is prompt: every role loop it cancels ends, whatever woke it just before."""

from __future__ import annotations

import asyncio

from tests.integration.conftest import LiveCoordinator

BOUND_S = 30.0  # the API's stop takes milliseconds; a stop that waits this long is one that would never end


def test_the_api_role_stops_at_once_when_the_bell_rang_just_before(live_coordinator: LiveCoordinator) -> None:
    """On shutdown the learner's cancelled step rings the bell (coordinator.roles.learner._record_step) a few loop
    iterations before the API role cancels its watch (coordinator.launch.one_process). The cancelled watch must
    end: with asyncio.wait_for in Bell.wait, Python 3.11 dropped that cancellation, the watch went on polling and
    runner.cleanup() never returned (the live_coordinator teardown hung 180 s in CI at 4bd8ead)."""
    coord = live_coordinator.coordinator
    assert live_coordinator.loop is not None

    async def ring_then_stop() -> None:
        coord.bell.ring()
        await asyncio.wait_for(coord.stop(), BOUND_S)

    asyncio.run_coroutine_threadsafe(ring_then_stop(), live_coordinator.loop).result(2 * BOUND_S)
