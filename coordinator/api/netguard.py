"""The coordinator's listener with bounded connections (issue 13): caps per address and overall, below the
file limit, and read/write timeouts — so nothing a client sends can make the process run out of descriptors.

aiohttp has no header or body read timeout and no connection cap (its keep-alive timeout only starts after a
first reply), and asyncio pauses accepting for a second on EMFILE but by then the database, a checkpoint or a
snapshot may already have failed to open a file. So every accepted connection is wrapped in a
:class:`GuardedConnection`, a thin :class:`asyncio.Protocol` that forwards every event to aiohttp's own
request handler and tracks the connection's phase (:mod:`coordinator.core.connections` holds the rules):

- at accept, :func:`coordinator.core.connections.admit` decides; a refused newcomer gets a canned 429
  (its address is at its cap) or 503 (the server is full) with a msgpack ``rate_limited`` body, written
  without reading a byte, and is closed;
- a sweep every fraction of a second closes connections past their phase's bound;
- the app (coordinator.api.app) marks when a request reaches it and while it reads the body, via :func:`mark`;
  :class:`ReplyWritten` marks it idle once aiohttp has written the reply.

:class:`GuardedSite` is a drop-in for ``web.TCPSite``. :func:`raise_fd_limit` raises the soft file limit to
the hard one at start (many systems start processes at a soft 1024).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from coordinator.config import ServerConfig
from coordinator.core.connections import Caps, Expiry, Phase, Refusal, Timeouts, address_key, admit, total_cap
from coordinator.core.ratelimit import BurstLog
from shared import wire
from shared.errors import Reason
from shared.messages import ErrorBody

logger = logging.getLogger(__name__)

#: The soft file limit assumed where the resource module does not exist (Windows).
FALLBACK_FD_LIMIT = 512
#: Listen backlog, which asyncio also uses as the number of sockets it accepts per event-loop tick.
ACCEPT_BACKLOG = 128
#: Accepted sockets not yet admitted or closed: asyncio admits a batch two ticks after accepting it and a
#: refused or evicted socket is closed a tick later, so up to this many batches are in flight at once.
ACCEPT_BATCHES_IN_FLIGHT = 4


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (idempotent); return the soft limit now in force."""
    if sys.platform == "win32":
        return FALLBACK_FD_LIMIT
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # e.g. macOS refuses above kern.maxfilesperproc
            logger.warning("could not raise the file limit from %d to %d: %s", soft, want, exc)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def _canned(status: int, phrase: str, message: str) -> bytes:
    """A complete HTTP reply written straight to a refused connection (nothing of its request is read)."""
    body = wire.encode(ErrorBody(error=Reason.RATE_LIMITED.value, message=message))
    head = (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 1\r\nConnection: close\r\nX-Content-Type-Options: nosniff\r\n\r\n")
    return head.encode("ascii") + body


@dataclass
class GuardStats:
    """Counters since start, exported by coordinator.api.metrics."""

    accepted: int = 0
    refused: dict[Refusal, int] = field(default_factory=lambda: {"per_address": 0, "total": 0})
    evicted: int = 0
    expired: dict[Expiry, int] = field(default_factory=lambda: {"header": 0, "body": 0, "idle": 0, "send": 0})
    bytes_received: int = 0
    peak: int = 0


class GuardedConnection(asyncio.Protocol):
    """One accepted connection: admission, phase tracking, and every protocol event forwarded to aiohttp."""

    def __init__(self, guard: ConnectionGuard, inner_factory: Callable[[], asyncio.Protocol]) -> None:
        self.guard = guard
        self._inner_factory = inner_factory
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        self.phase = Phase.FRESH
        self.since = guard.now()
        self.stalled_since: float | None = None
        self._pending = False  # bytes arrived while a request was being handled (a pipelined next request)
        self.reached_app = False  # the current request got past aiohttp's parser into the app (see ReplyWritten)
        self._drain_left: int | None = None  # after a refusal mid-body: bytes still discarded before closing

    # -- asyncio.Protocol --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.address = address_key(str(peer[0]) if isinstance(peer, tuple) and peer else "")
        refusal = self.guard.admit(self)
        if refusal is not None:
            transport.write(self.guard.refusal_reply[refusal])
            transport.close()
            return
        self.inner = self._inner_factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.guard.stats.bytes_received += len(data)
        if self._drain_left is not None:
            self._drain_left -= len(data)
            if self._drain_left < 0:  # the refused body goes on and on: stop reading it
                self._drain_left = None
                self.drop(abort=False)
                return
        if self.phase in (Phase.FRESH, Phase.IDLE):
            self._enter(Phase.HEADERS)
        elif self.phase is Phase.HANDLING:
            self._pending = True
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.stalled_since = self.guard.now()
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.stalled_since = None
        if self.inner is not None:
            self.inner.resume_writing()

    # -- phases ------------------------------------------------------------------------------------------
    def _enter(self, phase: Phase) -> None:
        self.phase, self.since = phase, self.guard.now()

    def mark(self, phase: Phase) -> None:
        """Called by the app. Leaving a request with bytes already in (pipelined) counts as reading headers."""
        if phase in (Phase.HANDLING, Phase.BODY):
            self._pending = False
            self.reached_app = True
        elif phase is Phase.IDLE and self._pending:
            phase, self._pending = Phase.HEADERS, False
        self._enter(phase)

    def limit_drain(self, nbytes: int) -> None:
        """The request's body was refused before it was all read: aiohttp reads and discards the rest so that
        the client can read the refusal (a close with unread data would reset it); allow ``nbytes`` more."""
        self._drain_left = nbytes

    def drop(self, *, abort: bool) -> None:
        """Close the connection (abort: at once, discarding unsent data — for a client that reads nothing)."""
        self.guard.forget(self)
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()


class ConnectionGuard:
    """Open connections by address, the caps, the sweep that enforces the timeouts, and the counters."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.timeouts = Timeouts(config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s,
                                 config.send_timeout_s)
        self.fd_limit = 0
        self.caps = Caps(total=config.max_connections or 1_000_000, per_address=config.max_connections_per_address)
        self.stats = GuardStats()
        self.open: set[GuardedConnection] = set()
        self.by_address: dict[str, set[GuardedConnection]] = {}
        self.refusal_reply: dict[Refusal, bytes] = {
            "per_address": _canned(429, "Too Many Requests", "too many open connections from your address; close "
                                   "idle ones and retry in a few seconds"),
            "total": _canned(503, "Service Unavailable", "the coordinator is at its connection limit; retry in a "
                             "few seconds"),
        }
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None
        #: Charges a request aiohttp's parser refused (it never reaches the app's middleware) to its address's
        #: request budget; the app sets it (coordinator.api.app.create_app). None: such requests cost nothing.
        self.charge: Callable[[str], None] | None = None

    def set_fd_limit(self, fd_limit: int) -> None:
        """Fix the overall cap from the process's file limit (server.max_connections / reserved_fds)."""
        self.fd_limit = fd_limit
        total = total_cap(fd_limit, self.config.reserved_fds, self.config.max_connections,
                          in_flight=ACCEPT_BACKLOG * ACCEPT_BATCHES_IN_FLIGHT)
        self.caps = Caps(total=total, per_address=min(self.config.max_connections_per_address, total))

    def now(self) -> float:
        return self._loop.time() if self._loop is not None else asyncio.get_running_loop().time()

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], GuardedConnection]:
        return lambda: GuardedConnection(self, factory)

    # -- admission -----------------------------------------------------------------------------------------
    def admit(self, conn: GuardedConnection) -> Refusal | None:
        own = self.by_address.get(conn.address, set())
        busiest = None
        if len(self.open) >= self.caps.total and self.by_address:
            busiest = max(self.by_address.values(), key=len)
        decision = admit(own, len(own), len(self.open), busiest, self.caps)
        if not decision.admit:
            assert decision.refusal is not None
            self.stats.refused[decision.refusal] += 1
            return decision.refusal
        if decision.evict is not None:
            self.stats.evicted += 1
            decision.evict.drop(abort=False)
        self.open.add(conn)
        self.by_address.setdefault(conn.address, set()).add(conn)
        self.stats.accepted += 1
        self.stats.peak = max(self.stats.peak, len(self.open))
        return None

    def forget(self, conn: GuardedConnection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            mine = self.by_address.get(conn.address)
            if mine is not None:
                mine.discard(conn)
                if not mine:
                    del self.by_address[conn.address]

    # -- timeouts ------------------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Close every connection past its phase's bound; returns how many."""
        now = self.now()
        closed = 0
        for conn in list(self.open):
            why = self.timeouts.expiry(conn, now)
            if why is not None:
                self.stats.expired[why] += 1
                conn.drop(abort=why == "send")
                closed += 1
        return closed

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.timeouts.tick_s)
            try:
                self.sweep()
            except Exception:  # never let the sweeper die: it is what bounds the connections
                logger.exception("connection sweep failed")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep_forever(), name="connection-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None


def mark(request: web.BaseRequest, phase: Phase) -> None:
    """Tell the guard what the request's connection is doing (a no-op on an unguarded site, e.g. in tests)."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if isinstance(conn, GuardedConnection):
        conn.mark(phase)


def limit_drain(request: web.BaseRequest, nbytes: int) -> None:
    """See :meth:`GuardedConnection.limit_drain` (a no-op on an unguarded site)."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if isinstance(conn, GuardedConnection):
        conn.limit_drain(nbytes)


class ReplyWritten(AbstractAccessLogger):
    """aiohttp calls its access logger once a reply has been written (or the client has gone) — for every
    request, including the errors aiohttp answers itself; this one logs nothing and marks the connection
    idle. Pass it as ``access_log_class`` (with any logger as ``access_log``) to the runner."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        transport = request.transport
        conn = transport.get_protocol() if transport is not None else None
        if isinstance(conn, GuardedConnection):
            if not conn.reached_app and conn.guard.charge is not None:  # refused by aiohttp's parser itself
                conn.guard.charge(conn.address)
            conn.reached_app = False
        mark(request, Phase.IDLE)


class BurstFilter(logging.Filter):
    """Holds back all but one record a window per message (and exception type) on the logger it filters — for
    ``aiohttp.server``, which logs a traceback for every request its parser refuses (a bad header line, a
    duplicate Host): a flood of them becomes one line a minute saying how many more there were."""

    def __init__(self, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst = BurstLog(window_s)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        held_back = self.burst.allow(f"{record.msg} {kind}", record.created)
        if held_back is None:
            return False
        if held_back:
            record.msg = f"{record.msg} ({held_back} more like it since the last report)"
        return True


PARSER_LOG = BurstFilter()


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with every accepted connection wrapped by ``guard``."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int, *,
                 backlog: int = ACCEPT_BACKLOG) -> None:
        super().__init__(runner, backlog=backlog)
        self.guard = guard
        self.host = host
        self.requested_port = port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        sockets: Any = getattr(self._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self.requested_port

    async def start(self) -> None:
        await super().start()
        server_log = logging.getLogger("aiohttp.server")
        if PARSER_LOG not in server_log.filters:
            server_log.addFilter(PARSER_LOG)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self.guard.start(loop)
        self._server = await loop.create_server(self.guard.wrap(server), self.host, self.requested_port,
                                                reuse_address=True, backlog=self._backlog)

    async def stop(self) -> None:
        await self.guard.stop()
        await super().stop()
