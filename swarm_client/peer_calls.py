"""A volunteer's signed calls over libp2p (`join --p2p --p2p-jobs`; docs/protocol.md §6b): register, lease, release
and results go to the coordinator's libp2p peer, which relays them to its API, instead of to its HTTP address.

Best effort, like p2p snapshots: when a call cannot go over libp2p (the coordinator runs no peer or no call relay,
the peer is unreachable, a timeout, a broken stream) the call goes over HTTP at once, signed afresh (it may have
reached the API before it failed: swarm_client.api), the client says so once, and libp2p is tried again after
``RETRY_AFTER_S``. A refusal the coordinator sends back (a status and an
ErrorBody) is an answer, not a failure: it reaches the caller exactly as over HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shared.p2p_calls import call

if TYPE_CHECKING:
    from swarm_client.peer_fetch import ClientPeer

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 60.0  # after a failed call, HTTP only for this long


class PeerCalls:
    def __init__(self, peer: ClientPeer, timeout_s: float, say: Callable[[str], None]) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        self._say = say
        self.sent = 0  # calls answered over libp2p
        self.fallbacks = 0  # attempts that went over HTTP instead
        self._said = False
        self._off_until = 0.0

    async def send(self, path: str, data: bytes) -> tuple[int, bytes] | None:
        """(status, reply bytes) from the coordinator's peer, or None: send this attempt over HTTP."""
        node = self.peer.node
        if time.monotonic() < self._off_until:
            self.fallbacks += 1
            return None
        if node is None or not self.peer.coordinator_peer:
            self._fallback(path, "this client's libp2p peer is not running")
            return None
        try:
            answer = await call(node.p2p, self.peer.coordinator_peer, path, data, self.timeout_s)
        except Exception as exc:  # any libp2p failure: HTTP carries this attempt
            self._fallback(path, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return None
        self.sent += 1
        return answer

    def _fallback(self, path: str, why: str) -> None:
        self.fallbacks += 1
        self._off_until = time.monotonic() + RETRY_AFTER_S
        if not self._said:
            self._said = True
            self._say(f"p2p jobs: {path} over libp2p failed ({why[:300]}); sending it over HTTP, and every call for "
                      f"the next {RETRY_AFTER_S:.0f}s (said once; later fallbacks are counted)")
        else:
            logger.info("p2p jobs: %s over libp2p failed (%s); over HTTP", path, why[:300])
