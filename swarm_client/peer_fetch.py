"""A volunteer's side of peer-to-peer snapshots (`join --p2p`; docs/protocol.md §6a): fetch files from other
volunteers before falling back to the coordinator's HTTP, and serve the verified files this client holds.

p2p is best effort. Whatever goes wrong (hivemind not installed, p2pd not starting, the coordinator not running a
peer, no holder before the deadline, every holder bad) the snapshot cache continues over HTTP Range from the first
byte not yet verified, and the client says so once per reason, not once per file.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared import wire
from shared.endpoints import P2P_INFO
from shared.hashing import FileDigest
from shared.messages import MIN_PIECE_SIZE, ManifestFile, P2PInfo
from shared.p2p import P2PUnavailable, PeerNode, Uploads, stop_peer

if TYPE_CHECKING:
    from swarm_client.api import CoordinatorClient

logger = logging.getLogger(__name__)
_BLOB = re.compile(r"[0-9a-f]{64}")
ANNOUNCE_EVERY_S = 60.0  # holder entries live 120 s (shared.p2p.HOLDER_TTL_S)
#: Files smaller than this (the smallest piece: config and tokenizer files) come over HTTP: finding a holder (a DHT
#: lookup over several peers, a stream, waiting for the swarm to seed it) costs the swarm more CPU than the bytes,
#: and the coordinator's egress for them is a few kB per client.
P2P_MIN_BYTES = MIN_PIECE_SIZE


@dataclass
class PeerStats:
    """Counters for the client's panel and the benchmark."""

    peer_bytes: int = 0  # received from peers
    wasted_bytes: int = 0  # pieces that failed their hash
    banned: int = 0
    fallbacks: int = 0  # files (or their rest) fetched over HTTP after trying peers
    lookups: int = 0  # holder lookups in the DHT
    refused: int = 0  # peers' refusals (busy, seeded, ...)
    said: set[str] = field(default_factory=set)


@dataclass
class PeerSettings:
    serve: bool = True
    max_upload_bytes: int | None = None
    uploads: int = 2
    uploads_per_blob: int = 3
    deadline_s: float = 20.0
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    coordinator: list[str] = field(default_factory=list)  # its peer's multiaddrs; empty: ask GET /v1/p2p


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def coordinator_info(maddrs: list[str]) -> P2PInfo:
    """The coordinator's peer as configured (`join --p2p-coordinator`) instead of as GET /v1/p2p says: multiaddrs
    that each end in ``/p2p/<its peer id>``, one peer id for all. ValueError says what is wrong."""
    ids = {m.rsplit("/p2p/", 1)[1] if "/p2p/" in m else "" for m in maddrs}
    if "" in ids or len(ids) != 1:
        raise ValueError(f"the coordinator's multiaddrs must each end in /p2p/<its peer id>, one peer id for all "
                         f"(e.g. /ip4/203.0.113.7/tcp/8471/p2p/12D3KooW…); got {maddrs[:4]}")
    return P2PInfo(enabled=True, peer_id=ids.pop(), maddrs=maddrs)


class ClientPeer:
    def __init__(self, blobs: Path, settings: PeerSettings, say: Callable[[str], None] | None = None) -> None:
        self.blobs = blobs
        self.settings = settings
        self.node: PeerNode | None = None
        self.coordinator_peer = ""
        self.stats = PeerStats()
        self._say = say or logger.warning
        self._task: asyncio.Task[None] | None = None
        self.prefer: set[str] = set()  # peers to try first (tests and bench/egress.py aim at a bad peer)
        self._unannounced: set[str] = set()  # small files held but not yet announced (see announce)

    @property
    def served_bytes(self) -> int:
        return self.node.uploads.served_bytes if self.node is not None else 0

    def say_once(self, reason: str, text: str) -> None:
        if reason not in self.stats.said:
            self.stats.said.add(reason)
            self._say(text)

    def _resolve(self, sha256: str) -> Path | None:
        """Only whole files that passed the whole-file check are named by their sha256 in the cache."""
        path = self.blobs / sha256
        return path if _BLOB.fullmatch(sha256) and path.is_file() else None

    async def start(self, api: CoordinatorClient, run_id: str, coordinator_key: bytes) -> bool:
        """Join the coordinator's DHT; False (said once) when p2p cannot run, and snapshots come over HTTP."""
        try:
            info = coordinator_info(self.settings.coordinator) if self.settings.coordinator else \
                wire.decode(await api.get_raw(P2P_INFO.path), P2PInfo)
        except Exception as exc:
            self.say_once("info", f"p2p off: the coordinator did not answer GET /v1/p2p ({exc}); snapshots come over "
                                  f"HTTP")
            return False
        if not info.enabled or not info.maddrs:
            self.say_once("info", "p2p off: the coordinator runs no libp2p peer (its p2p.enabled is false); "
                                  "snapshots come over HTTP")
            return False
        s = self.settings
        node = PeerNode(run_id, coordinator_key, self._resolve,
                        Uploads(concurrent=s.uploads, per_blob=s.uploads_per_blob, byte_cap=s.max_upload_bytes,
                                serve=s.serve))
        try:
            await node.start(initial_peers=list(info.maddrs), host_maddrs=s.listen)
        except P2PUnavailable as exc:
            self.say_once("start", f"p2p off: {exc}; snapshots come over HTTP")
            return False
        self.node, self.coordinator_peer = node, info.peer_id or ""
        self._task = asyncio.create_task(self._announce_loop(), name="p2p-announce")
        self._say(f"p2p on: peer {node.peer_id[:16]}… joined the swarm's DHT"
                  + ("" if s.serve else " (not serving: --no-serve)"))
        return True

    async def stop(self) -> None:
        await stop_peer(self.node, self._task)
        self.node = None

    def held(self) -> list[str]:
        return sorted(p.name for p in self.blobs.iterdir() if _BLOB.fullmatch(p.name))

    async def _announce_loop(self) -> None:
        while True:  # every held file, small ones included: entries expire unless refreshed
            held, self._unannounced = self.held(), set()
            if held:
                await self._store(held)
            await asyncio.sleep(ANNOUNCE_EVERY_S)

    async def announce(self, sha256s: list[str]) -> None:
        """Say these verified files are held here. Small files (fetched over HTTP, but older clients still look
        them up) wait to go with the next announcement of a larger one or :meth:`announce_pending`: each
        announcement is a DHT traversal and a store on several peers."""
        if self.node is None:
            return
        small = {s for s in sha256s if _size(self.blobs / s) < P2P_MIN_BYTES}
        self._unannounced |= small
        if small == set(sha256s):
            return
        sha256s, self._unannounced = sorted(set(sha256s) | self._unannounced), set()
        await self._store(sha256s)

    async def announce_pending(self) -> None:
        """Announce the small files still waiting (a snapshot is complete)."""
        if self.node is not None and self._unannounced:
            pending, self._unannounced = sorted(self._unannounced), set()
            await self._store(pending)

    async def _store(self, sha256s: list[str]) -> None:
        assert self.node is not None
        try:
            await self.node.announce(sha256s)
        except Exception as exc:
            logger.info("p2p: announcing %d files failed: %s", len(sha256s), type(exc).__name__)

    async def fetch(self, file: ManifestFile, partial: Path, on_bytes: Callable[[int], None],
                    digest: FileDigest | None = None) -> None:
        """Fill ``partial`` from peers as far as they deliver; the caller fetches the rest over HTTP. ``digest``
        (the whole file's running sha256) is fed every verified byte, so the caller's check reads nothing again."""
        if self.node is None or file.size < P2P_MIN_BYTES:
            return
        if not file.pieces:
            self.say_once("pieces", "p2p: this snapshot's manifest has no piece hashes (published before protocol "
                                    "4); fetching it over HTTP")
            return
        try:
            report = await self.node.fetch(file, partial, deadline_s=self.settings.deadline_s,
                                           last={self.coordinator_peer}, first=self.prefer, on_bytes=on_bytes,
                                           digest=digest)
        except Exception as exc:  # p2p is best effort: whatever broke, HTTP continues from the verified bytes
            self.stats.fallbacks += 1
            self.say_once("error", f"p2p: fetching {file.path} from peers failed ({type(exc).__name__}: {exc}); "
                                   f"fetching it over HTTP")
            return
        self.stats.peer_bytes += report.peer_bytes
        self.stats.wasted_bytes += report.wasted_bytes
        self.stats.banned += len(report.banned)
        self.stats.lookups += report.lookups
        self.stats.refused += report.refused
        if report.fallback:
            self.stats.fallbacks += 1
            self.say_once("fallback", f"p2p: {report.fallback} for {file.path}; fetching the rest over HTTP "
                                      f"(said once; later fallbacks are counted, not logged)")
