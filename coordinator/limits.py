"""The API's size limits, one declaration each: what the HTTP handlers, the p2p role's call relay
(coordinator.roles.p2p_relay) and the config's own checks (coordinator.config) all read.

A leaf module (shared/ only below it), so that the config can refuse a setting whose results would not fit and the
relay can cap a relayed body without either importing the API.
"""

from __future__ import annotations

from shared.endpoints import RESULTS, SIGNED_CALLS
from shared.wire import MAX_MESSAGE_BYTES

#: A signed request's whole envelope (docs/protocol.md §2); any message inside it is at most MAX_MESSAGE_BYTES.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: register, lease, release: small by construction.
SMALL_REQUEST_BYTES = 64 * 1024
#: The signed-request frame around a body: ids, nonce, signature, msgpack headers.
ENVELOPE_BYTES = 1024
#: The signed POST endpoints' paths (shared.endpoints, docs/protocol.md §3-4): the API's routes, and the calls the
#: coordinator's libp2p peer relays to them (§6b).
RESULTS_PATH = RESULTS.path
SIGNED_POSTS = tuple(call.path for call in SIGNED_CALLS)
__all__ = ["ENVELOPE_BYTES", "MAX_MESSAGE_BYTES", "MAX_REQUEST_BYTES", "RESULTS_PATH", "SIGNED_POSTS",
           "SMALL_REQUEST_BYTES", "body_cap", "result_size_cap"]


def result_size_cap(n_completions: int, max_tokens: int, turns: int = 0, observation_tokens: int = 0) -> int:
    """Upper bound on an honest result's encoded size: ≤ 5 bytes per token id, 9 per float64, slack.
    (coordinator.config refuses settings whose cap would exceed the MAX_MESSAGE_BYTES message limit.) A multi-turn
    job's episodes (``turns`` > 0) carry up to ``turns`` actions and observations each."""
    if turns:
        return 4096 + n_completions * (64 + turns * (64 + max_tokens * 14 + observation_tokens * 5))
    return 4096 + n_completions * (64 + max_tokens * 14)


def body_cap(path: str, result_cap: int) -> int:
    """Largest request body accepted on ``path``: results are capped by the largest job this run signs
    (``result_cap``, its max_result_bytes, plus the signed envelope), every other request by SMALL_REQUEST_BYTES.
    The API and the p2p role's relay apply the same caps."""
    if path == RESULTS_PATH:
        return ENVELOPE_BYTES + result_cap
    return SMALL_REQUEST_BYTES
