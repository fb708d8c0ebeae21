"""The coordinator's libp2p peer (``p2p.enabled``; docs/protocol.md §6a): a role process of its own (``p2p``), or
inside the one process of the one-process layout.

It is the DHT's bootstrap node, publishes the signed record of the newest version (republished every fifth of its
lifetime, and at once when a version is published), announces itself as a holder of that version's files and
serves each file over libp2p to the first ``p2p.seed_peers`` peers only: after that, peers serve each other. HTTP
stays open to everyone, so a client whose peer fetch failed still gets its files (coordinator egress then shows it).
With ``p2p.calls`` it also relays the protocol's signed calls to the API (coordinator.roles.p2p_relay, §6b).

Starting the peer imports hivemind, and hivemind imports torch: in the process layout it therefore runs in its own
role process, so the API process still never loads torch (issue 12). It reports its peer id, addresses and byte
counters in the store every few seconds; the API reads them for ``GET /v1/p2p`` and the status page's egress. If
it cannot start, the API serves HTTP alone and the role says so once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.config import CoordinatorConfig
from coordinator.publish.snapshots import SnapshotStore
from coordinator.roles.p2p_relay import CallRelay
from coordinator.run.follower import SnapshotFollower
from coordinator.run.names import P2P
from coordinator.run.records import P2PReport
from coordinator.run.relay import relay_token
from coordinator.run.runfiles import RunFiles, wait_for_first_version
from coordinator.run.workqueue import Bell
from coordinator.store.store import Store
from shared import crypto, records, wire
from shared.hashing import sha256_bytes
from shared.messages import Manifest, SignedManifest
from shared.p2p import P2PUnavailable, PeerNode, Uploads, stop_peer
from shared.p2p_calls import CALL_PROTOCOL

logger = logging.getLogger(__name__)
POLL_S = 1.0  # how often the new-version check runs (a dict lookup; cheap)
RETRY_S = 10.0  # after a failed publication
REPORT_EVERY_S = 2.0  # the p2p role's report in the store (what GET /v1/p2p and the status page show)


class PeerContext(Protocol):
    """What the peer needs of the run: the API's Coordinator has it, and so does the p2p role's RoleContext."""

    run_id: str
    key: Ed25519PrivateKey
    snapshots: SnapshotStore
    config: CoordinatorConfig

    @property
    def public_key(self) -> bytes: ...

    @property
    def version(self) -> int: ...


class CoordinatorPeer:
    def __init__(self, coord: PeerContext) -> None:
        self.coord = coord
        self.config = coord.config.p2p
        self.node: PeerNode | None = None
        self.relay: CallRelay | None = None
        self.maddrs: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self.peer_served_bytes = 0  # what volunteers report (in their holder entries) they served each other

    @property
    def served_bytes(self) -> int:
        """Bytes this peer served over libp2p (the coordinator's p2p egress)."""
        return self.node.uploads.served_bytes if self.node is not None else 0

    def report(self) -> P2PReport:
        """What the API shows of this peer (GET /v1/p2p, the status page's egress)."""
        return P2PReport(peer_id=self.node.peer_id if self.node is not None else None, maddrs=self.maddrs[:16],
                         served_bytes=self.served_bytes, peer_served_bytes=self.peer_served_bytes,
                         calls=self.relay.report() if self.relay is not None else None)

    async def start(self) -> None:
        coord = self.coord
        node = PeerNode(coord.run_id, coord.public_key, coord.snapshots.blob_path,
                        Uploads(concurrent=max(4, self.config.seed_peers), per_blob=self.config.seed_peers))
        try:
            await node.start(initial_peers=[], host_maddrs=self.config.host_maddrs,
                             announce_maddrs=self.config.announce_maddrs or None)
        except P2PUnavailable as exc:
            logger.warning("p2p is on but the coordinator's libp2p peer could not start (%s); serving snapshots "
                           "over HTTP only", exc)
            return
        self.node = node
        if self.config.calls:
            self.relay = CallRelay(coord.config, relay_token(coord.key, coord.run_id))
            await node.p2p.add_binary_stream_handler(CALL_PROTOCOL, self.relay.serve)
        self.maddrs = await node.visible_maddrs()
        logger.info("p2p peer %s reachable at %s", node.peer_id, ", ".join(self.maddrs))  # not "listening on": the HTTP URL line
        self._task = asyncio.create_task(self._publish_loop(), name="p2p-publish")

    async def stop(self) -> None:
        await stop_peer(self.node, self._task)
        self.node = None
        if self.relay is not None:
            await self.relay.close()
            self.relay = None

    async def _publish_loop(self) -> None:
        published, retry_at = -1, 0.0
        while True:
            version = self.coord.version
            if version != published or time.monotonic() >= retry_at:
                try:
                    await self.publish(version)
                    published, retry_at = version, time.monotonic() + self.config.record_ttl_s / 5
                except Exception as exc:  # a DHT hiccup (a loaded machine, peers leaving): try again soon
                    published, retry_at = version, time.monotonic() + RETRY_S
                    logger.warning("p2p: publishing version %d failed (%s: %s); retrying in %.0f s", version,
                                   type(exc).__name__, exc, RETRY_S)
            await asyncio.sleep(POLL_S)

    async def publish(self, version: int) -> None:
        """Sign and store the latest record for ``version``; announce its files; collect what peers served."""
        from hivemind.utils.timed_storage import get_dht_time

        assert self.node is not None
        signed_bytes = self.coord.snapshots.signed_manifest(version)
        if signed_bytes is None:
            return
        signed = wire.decode(signed_bytes, SignedManifest)
        manifest = wire.decode(signed.manifest, Manifest)
        now = get_dht_time()
        record = records.sign_latest(self.coord.key, run_id=self.coord.run_id, version=version,
                                     manifest_sha256=sha256_bytes(signed.manifest), created_at=now,
                                     expires_at=now + self.config.record_ttl_s)
        await self.node.publish_latest(record)
        blobs = sorted({f.sha256 for f in manifest.files if f.pieces})
        await self.node.announce(blobs)
        served: dict[str, int] = {}
        for sha in blobs:
            for peer, n in (await self.node.holders(sha)).items():
                if peer != self.node.peer_id:
                    served[peer] = max(served.get(peer, 0), n)
        self.peer_served_bytes = max(self.peer_served_bytes, sum(served.values()))


class RoleContext:
    """The run as the p2p role process sees it: the version is the store's newest, and its snapshot is indexed
    (``SnapshotFollower``) before the peer announces it."""

    def __init__(self, config: CoordinatorConfig, store: Store, key: Ed25519PrivateKey, run_id: str,
                 snapshots: SnapshotStore) -> None:
        self.config, self.store, self.key, self.run_id, self.snapshots = config, store, key, run_id, snapshots
        self.follower = SnapshotFollower(snapshots, store.versions)

    @property
    def public_key(self) -> bytes:
        return crypto.public_bytes(self.key)

    @property
    def version(self) -> int:
        current = self.follower.current()
        return 0 if current is None else current


async def run_role(config: CoordinatorConfig, stop: asyncio.Event) -> int:
    """The p2p role process: start the peer once version 0 exists, report it in the store until ``stop``."""

    files = RunFiles.open(config)
    peer: CoordinatorPeer | None = None
    try:
        first = asyncio.create_task(wait_for_first_version(files.store, Bell(), P2P))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({first, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for t in (first, stopped):
            t.cancel()
        if stop.is_set():
            return 0
        ctx = RoleContext(config, files.store, files.key, files.run_id, files.snapshots)
        peer = CoordinatorPeer(ctx)
        await peer.start()
        while True:
            files.store.role_status.set(P2P, peer.report())
            try:
                async with asyncio.timeout(REPORT_EVERY_S):  # not wait_for: it can swallow a cancellation (Bell.wait)
                    await stop.wait()
                return 0
            except TimeoutError:
                pass
    finally:
        if peer is not None:
            await peer.stop()
        files.store.role_status.set(P2P, P2PReport())  # stopped: no peer_id
        files.close()
