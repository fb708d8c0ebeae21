"""HTTP client for the coordinator protocol: signs every request, decodes every reply strictly, and retries
transient failures (connection errors, timeouts, 5xx, 429) with capped exponential backoff.

Two ways of retrying. Before the client has joined (the first contact), ``retry.attempts`` bound the attempts and
each retry is one short line saying what failed: a wrong URL fails within seconds, with a message that tells
"nothing listening" from "not an echo-swarm coordinator" (:class:`NotACoordinator`). Once joined (``patient``),
the client outlasts a coordinator restart or a network outage: it retries for ``retry.give_up_after_s`` (None:
for ever), with the backoff capped at ``retry.max_s``, and reports only the change of state — lost, then back —
through ``on_outage``, not every attempt.

With ``calls`` set (`join --p2p-jobs`), signed POSTs go to the coordinator's libp2p peer first
(swarm_client.peer_calls, docs/protocol.md §6b): the same envelope, the same status and reply bytes, so every
caller stays unchanged; when libp2p fails the same attempt goes over HTTP."""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import aiohttp
import pydantic

from shared import wire
from shared.crypto import sign_request
from shared.endpoints import HEALTHZ, INFO, Rep, Req, SignedCall
from shared.errors import EchoSwarmError, ProtocolError, Reason
from shared.messages import ErrorBody, Info, Message
from swarm_client.identity import Identity

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
UP_POLL_S = 0.5  # how often a client started with its coordinator looks for it (CoordinatorClient.up)
STOP_POLL_S = 0.25  # how soon a backoff notices that the client is stopping


class CoordinatorUnreachable(EchoSwarmError):
    """The coordinator could not be reached after all retries."""


class ClientStopping(EchoSwarmError):
    """The client is stopping (Ctrl-C, SIGTERM) while a request was waiting to be retried: not a failure."""


class NotACoordinator(EchoSwarmError):
    """Something answers at the URL, but not as an echo-swarm coordinator (a web server, another service)."""


class RetryPolicy(pydantic.BaseModel):
    attempts: int = 8  # before joining: attempts per request
    base_s: float = 0.5
    max_s: float = 30.0  # cap of the backoff
    give_up_after_s: float | None = None  # once joined: how long an outage may last before giving up (None: never)

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * 2**min(attempt, 32)) * (0.5 + random.random() / 2)


class Refused(ProtocolError):
    """A refusal as the coordinator sent it. ``code`` is the raw reason code, which may be one this client
    version does not know (then ``reason`` is INTERNAL): callers print the server's message as is. ``decoded``:
    the body was a protocol error body (False: some other server's page)."""

    def __init__(self, reason: Reason, message: str, *, code: str, status: int, decoded: bool = True) -> None:
        super().__init__(reason, message)
        self.code = code
        self.status = status
        self.decoded = decoded


def refusal_code(exc: ProtocolError) -> str:
    return getattr(exc, "code", exc.reason.value)


def _refusal(status: int, body: bytes) -> ProtocolError:
    try:
        err = wire.decode(body, ErrorBody, max_bytes=64 * 1024)
        reason = Reason(err.error) if err.error in Reason._value2member_map_ else Reason.INTERNAL
        return Refused(reason, err.message, code=err.error, status=status)
    except (ProtocolError, ValueError):
        return Refused(Reason.INTERNAL, f"HTTP {status}: {body[:200]!r}", code=Reason.INTERNAL.value, status=status,
                       decoded=False)


def describe_failure(exc: BaseException) -> str:
    """A transport failure in a few words a volunteer understands."""
    if isinstance(exc, aiohttp.ClientConnectorDNSError) or (
            isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, socket.gaierror)):
        return "the host name does not resolve"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED or isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused: nothing is listening there"
        return f"cannot connect ({exc.os_error.strerror or type(exc.os_error).__name__})"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "the connection was closed"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def duration_text(seconds: float) -> str:
    """``42s``, ``2m17s``, ``1h05m``: how long, as the client's messages and panel say it."""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class CallTransport(Protocol):
    """Another way to send a signed POST (swarm_client.peer_calls.PeerCalls): (status, reply bytes), or None when
    it cannot right now (it said why) and the request goes over HTTP."""

    def send(self, path: str, data: bytes) -> Awaitable[tuple[int, bytes] | None]: ...


class CoordinatorClient:
    def __init__(self, base_url: str, identity: Identity | None, *, timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, on_retry: Callable[[str], None] | None = None,
                 on_outage: Callable[[str | None], None] | None = None,
                 count: Callable[[int], None] | None = None) -> None:
        """``identity`` may come later (set the attribute): GETs need none, so a client checks its coordinator
        before it writes an identity. ``on_outage``: called (once joined, see ``patient``) with what failed when
        the coordinator is lost, and with None when it answers again. ``count``: bytes sent and received."""
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry or (lambda msg: logger.warning("%s", msg))
        self.on_outage = on_outage
        self.count = count
        self.stopping: Callable[[], bool] = lambda: False  # the client is stopping: abandon retries at once
        self.patient = False  # set once joined: retry through outages, report state changes only
        self.down_since: float | None = None  # monotonic time the current outage began (patient mode)
        self.timeout_s = timeout_s
        self.calls: CallTransport | None = None  # `join --p2p-jobs`: signed POSTs over libp2p first
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10))

    async def close(self) -> None:
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def _request(self, method: str, path: str, body_fn: Callable[[], bytes] | None) -> bytes:
        last = ""
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                status, raw = await self._send(method, path, body_fn)
                if status == 200 or (status < 500 and status != 429):
                    self._reachable()
                if status == 200:
                    return raw
                if status < 500 and status != 429:
                    raise _refusal(status, raw)
                last = f"HTTP {status}: {_refusal(status, raw).message}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                last = describe_failure(exc)
            attempt += 1
            wait = self.retry.delay(attempt - 1)
            if self.patient:
                if self.down_since is None:
                    self.down_since = time.monotonic()
                    if self.on_outage is not None:
                        self.on_outage(last)
                limit = self.retry.give_up_after_s
                if limit is not None and time.monotonic() - self.down_since + wait > limit:
                    raise CoordinatorUnreachable(
                        f"the coordinator at {self.base_url} has not answered for {duration_text(time.monotonic() - self.down_since)} "
                        f"({last}); gave up after --give-up-after {limit:g}s")
                logger.info("coordinator at %s did not answer %s (%s); retrying in %.1fs", self.base_url, path, last, wait)
            elif attempt >= self.retry.attempts:
                raise CoordinatorUnreachable(
                    f"cannot reach the coordinator at {self.base_url}: {last} ({attempt} attempts over "
                    f"{duration_text(time.monotonic() - started)}). Check the host and port in the URL and that the "
                    f"coordinator is running (try: curl {self.base_url}{HEALTHZ.path})")
            else:
                self.on_retry(f"{self.base_url}: {last}; retry {attempt + 1}/{self.retry.attempts} in {wait:.1f}s")
            await self._backoff(wait)

    async def _backoff(self, seconds: float) -> None:
        """Sleep before the next attempt, but give up at once when the client is stopping (an outage's waits
        reach a minute: Ctrl-C must not wait for them)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.stopping():
                raise ClientStopping("stopping: the coordinator was not reached")
            await asyncio.sleep(min(left, STOP_POLL_S))
        if self.stopping():
            raise ClientStopping("stopping: the coordinator was not reached")

    def _reachable(self) -> None:
        if self.down_since is not None:
            down = time.monotonic() - self.down_since
            self.down_since = None
            logger.info("coordinator at %s answers again after %.0fs", self.base_url, down)
            if self.on_outage is not None:
                self.on_outage(None)

    async def _send(self, method: str, path: str, body_fn: Callable[[], bytes] | None) -> tuple[int, bytes]:
        """One attempt: the HTTP status and reply bytes, over libp2p when ``calls`` is set and can, else HTTP.
        The HTTP fallback carries a body signed afresh: a libp2p call can fail after the relay handed it to the API
        (the coordinator's p2p role killed mid-call), and the same envelope again would be refused as replayed —
        a refusal that stops the client, for a call the coordinator may well have answered."""
        data = body_fn() if body_fn else None
        if data is not None and self.calls is not None:
            sent = await self.calls.send(path, data)
            if sent is not None:
                self._count(len(data) + len(sent[1]))
                return sent
            data = body_fn() if body_fn else None
        async with self._session.request(method, self.base_url + path, data=data,
                                         headers={"Content-Type": "application/msgpack"}) as resp:
            raw = await resp.read()
        self._count(len(data or b"") + len(raw))
        return resp.status, raw

    def _count(self, nbytes: int) -> None:
        if self.count is not None:
            self.count(nbytes)

    async def get(self, path: str, model: type[M]) -> M:
        return wire.decode(await self._request("GET", path, None), model)

    async def get_raw(self, path: str) -> bytes:
        return await self._request("GET", path, None)

    async def post(self, path: str, message: Message, reply: type[M]) -> M:
        body = wire.encode(message)
        identity = self.identity
        if identity is None:
            raise RuntimeError("a signed request needs the client's identity")

        def signed() -> bytes:  # fresh timestamp and nonce on every attempt
            return wire.encode(sign_request(identity.key, path, body, timestamp=time.time()))

        return wire.decode(await self._request("POST", path, signed), reply)

    async def call(self, endpoint: SignedCall[Req, Rep], message: Req) -> Rep:
        """A signed call of the protocol (shared.endpoints): its path and reply type come from its declaration."""
        return await self.post(endpoint.path, message, endpoint.reply)

    async def info(self) -> Info:
        """GET /v1/info, telling an echo-swarm coordinator from anything else that answers at the URL: a reply that
        is not the protocol's (an HTML page, a 404 from a web server) is :class:`NotACoordinator`."""
        not_ours = (f"{self.base_url} answers, but not as an echo-swarm coordinator (GET /v1/info gave {{what}}): "
                    f"check the host and port in the URL (a coordinator prints 'listening on URL' when it starts)")
        try:
            raw = await self._request("GET", INFO.path, None)
        except Refused as exc:
            if not exc.decoded:
                raise NotACoordinator(not_ours.format(what=f"HTTP {exc.status}")) from None
            raise
        try:
            return wire.decode(raw, Info)
        except ProtocolError:
            try:
                fields = wire.unpack(raw)
            except ProtocolError:
                fields = None
            if isinstance(fields, dict) and "protocol" in fields:
                raise ProtocolError(Reason.PROTOCOL_VERSION, f"the coordinator at {self.base_url} speaks protocol "
                                    f"{fields.get('protocol')!r}, which this echo-swarm does not understand; "
                                    f"upgrade echo-swarm") from None
            raise NotACoordinator(not_ours.format(what="a reply that is not the protocol's")) from None

    async def up(self, seconds: float, every_s: float = UP_POLL_S) -> bool:
        """Look for a coordinator that is starting: one quick GET of /healthz every ``every_s`` (no backoff) until
        it answers 200 or ``seconds`` have passed. For a client started with (or before) its coordinator."""
        give_up = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=max(every_s, 2.0))
        while True:
            try:
                async with self._session.get(self.base_url + HEALTHZ.path, timeout=timeout) as resp:
                    if resp.status == 200:
                        return True
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() + every_s > give_up or self.stopping():
                return False
            await asyncio.sleep(every_s)
