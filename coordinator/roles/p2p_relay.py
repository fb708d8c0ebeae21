"""The signed calls on the coordinator's libp2p peer (``p2p.calls``; docs/protocol.md §6b): the peer relays each
call to the API over loopback HTTP and streams the API's status and reply back, so the envelopes, the handlers,
the checks and the store writes are the HTTP ones — one code path, whichever transport a client used.

Bounds, in the order a call meets them: the head within 10 s; only the paths the API routes as signed POSTs
(``coordinator.limits.SIGNED_POSTS``, the one table); a body no larger than the API's cap for its path (refused
here, before a byte of it is read and without calling the API); at most ``p2p.calls_at_once`` calls relayed at
once (and no more than the API's connections per address; 503 rate_limited past it) and ``p2p.calls_per_peer`` per peer (429); the body within 10 s per chunk and
``server.body_timeout_s`` in all; the API's reply within ``p2p.call_timeout_s``; each reply chunk written within 10 s.

The API's per-address budgets must see the caller, not this relay's 127.0.0.1: the relay names the address the
caller's libp2p connection comes from — the IP of the remote multiaddr this peer observes for the stream (hivemind's
``StreamInfo.addr``; for a relay circuit, the relay's) — and its peer id in headers, with a token that only holders
of the run's key can compute (coordinator.run.relay). A libp2p peer id costs nothing to make, so it is never an
address: the API's budgets, caps and registration addresses count the IP, and at most ``p2p.peers_per_address``
peer ids per IP are relayed within ``p2p.peer_window_s`` (:class:`PeersPerAddress`; issue 24).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

import aiohttp

from coordinator.config import CoordinatorConfig
from coordinator.limits import SIGNED_POSTS
from coordinator.run.records import RelayReport
from coordinator.run.relay import observed_address, relay_headers
from shared import wire
from shared.errors import ProtocolError, Reason
from shared.messages import MAX_CALL_BYTES, CallReply, CallRequest, ErrorBody
from shared.p2p_calls import CHUNK, IDLE_S, read_body, read_head, write_body, write_head

logger = logging.getLogger(__name__)


def _error(reason: Reason, message: str, status: int | None = None) -> tuple[int, bytes]:
    err = ProtocolError(reason, message)
    return status or err.http_status, wire.encode(ErrorBody(error=reason.value, message=message[:2048]))


async def _discard(reader: asyncio.StreamReader, limit: int) -> None:
    """Read and drop up to ``limit`` bytes until the caller closes its side (the reference client stops sending when
    the reply arrives), for at most 10 s."""
    async def drop() -> None:
        left = limit
        while left > 0 and (chunk := await reader.read(min(CHUNK, left))):
            left -= len(chunk)

    with contextlib.suppress(Exception):
        await asyncio.wait_for(drop(), IDLE_S)


class PeersPerAddress:
    """The peer ids each address called from recently (pure: the caller passes ``now``), bounded in both
    directions: at most ``per_address`` ids per address within ``window_s`` of their last call, and at most
    ``max_addresses`` addresses (least recently seen forgotten), so a flood of ids or addresses cannot grow it."""

    def __init__(self, per_address: int, window_s: float, max_addresses: int = 10_000) -> None:
        self.per_address = per_address
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._seen: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()  # address → peer id → last call

    def admit(self, address: str, peer: str, now: float) -> bool:
        """True (and noted) if ``peer`` may call from ``address`` now; False if the address already has
        ``per_address`` other recent peer ids."""
        peers = self._seen.setdefault(address, OrderedDict())
        self._seen.move_to_end(address)
        while peers and next(iter(peers.values())) < now - self.window_s:
            peers.popitem(last=False)
        if peer not in peers and len(peers) >= self.per_address:
            return False
        peers[peer] = now
        peers.move_to_end(peer)
        while len(self._seen) > self.max_addresses:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)


class CallRelay:
    """The ``/echo-swarm/call/1`` stream handler of the coordinator's peer."""

    def __init__(self, config: CoordinatorConfig, token: str) -> None:
        self.config = config
        self.token = token
        # every relayed call is one loopback connection to the API, which caps connections per address
        self.at_once = min(config.p2p.calls_at_once, config.server.max_connections_per_address)
        self.active = 0
        self.per_peer: Counter[str] = Counter()
        self.relayed: Counter[str] = Counter()  # calls answered by the API, per path (the p2p role's report)
        self.peers = PeersPerAddress(config.p2p.peers_per_address, config.p2p.peer_window_s)
        self.refused = 0  # calls refused here (unknown path, too large, over a bound, the API unreachable)
        self._session: aiohttp.ClientSession | None = None

    def report(self) -> RelayReport:
        return RelayReport(relayed=dict(self.relayed), refused=self.refused, active=self.active)

    def api_url(self) -> str:
        """The API's loopback URL: its port from the run dir's endpoint.json (written once it listens; a restarted
        API keeps it), its host unless that is a wildcard."""
        server = self.config.server
        port = server.port
        endpoint = self.config.run_dir / "endpoint.json"
        if endpoint.exists():
            port = int(json.loads(endpoint.read_text())["port"])
        host = "127.0.0.1" if server.host in ("", "0.0.0.0", "::", "localhost") else server.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            cfg = self.config.p2p
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.at_once),
                timeout=aiohttp.ClientTimeout(total=cfg.call_timeout_s, connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        address = observed_address(str(getattr(info, "addr", "") or ""))
        admitted = False
        try:
            head = await read_head(reader, CallRequest)
            status, data = self._admit(peer, address, head)
            if status == 0:
                admitted = True
                status, data = await self._relay(peer, address, head, reader)
            else:
                self.refused += 1
            await write_head(writer, CallReply(status=status, length=len(data)))
            await write_body(writer, data)
            if not admitted:  # refused from the head: take what the caller still sends until it stops (bounded),
                await _discard(reader, head.length)  # since closing on unread bytes resets the stream, reply and all
        except Exception as exc:  # a bad frame, a caller that went silent or away: nothing to answer
            logger.info("p2p call from %s ended: %s: %s", peer[:12], type(exc).__name__, exc)
        finally:
            if admitted:
                self.active -= 1
                self.per_peer[peer] -= 1
                if self.per_peer[peer] <= 0:
                    del self.per_peer[peer]
            writer.close()

    def _admit(self, peer: str, address: str, head: Any) -> tuple[int, bytes]:
        """(0, b"") when the call may go to the API, else the refusal to send back."""
        cfg = self.config.p2p
        if head.path not in SIGNED_POSTS:
            return _error(Reason.NOT_FOUND, f"{head.path[:80]} is not a signed call; over libp2p only "
                                            f"{', '.join(SIGNED_POSTS)} are served (docs/protocol.md §6b)")
        cap = self.config.body_cap(head.path)
        if head.length > cap:
            return _error(Reason.BODY_TOO_LARGE, f"request body is {head.length} bytes; the limit for {head.path} "
                                                 f"is {cap}")
        if self.active >= self.at_once:
            return _error(Reason.RATE_LIMITED, "the coordinator's libp2p peer relays as many calls as it may; "
                                               "retry in 1s", status=503)
        if self.per_peer[peer] >= cfg.calls_per_peer:
            return _error(Reason.RATE_LIMITED, f"this peer has {cfg.calls_per_peer} calls in flight already; "
                                               f"retry in 1s")
        if not self.peers.admit(address, peer, time.monotonic()):
            return _error(Reason.RATE_LIMITED, f"{cfg.peers_per_address} other libp2p peer ids called from address "
                                               f"{address} in the last {cfg.peer_window_s:.0f}s; a host needs one "
                                               f"(retry later with that one)")
        self.active += 1
        self.per_peer[peer] += 1
        return 0, b""

    async def _relay(self, peer: str, address: str, head: Any, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        body = await asyncio.wait_for(read_body(reader, head.length), self.config.server.body_timeout_s)
        headers = {"Content-Type": "application/msgpack"} | relay_headers(self.token, peer, address)
        try:
            async with self.session().post(self.api_url() + head.path, data=body, headers=headers) as resp:
                if resp.content_length is not None and resp.content_length > MAX_CALL_BYTES:
                    return _error(Reason.INTERNAL, "the API's reply is larger than a call may carry", status=502)
                data = bytearray()
                while chunk := await resp.content.read(64 * 1024):
                    data += chunk
                    if len(data) > MAX_CALL_BYTES:
                        return _error(Reason.INTERNAL, "the API's reply is larger than a call may carry", status=502)
                self.relayed[head.path] += 1
                return resp.status, bytes(data)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.refused += 1
            logger.warning("p2p relay: the API did not answer %s (%s: %s)", head.path, type(exc).__name__, exc)
            return _error(Reason.UNAVAILABLE, "the coordinator's API did not answer the libp2p relay in time; "
                                              "resend (or use its HTTP address)")
