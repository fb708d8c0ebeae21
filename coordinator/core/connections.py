"""Connection admission and read/write timeouts for the HTTP listener (pure: the caller passes ``now``).

Every open connection costs a file descriptor, and the process has a fixed number of them; the database, the
snapshots and the learner need some too. A client that opens connections and sends nothing, or sends its
headers a byte at a time (slowloris), must not be able to use them all. So the listener (the I/O shell in
:mod:`coordinator.api.netguard`) tracks each connection's *phase* and asks these rules two questions:

- may a new connection from this address be admitted — and if the address (or the whole server) is at its
  cap, which existing connection that is *not doing useful work* gives up its place? Connections waiting for
  their first byte, still sending headers, idle between requests or still sending a body can be evicted, the
  one stuck longest first; a request being handled (a long-poll, a result being verified) never is. If
  nothing can be evicted the newcomer is refused.
- has a connection overstayed its phase (headers not complete ``header_s`` after their first byte, a body not
  complete ``body_s`` after the handler started reading it, idle longer than ``keepalive_s``, a reply not
  drained by the client for ``send_s``)? Then it is closed.

Phases are driven by the shell: bytes arriving on an idle connection start HEADERS; the app marks
HANDLING when a request reaches it, BODY while it reads the body, and IDLE once the reply is written.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, Literal, Protocol, TypeVar

#: What the fd budget is divided by when the cap is derived from the file limit: a connection can hold a
#: second descriptor (the snapshot file it is downloading) besides its socket.
FDS_PER_CONNECTION = 2


class Phase(StrEnum):
    FRESH = "fresh"  # connected, no byte received yet
    HEADERS = "headers"  # bytes of a request arrived, the app has not seen it yet
    BODY = "body"  # the app is reading the request body
    HANDLING = "handling"  # the app is working on the request or writing the reply
    IDLE = "idle"  # keep-alive, between two requests


#: Which connections may give up their place to a newcomer, lower first; HANDLING is never evicted.
EVICTION_RANK: dict[Phase, int] = {Phase.FRESH: 0, Phase.HEADERS: 0, Phase.IDLE: 0, Phase.BODY: 1}

Expiry = Literal["header", "body", "idle", "send"]
Refusal = Literal["per_address", "total"]


class ConnLike(Protocol):
    """What the rules read of a connection (the shell's protocol objects have these attributes)."""

    @property
    def phase(self) -> Phase: ...

    @property
    def since(self) -> float: ...  # when the current phase began

    @property
    def stalled_since(self) -> float | None: ...  # when writing last blocked on the client, if it still is


C = TypeVar("C", bound=ConnLike)


@dataclass(frozen=True)
class Timeouts:
    header_s: float
    body_s: float
    keepalive_s: float
    send_s: float

    def expiry(self, conn: ConnLike, now: float) -> Expiry | None:
        """Why ``conn`` must be closed now, or None while it is within its bounds."""
        if conn.stalled_since is not None and now - conn.stalled_since > self.send_s:
            return "send"
        limit, why = {Phase.FRESH: (self.header_s, "header"), Phase.HEADERS: (self.header_s, "header"),
                      Phase.BODY: (self.body_s, "body"), Phase.IDLE: (self.keepalive_s, "idle"),
                      Phase.HANDLING: (math.inf, "")}[conn.phase]
        return why if now - conn.since > limit else None  # type: ignore[return-value]

    @property
    def tick_s(self) -> float:
        """How often the shell should sweep: a fraction of the shortest bound, between 50 ms and 1 s."""
        return min(1.0, max(0.05, min(self.header_s, self.body_s, self.keepalive_s, self.send_s) / 4))


@dataclass(frozen=True)
class Caps:
    total: int
    per_address: int


def total_cap(fd_limit: int, reserved_fds: int, configured: int, in_flight: int = 0) -> int:
    """The overall connection cap: ``configured`` if set (never above what the fd limit allows), otherwise
    what the descriptors allow at FDS_PER_CONNECTION each, after ``reserved_fds`` for the rest of the process
    and ``in_flight`` for sockets accepted but not yet admitted or refused (the event loop accepts a batch per
    tick and decides on each a tick or two later); at least 1."""
    allowed = max(1, (fd_limit - reserved_fds - in_flight) // FDS_PER_CONNECTION)
    return max(1, min(configured, allowed)) if configured > 0 else allowed


def address_key(host: str) -> str:
    """The unit a per-address cap applies to: an IPv4 address, or an IPv6 /64 (one subscriber's prefix; a
    single host there can use any of 2^64 addresses). Unparseable peers (unix sockets) share one key."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


def victim(conns: Iterable[C]) -> C | None:
    """The connection that gives up its place: evictable, lowest rank, in its phase longest."""
    best: tuple[int, float] | None = None
    chosen: C | None = None
    for c in conns:
        rank = EVICTION_RANK.get(c.phase)
        if rank is not None and (best is None or (rank, c.since) < best):
            best, chosen = (rank, c.since), c
    return chosen


@dataclass(frozen=True)
class Admission(Generic[C]):
    admit: bool
    evict: C | None = None
    refusal: Refusal | None = None


def admit(own: Iterable[C], own_count: int, total: int, busiest: Iterable[C] | None,
                       caps: Caps) -> Admission[C]:
    """Decide for a newcomer whose address already holds ``own_count`` connections (``own``), with
    ``total`` open overall; ``busiest`` are the connections of the address holding the most (consulted only
    when the server is full). Over the address cap its own stalest idle connection makes room; over the total
    cap the busiest address's does; with nothing evictable the newcomer is refused."""
    if own_count >= caps.per_address:
        out = victim(own)
        return Admission(True, out) if out is not None else Admission(False, refusal="per_address")
    if total >= caps.total:
        out = victim(busiest or ())
        return Admission(True, out) if out is not None else Admission(False, refusal="total")
    return Admission(True)
