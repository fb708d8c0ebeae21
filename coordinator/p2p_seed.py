"""The coordinator's libp2p peer (``p2p.enabled``; docs/protocol.md §6a), run by the API role next to HTTP.

It is the DHT's bootstrap node, publishes the signed record of the newest version (republished every fifth of its
lifetime, and at once when a version is published), announces itself as a holder of that version's files and
serves each file over libp2p to the first ``p2p.seed_peers`` peers only: after that, peers serve each other. HTTP
stays open to everyone, so a client whose peer fetch failed still gets its files (coordinator egress then shows it).

The peer runs inside the API process's event loop; starting it imports hivemind (and so torch) into that process,
which is why it is off by default. If it cannot start the API serves HTTP alone and says so once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared import records, wire
from shared.hashing import sha256_bytes
from shared.messages import Manifest, P2PInfo, SignedManifest

if TYPE_CHECKING:
    from coordinator.service import Coordinator
    from shared.p2p import PeerNode

logger = logging.getLogger(__name__)
POLL_S = 1.0  # how often the new-version check runs (a dict lookup; cheap)
RETRY_S = 10.0  # after a failed publication


@dataclass
class SnapshotEgress:
    """Snapshot file bytes that left the coordinator (HTTP and libp2p) against bytes volunteers say they served
    each other, for the status page (``snapshot_egress``) and bench/egress.py."""

    http_bytes: int = 0
    peer: CoordinatorPeer | None = None

    def view(self) -> dict[str, Any]:
        p2p = self.peer.served_bytes if self.peer is not None else 0
        return {"p2p": self.peer is not None and self.peer.node is not None, "http_bytes": self.http_bytes,
                "p2p_bytes": p2p, "coordinator_bytes": self.http_bytes + p2p,
                "peer_bytes": self.peer.peer_served_bytes if self.peer is not None else 0}


class CoordinatorPeer:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.config = coord.config.p2p
        self.node: PeerNode | None = None
        self.maddrs: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self.peer_served_bytes = 0  # what volunteers report (in their holder entries) they served each other

    @property
    def served_bytes(self) -> int:
        """Bytes this peer served over libp2p (the coordinator's p2p egress)."""
        return self.node.uploads.served_bytes if self.node is not None else 0

    def info(self) -> P2PInfo:
        if self.node is None:
            return P2PInfo(enabled=False)
        return P2PInfo(enabled=True, peer_id=self.node.peer_id, maddrs=self.maddrs[:16])

    async def start(self) -> None:
        from shared.p2p import P2PUnavailable, PeerNode, Uploads

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
        self.maddrs = await node.visible_maddrs()
        logger.info("p2p peer %s reachable at %s", node.peer_id, ", ".join(self.maddrs))  # not "listening on": the HTTP URL line
        self._task = asyncio.create_task(self._publish_loop(), name="p2p-publish")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.node is not None:
            await self.node.stop()
            self.node = None

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
