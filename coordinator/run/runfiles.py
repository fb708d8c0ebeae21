"""What every role opens first: the run directory's database, signing key, run id, task and snapshot folder;
and, for the roles that read snapshots, the wait for the learner's version 0.

Several role processes may open a new run directory at the same moment; the key and the run id are created under
an exclusive file lock, so all of them sign with the same key and speak of the same run.
"""

from __future__ import annotations

import fcntl
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.config import CoordinatorConfig
from coordinator.publish.snapshots import SnapshotStore
from coordinator.run.workqueue import POLL_S, Bell
from coordinator.store.store import Store
from coordinator.tasks.base import Task
from coordinator.tasks.factory import make_task
from shared import crypto

logger = logging.getLogger(__name__)


@dataclass
class RunFiles:
    config: CoordinatorConfig
    store: Store
    key: Ed25519PrivateKey
    run_id: str
    snapshots: SnapshotStore
    task: Task

    @property
    def public_key(self) -> bytes:
        return crypto.public_bytes(self.key)

    @classmethod
    def open(cls, config: CoordinatorConfig) -> RunFiles:
        run_dir = Path(config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / ".setup.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                store = Store(config.store.url or run_dir / "coordinator.sqlite")
                key, created = crypto.load_or_create_key(run_dir / "coordinator.key")
                if created:
                    logger.info("created coordinator key %s", run_dir / "coordinator.key")
                run_id = store.get_meta("run_id")
                if run_id is None:
                    run_id = secrets.token_hex(6)
                    store.set_meta("run_id", run_id)
                try:
                    _same_key(store, crypto.public_bytes(key).hex(), run_dir)
                except KeyMismatch:
                    store.close()
                    raise
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return cls(config=config, store=store, key=key, run_id=run_id,
                   snapshots=SnapshotStore(run_dir / "snapshots", key, run_id,
                                             piece_size=config.snapshots.piece_kib * 1024,
                                             anchor_every=config.snapshots.anchor_every if config.snapshots.deltas
                                             else None,
                                             lag_tolerance=config.snapshots.lag_tolerance if config.snapshots.deltas
                                             else 0.0,
                                             lag_cap=config.snapshots.lag_steps * config.learner.lr),
                   task=make_task(config.task, config.model.path))

    def close(self) -> None:
        self.store.close()


def _same_key(store: Store, public_hex: str, run_dir: Path) -> None:
    """Roles on several hosts (one PostgreSQL store) must sign with one key: clients trust the key /v1/info
    gave them. The first role to start records its public key in the store; a role whose run directory holds
    another key (one created on a host the key was not copied to) refuses to start."""
    recorded = store.get_meta("coordinator_public_key")
    if recorded is None:
        store.set_meta("coordinator_public_key", public_hex)
    elif recorded != public_hex:
        raise KeyMismatch(f"{run_dir / 'coordinator.key'} is not the key this run signs with (the store records "
                          f"public key {recorded[:16]}…); copy coordinator.key from the host where the run started "
                          f"into this run directory, then start the role again")


class KeyMismatch(RuntimeError):
    """This host's coordinator key is not the run's."""


async def wait_for_first_version(store: Store, bell: Bell, role: str) -> int:
    """Roles that read snapshots start once the learner has published version 0."""
    said = False
    while (current := store.versions.current()) is None:
        if not said:
            logger.info("%s: waiting for the learner to publish version 0", role)
            said = True
        await bell.wait(POLL_S * 4)
    return current
