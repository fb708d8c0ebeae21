"""The one-process layout (``layout = "one-process"``, and sync_mode "colocated"): the learner, verifier 0, the API
and, with ``p2p.enabled``, the libp2p peer, all in this process around one store.

The run files are opened here and shared with the API (``Coordinator.attach``); the learner starts first, since its
start publishes version 0 and the API's start waits for it; then the API (coordinator.api.app.api_role); then
verifier 0, the learner's loop and the peer. A failure of either loop sets the app's FATAL event, which ends the
process (coordinator.launch.serve). Stopping runs the other way round, the run files closing last.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from coordinator.api.app import COORDINATOR, FATAL, api_role
from coordinator.api.app import create_app as create_api_app
from coordinator.api.service import Coordinator
from coordinator.config import CoordinatorConfig
from coordinator.roles.learner import LearnerRole
from coordinator.roles.p2p import CoordinatorPeer
from coordinator.roles.verifier import VerifierWorker
from coordinator.run.names import verifier_name
from coordinator.run.runfiles import RunFiles

logger = logging.getLogger(__name__)


def create_app(config: CoordinatorConfig, coordinator: Coordinator | None = None) -> web.Application:
    """The API's HTTP app with the learner, verifier 0 (and the peer) started in this process too."""
    return create_api_app(config, coordinator, roles=_all_roles)


async def _all_roles(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    files = RunFiles.open(coord.config)
    learner: LearnerRole | None = None
    learner_stopped = False
    try:
        coord.attach(files)
        learner = LearnerRole(coord.config, files.store, coord.bell, files.snapshots, files.task, clock=coord.clock,
                              model_dir=coord.model_dir, local_intake=coord.accept_local, plan_job=coord.new_job)
        await learner.start()
        async with api_role(app):
            background: list[asyncio.Task[None]] = []
            worker: VerifierWorker | None = None
            peer: CoordinatorPeer | None = None
            try:
                worker = VerifierWorker(coord.config, files.store, coord.bell, files.snapshots, files.task)
                await worker.start()

                def _on_done(t: asyncio.Task[None]) -> None:  # either loop ending on an error ends the run, loudly
                    if not t.cancelled() and t.exception() is not None:
                        logger.critical("%s stopped: %r", t.get_name(), t.exception(), exc_info=t.exception())
                        app[FATAL].set()

                for task in (asyncio.create_task(worker.run(), name=verifier_name(0)),
                             asyncio.create_task(learner.run(), name="learner-loop")):
                    task.add_done_callback(_on_done)
                    background.append(task)
                if coord.config.p2p.enabled:  # the process layout runs the peer as a role process of its own
                    peer = CoordinatorPeer(coord)
                    coord.egress.peer = peer
                    await peer.start()
                yield
            finally:
                if peer is not None:
                    await peer.stop()
                for t in background:
                    t.cancel()
                await asyncio.gather(*background, return_exceptions=True)
                if worker is not None:
                    worker.close()
                learner_stopped = True
                await learner.stop()
    finally:
        if learner is not None and not learner_stopped:
            await learner.stop()
        files.close()
