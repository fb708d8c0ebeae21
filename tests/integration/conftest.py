"""Integration fixtures: a real coordinator (aiohttp on 127.0.0.1, real SQLite, real learner) started in a
background thread with an injectable clock, so lease expiry can be tested without waiting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from coordinator.api.app import CONN_GUARD
from coordinator.api.netguard import GuardedSite, ReplyWritten
from coordinator.api.service import Coordinator
from coordinator.config import load_config
from coordinator.launch.one_process import create_app
from tests.integration.helpers import write_config


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class LiveCoordinator:
    url: str
    coordinator: Coordinator
    clock: FakeClock
    run_dir: Path
    loop: asyncio.AbstractEventLoop | None = None  # the coordinator's event loop (its own thread)


@contextlib.contextmanager
def running_coordinator(tmp_path: Path, model_dir: Path, *, top: dict[str, Any] | None = None,
                        jobs: dict[str, Any] | None = None, learner: dict[str, Any] | None = None,
                        limits: dict[str, Any] | None = None, trust: dict[str, Any] | None = None,
                        sections: dict[str, dict[str, Any]] | None = None, guarded: bool = False
                        ) -> Iterator[LiveCoordinator]:
    """A coordinator in a background thread with a fake clock; config sections override the test defaults.
    ``guarded``: served as `echo-swarm coordinator` serves it (coordinator.launch.serve.start_site: the connection
    guard's site and access logger), so what aiohttp's parser refuses before the app is seen too."""
    run_dir = tmp_path / "run"
    cfg = load_config(write_config(tmp_path / "run.toml", run_dir, model_dir, top=top,
                                   jobs={"lease_timeout_s": 30.0, "long_poll_s": 0.0, **(jobs or {})},
                                   learner={"max_steps": 50, **(learner or {})},
                                   # rate limits off: fuzzing sends thousands of requests from one identity
                                   limits={"per_identity_rps": 0.0, "per_address_rps": 0.0,
                                           "registrations_per_address_per_min": 0.0, "new_identities_per_min": 0.0,
                                           **(limits or {})},
                                   # and so many refusals that a quarantine would stop the fuzzing client
                                   trust={"quarantine_after": 1000, **(trust or {})}, **(sections or {})))
    clock = FakeClock(time.time())
    coord = Coordinator(cfg, clock=clock, model_dir=model_dir)
    app = create_app(cfg, coord)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app, handle_signals=False, **({"access_log_class": ReplyWritten} if guarded else {}))

    async def start() -> int:
        await runner.setup()
        if guarded:
            guarded_site = GuardedSite(runner, app[CONN_GUARD], "127.0.0.1", 0)
            await guarded_site.start()
            return guarded_site.port
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(180)
    # as coordinator.launch.serve.serve: the run's endpoint (the p2p role's call relay finds the API there)
    (run_dir / "endpoint.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "port": port}))
    try:
        yield LiveCoordinator(f"http://127.0.0.1:{port}", coord, clock, run_dir, loop)
    finally:
        try:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(180)
        except TimeoutError:
            _dump_stuck(loop)
            raise
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _dump_stuck(loop: asyncio.AbstractEventLoop) -> None:
    """What a shutdown that did not finish was waiting for: every thread's stack and the loop's tasks."""
    import faulthandler
    import sys

    print("coordinator shutdown did not finish; threads and tasks follow", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for task in asyncio.all_tasks(loop):
        task.print_stack(file=sys.stderr)


@pytest.fixture(scope="session")
def hivemind() -> Any:
    """hivemind, the p2p extra that `make setup` installs: where it does not import, the p2p tests fail saying so,
    as the store tests do without PostgreSQL, instead of vanishing from the run as skips."""
    try:
        import hivemind as module
    except ImportError as exc:
        pytest.fail(f"the p2p tests need hivemind (the [p2p] extra: make setup, or pip install -e '.[p2p]'): {exc}")
    return module


@pytest.fixture
def live_coordinator(tmp_path: Path, tiny_model_dir: Path) -> Iterator[LiveCoordinator]:
    with running_coordinator(tmp_path, tiny_model_dir) as live:
        yield live
