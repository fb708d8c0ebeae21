"""The trust between the API and the p2p role's call relay (coordinator.roles.p2p_relay, docs/protocol.md §6b).

The API's per-address budgets must see the caller, not the relay's 127.0.0.1: the relay names the caller's libp2p
peer id in a header, with a token that only holders of the run's key can compute (an HMAC of the coordinator key);
the API honours the header only with that token and refuses it otherwise (``bad_relay``). Both roles read this
module; neither imports the other.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.errors import ProtocolError, Reason

TOKEN_HEADER = "X-Echo-Swarm-Relay"
PEER_HEADER = "X-Echo-Swarm-Peer"
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58btc, as libp2p writes peer ids


def relay_token(key: Ed25519PrivateKey, run_id: str) -> str:
    """HMAC-SHA256 of the run id under the coordinator's private key: every role that holds the run's key (the API,
    the p2p role) derives it; nothing else can. Never sent beyond loopback."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return hmac.new(raw, b"echo-swarm/p2p-relay/v1\x00" + run_id.encode(), hashlib.sha256).hexdigest()


def relayed_address(headers: Any, token: str) -> str | None:
    """The rate-limit identity a relayed call stands for (``p2p:<peer id>``), None for a call without the relay
    header; ProtocolError ``bad_relay`` for a header without the token (anyone but the p2p role)."""
    claimed = headers.get(TOKEN_HEADER)
    if claimed is None:
        return None
    peer = headers.get(PEER_HEADER, "")
    if not hmac.compare_digest(claimed.encode(), token.encode()) or not _PEER_ID.fullmatch(peer):
        raise ProtocolError(Reason.BAD_RELAY, f"the {TOKEN_HEADER} header is for the coordinator's own p2p role; "
                                              f"send the request without it")
    return f"p2p:{peer}"
