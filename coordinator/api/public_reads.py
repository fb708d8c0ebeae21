"""The public read endpoints (``GET /v1/status``, ``GET /metrics``): one shared reply per second, and a
per-address rate limit.

Both replies are built from database queries on the event loop that also serves volunteers; building the full
status of a large run takes tens of milliseconds and its reply is ~150 KB. Built per request, eight
connections polling them slowed ``/healthz`` a hundredfold (issue 13). So every reply body is built at most
once per ``server.public_cache_s`` (sooner when the policy version changes, or the database changed and the
last build is old compared with what a build costs) and shared by every reader, and each address may read
``server.public_reads_per_address_rps`` times a second (429 beyond).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from coordinator.config import ServerConfig
from coordinator.core.connections import address_key
from coordinator.core.ratelimit import Limiter, Rate
from shared.errors import ProtocolError, Reason

#: After the data changed, a reply is rebuilt no sooner than this many of its own build times after the last
#: build: however many readers poll, building replies takes at most ~1/REBUILD_GAP of the event loop, while a
#: reader of a small run (build: milliseconds) still sees every change almost at once.
REBUILD_GAP = 10.0


@dataclass(frozen=True)
class _Entry:
    built_at: float
    build_s: float
    version: int
    changes: int
    body: bytes


class ReplyCache:
    """Encoded reply bodies by key. One is reused while the policy version is unchanged and it is younger than
    ``ttl_s`` — and, once the database has changed since it was built, younger than REBUILD_GAP build times."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        self.builds: dict[str, int] = {}  # how many times each key was built (exported by /metrics)

    def get(self, key: str, version: int, changes: int, build: Callable[[], bytes]) -> bytes:
        """``changes``: a counter that moves whenever the data behind the reply may have (``Store.changes``:
        rows changed through both of the store's connections)."""
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is not None and hit.version == version:
            bound = self.ttl_s if hit.changes == changes else min(self.ttl_s, REBUILD_GAP * hit.build_s)
            if now - hit.built_at < bound:
                return hit.body
        t0 = time.perf_counter()
        body = build()
        self._entries[key] = _Entry(now, time.perf_counter() - t0, version, changes, body)
        self.builds[key] = self.builds.get(key, 0) + 1
        return body

    def clear(self) -> None:
        self._entries.clear()


class PublicReads:
    """The cache and the per-address limiter of one app."""

    def __init__(self, config: ServerConfig) -> None:
        self.cache = ReplyCache(config.public_cache_s)
        self.limiter = Limiter(Rate(config.public_reads_per_address_rps, config.public_reads_burst))

    def check(self, request: web.BaseRequest) -> None:
        """Refuse (429 ``rate_limited``) an address over its public-read budget; nothing is built for it."""
        address = address_key(request.remote or "")
        wait = self.limiter.check(address, time.monotonic())
        if wait > 0:
            after = "later" if math.isinf(wait) else f"in {max(1, math.ceil(wait))}s"
            raise ProtocolError(Reason.RATE_LIMITED, f"too many status/metrics reads from address {address}; the "
                                                     f"reply changes at most once a second, so poll less often and "
                                                     f"retry {after}")


PUBLIC_READS = web.AppKey("public_reads", PublicReads)
