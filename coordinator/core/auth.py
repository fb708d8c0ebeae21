"""Request authentication rules: timestamp window and nonce expiry (the signature check is in shared.crypto).

Checked in this order for every signed request: envelope schema and protocol version → path the request
was signed for → known client → signature → not banned → timestamp within the window → nonce unseen. The nonce is remembered until its request could no longer
pass the timestamp check, so the nonce store stays bounded.
"""

from __future__ import annotations

from shared.errors import ProtocolError, Reason


def check_timestamp(timestamp: float, now: float, window_s: float) -> None:
    if abs(timestamp - now) > window_s:
        raise ProtocolError(
            Reason.STALE_REQUEST,
            f"request timestamp is {timestamp - now:+.0f}s from the coordinator's clock (window ±{window_s:.0f}s); "
            f"check that your system clock is set correctly",
        )


def nonce_expiry(timestamp: float, window_s: float) -> float:
    """When a nonce may be forgotten: after its request would be refused as stale anyway."""
    return timestamp + window_s
