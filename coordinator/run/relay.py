"""The trust between the API and the p2p role's call relay (coordinator.roles.p2p_relay, docs/protocol.md §6b).

The API's per-address budgets must see the caller, not the relay's 127.0.0.1: the relay names the address the
caller's libp2p connection comes from (the IP of the remote multiaddr the coordinator's peer observes; for a relay
circuit, the relay's) and the caller's peer id in headers, with a token that only holders of the run's key can
compute (an HMAC of the coordinator key); the API honours the headers only with that token and refuses them
otherwise (``bad_relay``). A libp2p peer id costs nothing to make, so it is never an address (issue 24): budgets,
caps and registration addresses count the IP. Both roles read this module; neither imports the other.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.core.connections import address_key
from shared.errors import ProtocolError, Reason

TOKEN_HEADER = "X-Echo-Swarm-Relay"
PEER_HEADER = "X-Echo-Swarm-Peer"
ADDRESS_HEADER = "X-Echo-Swarm-Peer-Address"
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58btc, as libp2p writes peer ids


def relay_token(key: Ed25519PrivateKey, run_id: str) -> str:
    """HMAC-SHA256 of the run id under the coordinator's private key: every role that holds the run's key (the API,
    the p2p role) derives it; nothing else can. Never sent beyond loopback."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return hmac.new(raw, b"echo-swarm/p2p-relay/v1\x00" + run_id.encode(), hashlib.sha256).hexdigest()


def observed_address(multiaddr: str) -> str:
    """The per-address key (coordinator.core.connections.address_key) of the libp2p connection whose remote
    multiaddr is ``multiaddr`` — its first ``/ip4`` or ``/ip6`` component. For a relay circuit
    (``/ip4/R/tcp/…/p2p/<relay>/p2p-circuit``) that is the relay's address, the only one the coordinator saw.
    ``"?"`` when there is none (then every such caller shares one budget)."""
    parts = multiaddr.split("/")
    for proto, value in zip(parts, parts[1:], strict=False):
        if proto in ("ip4", "ip6"):
            return address_key(value)
    return "?"


def relay_headers(token: str, peer_id: str, address: str) -> dict[str, str]:
    """The headers the relay adds to a call it forwards to the API."""
    return {TOKEN_HEADER: token, PEER_HEADER: peer_id, ADDRESS_HEADER: address}


def relayed_address(headers: Any, token: str) -> str | None:
    """The address a relayed call is charged to (the caller's observed IP, :func:`observed_address`), None for a
    call without the relay header; ProtocolError ``bad_relay`` for a header without the token (anyone but the p2p
    role) or without a peer id and an address."""
    claimed = headers.get(TOKEN_HEADER)
    if claimed is None:
        return None
    peer = headers.get(PEER_HEADER, "")
    address = headers.get(ADDRESS_HEADER, "")
    if not (claimed.isascii() and hmac.compare_digest(claimed.encode(), token.encode())) \
            or not _PEER_ID.fullmatch(peer) or not _is_address_key(address):
        raise ProtocolError(Reason.BAD_RELAY, f"the {TOKEN_HEADER} header is for the coordinator's own p2p role; "
                                              f"send the request without it")
    return address


def _is_address_key(address: str) -> bool:
    return address == "?" or (address.isascii() and address_key(address.split("/")[0]) == address)
