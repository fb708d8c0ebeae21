"""A libp2p peer for snapshot files (the optional ``p2p`` extra: hivemind 1.1.12), used by the coordinator and by
volunteers alike: a DHT node that finds who holds a file, and a stream protocol that moves it piece by piece.

Why it is safe to take bytes from strangers: every piece is checked against the sha256 the coordinator signed in
the manifest before it is written, the whole file again before it enters the cache, and a peer that sends one bad
piece is banned for the rest of the download. A peer can waste a client's time, never change what it runs.

hivemind pitfalls this module avoids (../shared/notes/p2p.md): bulk data only over streams (a unary reply over
4 MiB hangs the caller), every call under ``asyncio.wait_for``, validators see key *hashes* (DHTID), NAT port
mapping, AutoNAT and relays off, ``DHT.store``'s result is not trusted (readers re-check). The DHT runs in this
process's event loop (``DHTNode``, not the forking ``hivemind.DHT``), so there is no second Python process.
Importing hivemind imports torch: this module imports it only in :meth:`PeerNode.start`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel

from shared import records, wire
from shared.errors import EchoSwarmError
from shared.hashing import FileDigest
from shared.messages import BlobReply, BlobRequest, HolderEntry, LatestRecord, ManifestFile
from shared.p2p_stream import MAX_FRAME, PieceReceiver, send_file

logger = logging.getLogger(__name__)

BLOB_PROTOCOL = "/echo-swarm/blob/1"
HOLDER_TTL_S = 120.0  # a holder entry lives this long unless refreshed (every HOLDER_TTL_S / 2)
CALL_TIMEOUT_S = 10.0  # a DHT call, a stream open, a request/reply frame
IDLE_TIMEOUT_S = 30.0  # a blob stream is cut after this long without a byte
#: Between rounds of asking holders, while none delivers: from the first to the last, doubling. Every round costs
#: a DHT lookup and a stream per holder asked, and twenty waiting clients polling every 0.3-1 s were a large part
#: of what p2p cost (docs/benchmarks.md); a new holder or a delivered piece starts again from the first.
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 4.0
#: Answers after which a peer is not asked again for this file in this download: it will not change its mind.
FINAL_REFUSALS = frozenset({"seeded", "capped", "no_such_blob", "relayed", "bad_request"})
MAX_LATEST_TTL_S = 86_400.0
#: DHT traversals visit this many nearest nodes (hivemind's default is its bucket size, 20), and a holder entry is
#: stored on as many (``num_replicas``): every node visited sends the whole holder list of the file and every entry
#: in it is RSA-verified on arrival, so a lookup in a 20-peer swarm cost ~20 × holders verifications. A lookup
#: reaches the nodes that store the entries either way.
DHT_BEAM = 5
DHT_WORKERS = 2  # concurrent requests of one traversal; the ones in flight when it ends are wasted
MEMO_RECORDS = 4096  # records whose signature this node checked and accepted (see _memo_validator_class)


class P2PUnavailable(EchoSwarmError):
    """The libp2p peer cannot run here: hivemind is not installed, or its p2pd daemon did not start."""


# ---- framing: a 4-byte big-endian length, then msgpack of one message ---------------------------------------
async def write_frame(writer: asyncio.StreamWriter, message: BaseModel) -> None:
    data = wire.encode(message)
    writer.write(struct.pack(">I", len(data)) + data)
    await asyncio.wait_for(writer.drain(), CALL_TIMEOUT_S)


M = TypeVar("M", bound=BaseModel)


async def read_frame(reader: asyncio.StreamReader, model: type[M]) -> M:
    head = await asyncio.wait_for(reader.readexactly(4), CALL_TIMEOUT_S)
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes; the limit is {MAX_FRAME}")
    return wire.decode(await asyncio.wait_for(reader.readexactly(n), CALL_TIMEOUT_S), model)


# ---- pieces ----------------------------------------------------------------------------------------------
def verified_prefix(partial: Path, file: ManifestFile, digest: FileDigest | None = None) -> int:
    """Bytes at the start of ``partial`` that match ``file``'s piece hashes (whole pieces, or the whole file);
    the file is cut back to that, so a download resumes after its last verified piece whatever wrote the rest.
    ``digest`` (the whole file's running sha256) is left covering exactly those bytes."""
    if digest is not None:
        digest.reset()
    if not partial.exists():
        return 0
    good = 0
    with open(partial, "r+b") as fh:
        for i, piece_hash in enumerate(file.pieces):
            want = min(file.piece_size, file.size - i * file.piece_size)
            data = fh.read(want)
            if len(data) < want or hashlib.sha256(data).digest() != piece_hash:
                break
            good += want
            if digest is not None:
                digest.update(data)
        fh.truncate(good)
    return good


@dataclass
class Uploads:
    """Admission of incoming blob streams: at most ``concurrent`` at once, each blob to at most ``per_blob``
    distinct peers (a peer that resumes keeps its slot), at most ``byte_cap`` bytes in all; ``serve`` False
    refuses everything. The coordinator uses ``per_blob`` as its seed limit k."""

    concurrent: int = 2
    per_blob: int = 3
    byte_cap: int | None = None
    serve: bool = True
    active: int = 0
    served_bytes: int = 0
    refused: int = 0
    peers_per_blob: dict[str, set[str]] = field(default_factory=dict)

    def admit(self, peer: str, sha256: str) -> str:
        if not self.serve:
            return "busy"
        if self.byte_cap is not None and self.served_bytes >= self.byte_cap:
            return "capped"
        peers = self.peers_per_blob.setdefault(sha256, set())
        if peer not in peers and len(peers) >= self.per_blob:
            return "seeded"
        if self.active >= self.concurrent:
            return "busy"
        peers.add(peer)
        self.active += 1
        return "ok"


@dataclass
class FetchReport:
    """What one peer download did, for the client's log, its panel and the benchmark."""

    peer_bytes: int = 0
    wasted_bytes: int = 0  # bytes of pieces that failed their hash
    banned: list[str] = field(default_factory=list)
    refused: int = 0  # busy / seeded / absent answers (the cost of polling)
    lookups: int = 0  # holder lookups in the DHT
    fallback: str = ""  # why the rest comes over HTTP ("" when the peers delivered the whole file)


def _import_hivemind() -> None:
    """Import hivemind (raises ImportError without it), undoing its one process-wide side effect on our logs: its
    logging module renames the WARNING level to "WARN" for every logger of the process."""
    import hivemind.utils.logging  # noqa: F401

    logging.addLevelName(logging.WARNING, "WARNING")


def _validator_class() -> type:
    _import_hivemind()
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase
    from hivemind.utils.serializer import MSGPackSerializer

    regular = MSGPackSerializer.dumps(None)

    class EchoSwarmValidator(RecordValidatorBase):
        """Every node of the swarm runs this: the run's latest-version key takes only records signed by the
        coordinator key (not re-dated: the signed expiry is the DHT expiry); every other key takes only holder
        entries in owner subkeys (whose signatures hivemind's RSASignatureValidator checks first), so nobody can
        write another peer's entry or fill the DHT with anything else."""

        def __init__(self, run_id: str, coordinator_key: bytes) -> None:
            self.run_id, self.coordinator_key = run_id, coordinator_key
            self.latest_id = DHTID.generate(source=records.latest_key(run_id)).to_bytes()
            self.refused = 0

        def validate(self, record: DHTRecord) -> bool:
            ok = self._check(record)
            self.refused += not ok
            return ok

        def _check(self, record: DHTRecord) -> bool:
            try:
                value = msgpack.unpackb(record.value, raw=False)
                if not isinstance(value, bytes) or len(value) > MAX_FRAME:
                    return False
                if record.key == self.latest_id:
                    if record.subkey != regular:
                        return False
                    records.open_latest(value, self.coordinator_key, self.run_id,
                                        expiration=record.expiration_time, max_ttl_s=MAX_LATEST_TTL_S)
                    return True
                if record.subkey == regular or b"[owner:" not in record.subkey:
                    return False
                wire.decode(value, HolderEntry)
                return True
            except Exception:  # anything malformed is simply not stored
                return False

    return EchoSwarmValidator


def _memo_validator_class() -> type:
    _import_hivemind()
    from hivemind.dht.validation import CompositeValidator

    class MemoValidator(CompositeValidator):
        """hivemind validates every record of every DHT reply and store: a holder list comes back from each node
        a lookup visits, on every lookup, and each entry cost an RSA key parse and verification (most of the
        client's CPU in a 20-peer swarm, by profile). A record is immutable bytes whose acceptance depends on
        nothing else, so one accepted before is accepted again without the work."""

        def __init__(self, validators: list[Any]) -> None:
            super().__init__(validators)
            self._accepted: dict[Any, None] = {}

        def validate(self, record: Any) -> bool:
            if record in self._accepted:
                return True
            ok: bool = super().validate(record)
            if ok:
                if len(self._accepted) >= MEMO_RECORDS:
                    del self._accepted[next(iter(self._accepted))]  # the oldest
                self._accepted[record] = None
            return ok

    return MemoValidator


BlobResolver = Callable[[str], Path | None]


async def stop_peer(node: PeerNode | None, loop: asyncio.Task[None] | None) -> None:
    """Stop a peer and the background loop that uses it (the coordinator's publisher, a volunteer's announcer):
    the loop first, so it never calls a node that is shutting down."""
    if loop is not None:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    if node is not None:
        await node.stop()


class PeerNode:
    """One libp2p peer: a p2pd daemon, a DHT node in this event loop, the blob stream server."""

    def __init__(self, run_id: str, coordinator_key: bytes, resolve: BlobResolver, uploads: Uploads) -> None:
        self.run_id, self.coordinator_key = run_id, coordinator_key
        self.resolve = resolve  # sha256 -> a fully verified file, or None
        self.uploads = uploads
        self.p2p: Any = None
        self.dht: Any = None
        self.validator: Any = None
        self.peer_id = ""
        self._rsa_subkey: bytes = b""

    async def start(self, *, initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str] | None = None,
                    client_mode: bool = False, startup_timeout_s: float = 20.0) -> None:
        """Start p2pd and join the DHT (loopback-only defaults; no UPnP, AutoNAT or relays). Raises
        P2PUnavailable with what to do when hivemind is missing or p2pd fails."""
        try:
            _import_hivemind()
            from hivemind.dht.crypto import RSASignatureValidator
            from hivemind.dht.node import DHTNode
            from hivemind.p2p import P2P
            from hivemind.utils.crypto import RSAPrivateKey
        except ImportError as exc:
            raise P2PUnavailable(f"hivemind is not installed ({exc}); install it with pip install "
                                 f"'echo-swarm[p2p]'") from None
        try:
            self.p2p = await asyncio.wait_for(P2P.create(
                initial_peers=initial_peers, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs or None,
                nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False, use_ipfs=False,
                startup_timeout=startup_timeout_s), startup_timeout_s + 5)
        except Exception as exc:
            raise P2PUnavailable(f"the libp2p daemon (p2pd) did not start: {type(exc).__name__}: {exc}") from None
        self.peer_id = self.p2p.peer_id.to_base58()
        rsa = RSAPrivateKey()  # this session's holder identity: only it can change its holder entries
        signer = RSASignatureValidator(rsa)
        self._rsa_subkey = signer.local_public_key
        self.validator = _validator_class()(self.run_id, self.coordinator_key)
        try:
            self.dht = await asyncio.wait_for(DHTNode.create(
                p2p=self.p2p, initial_peers=initial_peers, client_mode=client_mode, wait_timeout=3,
                record_validator=_memo_validator_class()([signer, self.validator]), ensure_bootstrap_success=False,
                num_workers=DHT_WORKERS, num_replicas=DHT_BEAM, cache_nearest=0), startup_timeout_s)
        except Exception as exc:
            await self.p2p.shutdown()
            raise P2PUnavailable(f"could not join the DHT: {type(exc).__name__}: {exc}") from None
        await self.p2p.add_binary_stream_handler(BLOB_PROTOCOL, self._serve)

    async def visible_maddrs(self) -> list[str]:
        maddrs = await asyncio.wait_for(self.p2p.get_visible_maddrs(), CALL_TIMEOUT_S)
        return [f"{m}/p2p/{self.peer_id}" if "/p2p/" not in str(m) else str(m) for m in maddrs]

    async def stop(self) -> None:
        """Leave the DHT and stop p2pd (DHTNode.shutdown leaves a P2P it did not create running)."""
        dht, p2p, self.dht, self.p2p = self.dht, self.p2p, None, None
        for what, step in (("dht", dht.shutdown if dht is not None else None),
                           ("p2pd", p2p.shutdown if p2p is not None else None)):
            if step is None:
                continue
            try:
                await asyncio.wait_for(step(), CALL_TIMEOUT_S)
            except Exception as exc:
                logger.warning("p2p shutdown (%s): %s", what, exc)

    # ---- DHT records ---------------------------------------------------------------------------------------
    async def publish_latest(self, record: LatestRecord) -> None:
        from hivemind.utils.timed_storage import get_dht_time

        if record.expires_at <= get_dht_time():
            return
        await asyncio.wait_for(self.dht.store(records.latest_key(self.run_id), wire.encode(record),
                                              record.expires_at), CALL_TIMEOUT_S)

    async def get_latest(self) -> LatestRecord | None:
        """The newest valid latest-version record found (validated again here: never trust a store's answer)."""
        found = await asyncio.wait_for(self.dht.get(records.latest_key(self.run_id), latest=True), CALL_TIMEOUT_S)
        if found is None or not isinstance(found.value, bytes):
            return None
        try:
            return records.open_latest(found.value, self.coordinator_key, self.run_id, expiration=found.expiration_time,
                                       max_ttl_s=MAX_LATEST_TTL_S)
        except Exception:
            return None

    async def announce(self, sha256s: list[str]) -> None:
        """Say, for HOLDER_TTL_S, that this peer holds and serves each of these verified files."""
        from hivemind.utils.timed_storage import get_dht_time

        if not sha256s or not self.uploads.serve:
            return
        entry = wire.encode(HolderEntry(peer_id=self.peer_id, served_bytes=self.uploads.served_bytes))
        keys = [records.blob_key(self.run_id, s) for s in sha256s]
        await asyncio.wait_for(self.dht.store_many(keys, [entry] * len(keys), get_dht_time() + HOLDER_TTL_S,
                                                   subkeys=[self._rsa_subkey] * len(keys), beam_size=DHT_BEAM),
                               CALL_TIMEOUT_S)

    async def holders(self, sha256: str) -> dict[str, int]:
        """peer id -> bytes it says it served, of every live holder entry of this file."""
        found = await asyncio.wait_for(self.dht.get(records.blob_key(self.run_id, sha256), latest=True,
                                                    beam_size=DHT_BEAM), CALL_TIMEOUT_S)
        out: dict[str, int] = {}
        if found is None or not isinstance(found.value, dict):
            return out
        for item in found.value.values():
            try:
                entry = wire.decode(item.value, HolderEntry)
            except Exception:
                continue
            out[entry.peer_id] = max(out.get(entry.peer_id, 0), entry.served_bytes)
        return out

    # ---- serving ----------------------------------------------------------------------------------------
    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        status, admitted = "bad_request", False
        try:
            request = await read_frame(reader, BlobRequest)
            path = self.resolve(request.sha256)
            if "/p2p-circuit" in str(info.addr):
                status = "relayed"  # bulk data never rides a relay circuit
            elif path is None:
                status = "no_such_blob"
            else:
                status = self.uploads.admit(peer, request.sha256)
                admitted = status == "ok"
            if not admitted or path is None:
                await write_frame(writer, BlobReply(status=status))  # type: ignore[arg-type]
                self.uploads.refused += 1
                return
            size = path.stat().st_size
            if request.offset > size:
                await write_frame(writer, BlobReply(status="bad_request"))
                return
            await write_frame(writer, BlobReply(status="ok", length=size - request.offset))
            await send_file(writer.transport, path, request.offset, IDLE_TIMEOUT_S, self._count_served)
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                raise
            logger.info("p2p upload to %s ended: %s", peer[:12], type(exc).__name__)
        finally:
            if admitted:
                self.uploads.active -= 1
            writer.close()

    def _count_served(self, n: int) -> None:
        self.uploads.served_bytes += n

    # ---- fetching ---------------------------------------------------------------------------------------
    async def fetch(self, file: ManifestFile, partial: Path, *, deadline_s: float,
                    avoid: frozenset[str] | set[str] = frozenset(), last: frozenset[str] | set[str] = frozenset(),
                    first: frozenset[str] | set[str] = frozenset(), on_bytes: Callable[[int], None] | None = None,
                    digest: FileDigest | None = None) -> FetchReport:
        """Download ``file`` into ``partial`` from peers, piece by piece, each checked on arrival; resume after
        the last verified piece. Returns when the file is complete or when for ``deadline_s`` no peer delivered a
        byte and no new holder appeared (then ``report.fallback`` says why and the caller continues over HTTP from
        what is on disk). ``last``: peers tried only after all others (the coordinator, which seeds a few peers
        only); ``first``: peers tried before all others (tests and benchmarks aim at a known bad peer with it).
        ``digest``: the whole file's running sha256, left covering exactly the verified bytes on disk, so the
        caller's whole-file check needs no second pass over the file."""
        report = FetchReport()
        digest = digest if digest is not None else FileDigest()
        have = verified_prefix(partial, file, digest)
        banned: set[str] = set()
        done_with: set[str] = set()  # peers whose refusal is final for this file (seeded, capped, ...)
        progress_at, known_holders, pause = time.monotonic(), 0, RETRY_FIRST_S
        candidates: list[str] = []
        while have < file.size:
            report.lookups += 1
            try:
                holders = await self.holders(file.sha256)
            except (TimeoutError, Exception) as exc:
                holders = {}
                logger.info("p2p: holder lookup failed: %s", type(exc).__name__)
            if len(holders) > known_holders:  # the swarm progresses (a seed finished): wait for it, not for HTTP
                known_holders, progress_at, pause = len(holders), time.monotonic(), RETRY_FIRST_S
            candidates = [p for p in holders if p != self.peer_id and p not in banned and p not in avoid
                          and p not in done_with]
            random.shuffle(candidates)
            candidates.sort(key=lambda p: (p not in first, p in last))
            for peer in candidates:
                before = have
                have, status = await self._fetch_from(peer, file, partial, have, report, on_bytes, digest)
                if status == "bad_piece":
                    banned.add(peer)
                    report.banned.append(peer)
                elif status not in ("ok", "cut"):
                    report.refused += 1
                    if status in FINAL_REFUSALS:
                        done_with.add(peer)
                if have > before:
                    progress_at, pause = time.monotonic(), RETRY_FIRST_S
                if have >= file.size:
                    break
            if have >= file.size:
                break
            if time.monotonic() - progress_at > deadline_s:
                report.fallback = (f"every holder was bad ({len(banned)} banned)" if banned and not
                                   [p for p in candidates if p not in banned] else
                                   f"no peer delivered the file within {deadline_s:.0f}s")
                break
            await asyncio.sleep(random.uniform(0.5, 1.0) * pause)  # holders busy or absent: ask again, less often
            pause = min(2 * pause, RETRY_MAX_S)
        return report

    async def _fetch_from(self, peer: str, file: ManifestFile, partial: Path, have: int, report: FetchReport,
                          on_bytes: Callable[[int], None] | None, digest: FileDigest) -> tuple[int, str]:
        """Fetch from one peer from byte ``have`` (a piece boundary) on: (verified bytes now on disk, status)."""
        from hivemind.p2p import PeerID

        writer = None
        try:
            _, _, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), BLOB_PROTOCOL), CALL_TIMEOUT_S)
            receiver = PieceReceiver(writer.transport)  # reads the stream from here on
            data = wire.encode(BlobRequest(sha256=file.sha256, offset=have))
            writer.transport.write(struct.pack(">I", len(data)) + data)
            reply = wire.decode(await receiver.frame(CALL_TIMEOUT_S), BlobReply)
            if reply.status != "ok":
                return have, reply.status
            if reply.length != file.size - have:
                return have, "bad_piece"  # it claims another size than the manifest: treat as lying
            with open(partial, "ab") as fh:
                fh.truncate(have)
                for index in range(have // file.piece_size, len(file.pieces)):
                    want = min(file.piece_size, file.size - index * file.piece_size)
                    piece = await receiver.fill(want, IDLE_TIMEOUT_S)
                    if hashlib.sha256(piece).digest() != file.pieces[index]:
                        report.wasted_bytes += want
                        logger.warning("p2p: peer %s sent a bad piece %d of %s; banned for this download",
                                       peer[:12], index, file.path)
                        return have, "bad_piece"
                    fh.write(piece)  # from the receive buffer: the only copy of the bytes in Python is the kernel's
                    fh.flush()
                    digest.update(piece)
                    have += want
                    report.peer_bytes += want
                    if on_bytes is not None:
                        on_bytes(want)
            return have, "ok"
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as exc:
            logger.info("p2p: transfer from %s stopped: %s", peer[:12], type(exc).__name__)
            return have, "cut"
        except Exception as exc:  # hivemind's own errors (P2PDaemonError, P2PHandlerError): try another peer
            logger.info("p2p: transfer from %s failed: %s: %s", peer[:12], type(exc).__name__, exc)
            return have, "cut"
        finally:
            if writer is not None:
                writer.close()
