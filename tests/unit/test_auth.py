from __future__ import annotations

import pytest

from coordinator.core.auth import check_timestamp, nonce_expiry
from shared.errors import ProtocolError, Reason

NOW = 1_700_000_000.0
WINDOW = 300.0


@pytest.mark.parametrize("offset", [0.0, 1.0, -1.0, WINDOW, -WINDOW, WINDOW - 0.001, -(WINDOW - 0.001)])
def test_timestamps_inside_window_pass(offset: float) -> None:
    check_timestamp(NOW + offset, NOW, WINDOW)


@pytest.mark.parametrize("offset", [WINDOW + 0.01, -(WINDOW + 0.01), 10 * WINDOW, -NOW])
def test_timestamps_outside_window_are_stale(offset: float) -> None:
    with pytest.raises(ProtocolError) as info:
        check_timestamp(NOW + offset, NOW, WINDOW)
    assert info.value.reason is Reason.STALE_REQUEST
    assert info.value.http_status == 401
    assert "clock" in info.value.message


def test_stale_message_gives_signed_offset() -> None:
    with pytest.raises(ProtocolError) as ahead:
        check_timestamp(NOW + 1000, NOW, WINDOW)
    with pytest.raises(ProtocolError) as behind:
        check_timestamp(NOW - 1000, NOW, WINDOW)
    assert "+1000s" in ahead.value.message
    assert "-1000s" in behind.value.message


def test_nonce_expiry_is_end_of_window() -> None:
    assert nonce_expiry(NOW, WINDOW) == NOW + WINDOW
    # a request carrying that timestamp is refused as stale just after its nonce may be forgotten
    with pytest.raises(ProtocolError):
        check_timestamp(NOW, nonce_expiry(NOW, WINDOW) + 0.01, WINDOW)
