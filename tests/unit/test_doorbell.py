"""The doorbell: a ring in one role process wakes the others' waiters at once; a dead process's socket is
cleaned up; without a usable socket a role falls back to polling."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.run.doorbell import Doorbell, folder_for
from coordinator.run.workqueue import Bell

LONG = 60.0  # a waiter's poll interval in these tests: far longer than any test waits, so only a ring ends it


def test_a_ring_in_one_process_wakes_a_waiter_in_another(tmp_path: Path) -> None:
    """A separate Python process connects its Bell to the run and waits with a one-minute poll; our ring ends
    its wait (it prints how many rings it received), long before the minute."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import asyncio, sys
            from pathlib import Path
            from coordinator.run.workqueue import Bell

            async def main():
                bell = Bell()
                assert bell.connect(Path({str(tmp_path)!r}), "verifier-0")
                waiting = asyncio.create_task(bell.wait({LONG}))
                print("ready", flush=True)
                await asyncio.wait_for(waiting, {LONG / 2})
                print("woken", bell._doorbell.received, flush=True)
                bell.close()

            asyncio.run(main())
        """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"

        async def ring() -> None:
            bell = Bell()
            assert bell.connect(tmp_path, "api")
            bell.ring()
            bell.close()

        asyncio.run(ring())
        assert child.stdout.readline().split() == ["woken", "1"]
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_rings_reach_every_other_process_but_not_the_ringer(tmp_path: Path) -> None:
    async def main() -> None:
        api, learner, verifier = Bell(), Bell(), Bell()
        for bell, name in ((api, "api"), (learner, "learner"), (verifier, "verifier-0")):
            assert bell.connect(tmp_path, name)
        try:
            waits = [asyncio.create_task(b.wait(LONG)) for b in (learner, verifier)]
            await asyncio.sleep(0)
            api.ring()
            await asyncio.wait_for(asyncio.gather(*waits), LONG / 2)
            assert [b._doorbell.received for b in (api, learner, verifier)] == [0, 1, 1]  # type: ignore[union-attr]
            assert api._doorbell.sent == 2  # type: ignore[union-attr]
        finally:
            for b in (api, learner, verifier):
                b.close()
        assert sorted(os.listdir(folder_for(tmp_path))) == []  # each removed its socket on close

    asyncio.run(main())


def test_the_socket_of_a_killed_process_is_removed_by_the_next_ring(tmp_path: Path) -> None:
    folder = folder_for(tmp_path)
    assert folder is not None
    dead = folder / "learner.999999.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(dead))
    s.close()  # what kill -9 leaves: the file, nobody bound to it

    async def main() -> None:
        bell = Bell()
        assert bell.connect(tmp_path, "api")
        try:
            bell.ring()
        finally:
            bell.close()

    asyncio.run(main())
    assert not dead.exists()


def test_a_socket_path_too_long_falls_back_to_polling(tmp_path: Path) -> None:
    async def main() -> None:
        deep = tmp_path / ("x" * 120)
        deep.mkdir()
        doorbell = Doorbell(deep, "api", lambda: None)
        assert not doorbell.open()
        doorbell.send()  # a no-op, not an error
        bell = Bell()
        bell.ring()  # an unconnected bell still wakes this process's waiters
        waiting = asyncio.create_task(bell.wait(LONG))
        await asyncio.sleep(0)
        bell.ring()
        await asyncio.wait_for(waiting, LONG / 2)

    asyncio.run(main())


@pytest.mark.parametrize("iterations", range(4))
def test_a_role_loop_cancelled_right_after_a_ring_ends(iterations: int) -> None:
    """Every role's loop is ``while True: ...; await bell.wait(...)`` and is stopped by cancelling it. On shutdown
    a ring often comes just before the cancel (the learner's cancelled step rings): a cancel in the same loop
    iterations as the woken wait must still end the loop. (It did not with asyncio.wait_for, whose Python 3.11
    version then returns normally: the loop waited again for ever and the coordinator's shutdown hung, CI at 4bd8ead.)
    """
    async def main() -> None:
        bell = Bell()

        async def role_loop() -> None:
            while True:
                await bell.wait(LONG)

        loop_task = asyncio.create_task(role_loop())
        await asyncio.sleep(0)  # it waits on the bell
        bell.ring()
        for _ in range(iterations):  # the cancel lands 0..3 event-loop iterations after the ring
            await asyncio.sleep(0)
        loop_task.cancel()
        done, _ = await asyncio.wait({loop_task}, timeout=LONG / 2)
        try:
            assert loop_task in done and loop_task.cancelled(), "the cancelled role loop went on waiting on the bell"
        finally:
            loop_task.cancel()
            await asyncio.wait({loop_task}, timeout=1.0)

    asyncio.run(main())
