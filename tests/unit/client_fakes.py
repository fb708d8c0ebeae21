"""Fakes for driving the real join loop (``Runner._serve``) in unit tests: a scripted coordinator, a recording
snapshot cache and a backend that generates nothing. No network, no model, no sleeps: every scripted reply has
``retry_after_s = 0``, and the recording cache answers at once unless a test holds a fetch on an event."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared import PROTOCOL_VERSION, crypto, wire
from shared.endpoints import NOTICES, SignedCall
from shared.messages import (
    Info,
    Job,
    LeaseRequest,
    LeaseResponse,
    NoticeBoard,
    RegisterResponse,
    ReleaseResponse,
    SubmitResponse,
)
from shared.policy import Sampled
from shared.records import sign_job, sign_notices
from swarm_client import runner as runner_mod
from swarm_client.identity import Identity, load_identity
from swarm_client.runner import Household, JoinConfig, Runner

from .factories import job

COORDINATOR_KEY = crypto.generate_key()


def reply(current: int, *, prefetch: bool = False, job_version: int | None = None, client_id: str = "",
          paused: bool = False, **job_fields: Any) -> LeaseResponse:
    """A lease reply announcing ``current``, with a job bound to ``job_version`` for ``client_id`` if given
    (``job_fields``: other fields of that job, e.g. its prompts)."""
    signed = None
    if job_version is not None:
        fields = {"job_id": f"v{job_version}-j0"} | job_fields
        signed = sign_job(COORDINATOR_KEY, job(client_id=client_id, version=job_version, **fields))
    return LeaseResponse(job=signed, retry_after_s=0.0, current_version=current, finished=False, paused=paused,
                         prefetch=prefetch)


class ScriptedCoordinator:
    """Answers lease requests from a script (a reply, or a function of the runner returning one); once the
    script is spent it stops the runner. Records every lease request's ``held_version``."""

    def __init__(self, runner: Runner, identity: Identity, script: list[Any]) -> None:
        self.runner, self.identity, self.script = runner, identity, list(script)
        self.held: list[int] = []
        self.submitted: list[int] = []
        self.released: list[str] = []

    async def info(self) -> Info:
        return Info(protocol=PROTOCOL_VERSION, run_id="run-1", coordinator_public_key=crypto.public_bytes(COORDINATOR_KEY),
                    current_version=0, sync_mode="async-push-pull", task="arithmetic", finished=False,
                    server_time=1000.0)

    async def get_raw(self, path: str) -> bytes:
        """The runner's reads: the run's notices (none), signed as the coordinator signs them."""
        if path == NOTICES.path:
            return wire.encode(sign_notices(COORDINATOR_KEY, NoticeBoard(run_id="run-1", issued_at=1000.0,
                                                                         notices=[])))
        raise AssertionError(f"unexpected read {path}")

    async def call(self, endpoint: SignedCall[Any, Any], message: Any) -> Any:
        """The runner's signed calls (shared.endpoints): answered by path, as :meth:`post` does."""
        return await self.post(endpoint.path, message, endpoint.reply)

    async def post(self, path: str, message: Any, response_type: type) -> Any:
        if path == "/v1/register":
            return RegisterResponse(client_id=self.identity.client_id, new=True, run_id="run-1")
        if path == "/v1/lease":
            assert isinstance(message, LeaseRequest)
            self.held.append(message.held_version)
            if not self.script:
                self.runner.stop.set()
                return reply(0)
            item = self.script.pop(0)
            return item(self.runner) if callable(item) else item
        if path == "/v1/results":
            self.submitted.append(message.version)
            return SubmitResponse(accepted=True, job_id=message.job_id, mean_reward=0.0, credit=1.0, total_credit=1.0)
        if path == "/v1/release":
            self.released.append(message.job_id)
            return ReleaseResponse(released=True)
        raise AssertionError(f"unexpected request {path}")


class RecordingCache:
    """Stands in for SnapshotCache: records (version, manifest_sha256) of every fetch; ``hold[v]`` (an event)
    keeps the fetch of version v in progress until set; ``fail`` lists versions whose fetch fails; ``fill``, if
    set, writes a version's folder (called with the folder and the version)."""

    instances: list[RecordingCache] = []
    default_fill: Callable[[Path, int], None] | None = None  # ``fill`` of the caches made while it is set

    def __init__(self, root: Path, *args: Any, **kwargs: Any) -> None:
        self.root = root
        self.fetches: list[tuple[int, str | None]] = []
        self.hold: dict[int, asyncio.Event] = {}
        self.fail: set[int] = set()
        self.entered: asyncio.Queue[int] = asyncio.Queue()  # each version as its fetch begins
        self.fill: Callable[[Path, int], None] | None = RecordingCache.default_fill
        RecordingCache.instances.append(self)

    async def ensure(self, run_id: str, version: int, manifest_sha256: str | None) -> Path:
        self.fetches.append((version, manifest_sha256))
        self.entered.put_nowait(version)
        if version in self.hold:
            await self.hold[version].wait()
        if version in self.fail:
            from swarm_client.blob_fetch import DownloadStalled

            raise DownloadStalled(f"version {version}: the link stalled")
        folder = self.root / f"v{version:06d}"
        if self.fill is not None:
            self.fill(folder, version)
        return folder


class NullBackend:
    name = "torch"
    device = "cpu"
    forms = frozenset({"hf"})

    def __init__(self) -> None:
        self.loaded: list[Path] = []
        self.folder: Path | None = None

    def load(self, folder: Path) -> None:
        self.loaded.append(folder)
        self.folder = folder

    def parameters(self) -> int | None:
        return None if self.folder is None else 1_000

    def unload(self) -> None:
        self.folder = None

    def generate(self, job: Job, should_stop: Any) -> list[Sampled]:
        return [Sampled([4, 2], [-0.5, -0.25], "stop") for _ in range(job.group_size * len(job.prompts))]


def make_client(home: Path, monkeypatch: pytest.MonkeyPatch, *, stop: threading.Event | None = None,
                **cfg: Any) -> tuple[Runner, Identity]:
    """A Runner whose snapshot cache is a RecordingCache, and its identity (``stop``: its stop event, for a test
    that records the waits on it)."""
    RecordingCache.instances.clear()
    monkeypatch.setattr(runner_mod, "SnapshotCache", RecordingCache)
    config = JoinConfig(url="http://coordinator.invalid", home=home, benchmark=False, panel=False, **cfg)
    return Runner(config, household=Household.of(config, stop)), load_identity(config.home)


def serve(runner: Runner, identity: Identity, script: list[Any], *, backend: NullBackend | None = None,
          fill: Callable[[Path, int], None] | None = None,
          raises: type[BaseException] | None = None) -> tuple[ScriptedCoordinator, RecordingCache]:
    """Run ``Runner._serve`` against ``script`` until it is spent (``raises``: until it raises that instead);
    ``fill`` writes each fetched version's folder."""
    coordinator = ScriptedCoordinator(runner, identity, script)

    async def go() -> None:
        try:
            assert await runner._serve(coordinator, identity, backend or NullBackend()) == runner_mod.EXIT_OK  # type: ignore[arg-type]
        finally:
            if runner.downloads.prefetch is not None and not runner.downloads.prefetch.done():
                runner.downloads.prefetch.cancel()

    RecordingCache.default_fill = fill
    try:
        if raises is None:
            asyncio.run(go())
        else:
            with pytest.raises(raises):
                asyncio.run(go())
    finally:
        RecordingCache.default_fill = None
    (cache,) = RecordingCache.instances
    return coordinator, cache
