"""HTTP client for the coordinator protocol: signs every request, decodes every reply strictly, and retries
transient failures (connection errors, timeouts, 5xx, 429) with bounded exponential backoff.

With ``calls`` set (`join --p2p-jobs`), signed POSTs go to the coordinator's libp2p peer first
(swarm_client.peer_calls, docs/protocol.md §6b): the same envelope, the same status and reply bytes, so every
caller stays unchanged; when libp2p fails the same attempt goes over HTTP."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import aiohttp
import pydantic

from shared import wire
from shared.crypto import sign_request
from shared.errors import EchoSwarmError, ProtocolError, Reason
from shared.messages import ErrorBody, Info, Message
from swarm_client.identity import Identity

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
UP_POLL_S = 0.5  # how often a client started with its coordinator looks for it (CoordinatorClient.up)


class CoordinatorUnreachable(EchoSwarmError):
    """The coordinator could not be reached after all retries."""


class RetryPolicy(pydantic.BaseModel):
    attempts: int = 8
    base_s: float = 0.5
    max_s: float = 30.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * 2**attempt) * (0.5 + random.random() / 2)


class Refused(ProtocolError):
    """A refusal as the coordinator sent it. ``code`` is the raw reason code, which may be one this client
    version does not know (then ``reason`` is INTERNAL): callers print the server's message as is."""

    def __init__(self, reason: Reason, message: str, *, code: str, status: int) -> None:
        super().__init__(reason, message)
        self.code = code
        self.status = status


def refusal_code(exc: ProtocolError) -> str:
    return getattr(exc, "code", exc.reason.value)


def _refusal(status: int, body: bytes) -> ProtocolError:
    try:
        err = wire.decode(body, ErrorBody, max_bytes=64 * 1024)
        reason = Reason(err.error) if err.error in Reason._value2member_map_ else Reason.INTERNAL
        return Refused(reason, err.message, code=err.error, status=status)
    except (ProtocolError, ValueError):
        return Refused(Reason.INTERNAL, f"HTTP {status}: {body[:200]!r}", code=Reason.INTERNAL.value, status=status)


class CallTransport(Protocol):
    """Another way to send a signed POST (swarm_client.peer_calls.PeerCalls): (status, reply bytes), or None when
    it cannot right now (it said why) and the request goes over HTTP."""

    def send(self, path: str, data: bytes) -> Awaitable[tuple[int, bytes] | None]: ...


class CoordinatorClient:
    def __init__(self, base_url: str, identity: Identity, *, timeout_s: float = 30.0,
                 retry: RetryPolicy | None = None, on_retry: Callable[[str], None] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        self.retry = retry or RetryPolicy()
        self.on_retry = on_retry or (lambda msg: logger.warning("%s", msg))
        self.timeout_s = timeout_s
        self.calls: CallTransport | None = None  # `join --p2p-jobs`: signed POSTs over libp2p first
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10))

    async def close(self) -> None:
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def _request(self, method: str, path: str, body_fn: Callable[[], bytes] | None) -> bytes:
        last: str = ""
        for attempt in range(self.retry.attempts):
            try:
                status, raw = await self._send(method, path, body_fn() if body_fn else None)
                if status == 200:
                    return raw
                if status < 500 and status != 429:
                    raise _refusal(status, raw)
                last = f"HTTP {status}: {_refusal(status, raw).message}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if attempt + 1 < self.retry.attempts:
                wait = self.retry.delay(attempt)
                self.on_retry(f"coordinator at {self.base_url} did not answer {path} ({last}); "
                              f"retrying in {wait:.1f}s (attempt {attempt + 2}/{self.retry.attempts})")
                await asyncio.sleep(wait)
        raise CoordinatorUnreachable(
            f"gave up on {self.base_url}{path} after {self.retry.attempts} attempts: {last}. Check that the URL is "
            f"right and the coordinator is running (try: curl {self.base_url}/healthz)")

    async def _send(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        """One attempt: the HTTP status and reply bytes, over libp2p when ``calls`` is set and can, else HTTP."""
        if data is not None and self.calls is not None:
            sent = await self.calls.send(path, data)
            if sent is not None:
                return sent
        async with self._session.request(method, self.base_url + path, data=data,
                                         headers={"Content-Type": "application/msgpack"}) as resp:
            return resp.status, await resp.read()

    async def get(self, path: str, model: type[M]) -> M:
        return wire.decode(await self._request("GET", path, None), model)

    async def get_raw(self, path: str) -> bytes:
        return await self._request("GET", path, None)

    async def post(self, path: str, message: Message, reply: type[M]) -> M:
        body = wire.encode(message)

        def signed() -> bytes:  # fresh timestamp and nonce on every attempt
            return wire.encode(sign_request(self.identity.key, path, body, timestamp=time.time()))

        return wire.decode(await self._request("POST", path, signed), reply)

    async def info(self) -> Info:
        return await self.get("/v1/info", Info)

    async def up(self, seconds: float, every_s: float = UP_POLL_S) -> bool:
        """Look for a coordinator that is starting: one quick GET of /healthz every ``every_s`` (no backoff) until
        it answers 200 or ``seconds`` have passed. For a client started with (or before) its coordinator."""
        give_up = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=max(every_s, 2.0))
        while True:
            try:
                async with self._session.get(self.base_url + "/healthz", timeout=timeout) as resp:
                    if resp.status == 200:
                        return True
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() + every_s > give_up:
                return False
            await asyncio.sleep(every_s)
