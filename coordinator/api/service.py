"""The API role's shell: its lifecycle (open the run, assemble the phases, stop) and the watch on the learner.

A signed call goes through phases, each its own module over one request and one reply, the way a scheduler's
request handler reads as a table of contents: sign-in (:mod:`coordinator.api.signin`: the envelope, the sender,
registration), sending work (:mod:`coordinator.api.leasing`) and handling results (:mod:`coordinator.api.intake`).
The run's public reads are :class:`coordinator.api.runstate.RunView`'s; the operator's actions are
:mod:`coordinator.api.ops_actions`'. :class:`Coordinator` builds them when it starts and hands each the
collaborators it uses; :mod:`coordinator.api.app` (the composition) routes HTTP to them.

This module never imports torch: the learner (:mod:`coordinator.roles.learner`) and the verifiers
(:mod:`coordinator.roles.verifier`) are other roles, reached through the store — recomputes are asked of the
verifiers (:class:`coordinator.run.workqueue.RemoteVerifier`), new versions and the learner's progress are read from
it (``_watch``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coordinator.api.egress import SnapshotEgress
from coordinator.api.guard import Guard
from coordinator.api.intake import Intake
from coordinator.api.issuer import Issuer
from coordinator.api.leasing import Leasing
from coordinator.api.runstate import ApiState, RunView
from coordinator.api.signin import SignIn
from coordinator.api.verdicts import Verdicts, Verifying
from coordinator.config import CoordinatorConfig
from coordinator.run.follower import SnapshotFollower
from coordinator.run.names import API
from coordinator.run.relay import relay_token
from coordinator.run.runfiles import RunFiles, wait_for_first_version
from coordinator.run.workqueue import POLL_S, Bell, RemoteVerifier
from coordinator.store.hops import RECOMPUTE
from coordinator.store.job_rows import JobRow
from coordinator.tasks.text import PromptTokens, TextCodec
from shared.messages import ResultSubmission, SubmitResponse

logger = logging.getLogger(__name__)

__all__ = ["Coordinator"]


class Coordinator:
    """The API role. The run files (coordinator.run.runfiles, via ``attach``) and ``bell`` are shared with the other
    roles when they run in the same process; alone, it opens its own and polls the store. ``signin``, ``leasing``,
    ``intake`` and ``view`` exist once started."""

    def __init__(self, config: CoordinatorConfig, *, clock: Callable[[], float] = time.time,
                 bell: Bell | None = None, model_dir: Path | None = None) -> None:
        self.config = config
        self.clock = clock
        self.model_dir = model_dir  # one-process layout: the learner starts from this folder, not model.path
        self.run_dir = Path(config.run_dir)
        self._files: RunFiles | None = None
        self.bell = bell or Bell()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-io")  # file copies, never torch
        # fsyncs of the store (flush): one at a time, each covering every commit made before it began
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-sync")
        self._sync_lock = asyncio.Lock()
        self._synced = 0  # the store's commit count the last finished sync covered
        self.state = ApiState(started_at=clock())
        # speed-aware issuance (coordinator.api.issuer): per-client pace, long-polling clients, how fast versions come
        self.issuer = Issuer(config.sync_policy, lease_timeout_s=config.jobs.lease_timeout_s,
                             speed_aware=config.jobs.speed_aware)
        self.verdicts = Verdicts()  # results in verification, by sender, job and body hash: a resend joins one
        self.verifying = Verifying()  # jobs whose result is being verified: never reissued meanwhile
        self._watcher: asyncio.Task[None] | None = None
        self._owns_files = False
        #: which API process this is ("api", "api-1", …: several may share one PostgreSQL store; launch.serve sets it)
        self.api_name = API
        self.egress = SnapshotEgress()  # snapshot bytes out over HTTP / libp2p (coordinator.api.egress)

    # -- the run's progress, as the phases share it (coordinator.api.runstate.ApiState) ---------------------------
    @property
    def version(self) -> int:
        return self.state.version

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def issuing_paused(self) -> bool:
        """Set by the operator (coordinator.api.ops_actions): no new leases while True."""
        return self.state.issuing_paused

    @issuing_paused.setter
    def issuing_paused(self, paused: bool) -> None:
        self.state.issuing_paused = paused

    # -- lifecycle ----------------------------------------------------------------------------------------
    def attach(self, files: RunFiles) -> None:
        """Share the run files another role of this process opened (the one-process layout)."""
        self._files = files

    async def start(self) -> None:
        self._owns_files = self._files is None
        if self._files is None:  # a process of its own: the other roles' rings reach it through the doorbell
            self._files = RunFiles.open(self.config)
            self.bell.connect(self.run_dir, self.api_name)
        files = self._files
        self.store = files.store
        self.key = files.key
        self.public_key = files.public_key
        self.run_id = files.run_id
        self.task = files.task
        self.snapshots = files.snapshots
        self.follower = SnapshotFollower(self.snapshots, self.store.versions)
        self.state.issuing_paused = self.store.get_meta("issuing_paused") == "1"
        self._synced = self.store.commits
        self.guard = Guard(self.config, self.store)
        # asked by this API's previous run; nobody waits for them (other API processes' requests stay)
        dropped = self.store.work.drop((RECOMPUTE,), self.api_name)
        if dropped:
            logger.info("dropped %d verification requests of the previous API run (their clients resend)", dropped)
        self.state.version = await wait_for_first_version(self.store, self.bell, API)
        self.follower.refresh()
        self._assemble(files)
        self.state.finished = self.state.version >= self.config.learner.max_steps
        self.issuer.new_version(time.monotonic())
        self._watcher = asyncio.create_task(self._watch(), name="api-watch")

    def _assemble(self, files: RunFiles) -> None:
        """Build the phases over the opened run, each handed what it uses."""
        folder = self.snapshots.folder(self.state.version)
        base = self.snapshots.base_dir
        self.codec = TextCodec.from_folder(folder if (folder / "tokenizer.json").exists() else base)
        self.vocab_size = self.codec.vocab_size
        prompt_tokens = PromptTokens(self.codec, self.task.train)
        verifier = RemoteVerifier(self.store, self.bell, wait_s=self.config.verification.wait_s)
        verifier.requester = self.api_name
        self.view = RunView(self.config, files, self.state, self.guard, self.egress, self.clock)
        self.signin = SignIn(self.config, self.store, self.guard, self.issuer, self.run_id, self.clock)
        # what every phase works with (coordinator.api.phase.Phase), in its fields' order
        phase = (self.config, files, self.state, self.signin, self.guard, self.issuer, prompt_tokens, self.verifying,
                 self.clock)
        self.leasing = Leasing(*phase, catch_up=self._catch_up)
        self.intake = Intake(*phase, bell=self.bell, verifier=verifier, verdicts=self.verdicts)

    async def _watch(self) -> None:
        """Follow the store: a version the learner committed becomes current here (clients are woken for it)."""
        while True:
            try:
                self._catch_up()
            except Exception:  # a busy database must not end the watch; the next look retries
                logger.exception("reading the run's current version failed")
            await self.bell.wait(POLL_S)

    def _catch_up(self) -> None:
        """Make the learner's newest committed version current here, if this API has not seen it yet."""
        current = self.store.versions.current()
        if current is not None and current > self.state.version:
            self._on_new_version(current)

    def _on_new_version(self, current: int) -> None:
        self.follower.refresh()
        self.state.version = current
        self.issuer.new_version(time.monotonic())
        self.state.finished = current >= self.config.learner.max_steps  # before waking: no work past the last step
        self.leasing.notify_jobs()

    async def flush(self, since: int = 0) -> None:
        """Make what this process committed so far power-safe before a reply tells a client about it
        (coordinator.api.app's durability middleware), if anything was committed after ``since`` (the watermark
        when the request began: a lease, committed through the light connection, does not wait for an fsync of
        what another role committed meanwhile). The fsync runs in a thread, holding no database lock, while the
        event loop serves other requests; requests that committed while one was running share the next."""
        store = getattr(self, "store", None)
        if store is None:  # not started
            return
        target = store.commits
        if self._synced >= target or target <= since:
            return
        async with self._sync_lock:
            if self._synced >= target:  # a sync that began after our commit finished meanwhile
                return
            upto = store.commits
            await asyncio.get_running_loop().run_in_executor(self._syncer, store.sync)
            self._synced = max(self._synced, upto)

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file work (exports) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def stop(self) -> None:
        await self.verdicts.close()
        if self._watcher is not None and not self._watcher.done():  # (done: its event loop already ended)
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        self._io.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        if self._owns_files and self._files is not None:
            self.bell.close()
            self._files.close()

    # -- what the one-process layout's learner is handed (coordinator.launch.one_process), before the start ---------
    async def accept_local(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str
                           ) -> SubmitResponse:
        """The co-located loop's own rollouts, through the intake (coordinator.api.intake.Intake.accept_local)."""
        return await self.intake.accept_local(client_id, sub, size, content_sha)

    def new_job(self) -> JobRow:
        """The next job of the run's plan (:meth:`coordinator.api.leasing.Leasing.new_job`)."""
        return self.leasing.new_job()

    # -- what the HTTP layer asks of the role (coordinator.api.app) -------------------------------------------------
    def body_cap(self, path: str) -> int:
        return self.config.body_cap(path)

    @functools.cached_property
    def relay_token(self) -> str:
        """The token the p2p role's relayed calls carry (coordinator.roles.p2p_relay); known once started."""
        return relay_token(self.key, self.run_id)
