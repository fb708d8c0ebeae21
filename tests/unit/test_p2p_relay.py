"""The call relay's bounds and its token (coordinator.roles.p2p_relay, docs/protocol.md §6b), without a libp2p peer: what
it refuses from the head alone, and who may claim to be it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.roles.p2p_relay import CallRelay
from coordinator.run.relay import PEER_HEADER, TOKEN_HEADER, relay_token, relayed_address
from shared import crypto, wire
from shared.errors import ProtocolError, Reason
from shared.messages import CallRequest, ErrorBody

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def relay(tmp_path: Path, **p2p: object) -> CallRelay:
    config = load_config(None, {"run_dir": str(tmp_path), "p2p": {"enabled": True, **p2p},
                                "server": {"max_connections_per_address": 6}})
    return CallRelay(config, "t" * 64)


def refusal(answer: tuple[int, bytes]) -> tuple[int, str]:
    return answer[0], wire.decode(answer[1], ErrorBody).error


def test_the_head_alone_refuses_unknown_paths_and_oversized_bodies(tmp_path: Path) -> None:
    r = relay(tmp_path)
    assert refusal(r._admit(PEER, CallRequest(path="/v1/admin/ban", length=10))) == (404, "not_found")
    assert refusal(r._admit(PEER, CallRequest(path="/v1/lease", length=64 * 1024 + 1))) == (413, "body_too_large")
    assert r._admit(PEER, CallRequest(path="/v1/lease", length=64 * 1024)) == (0, b"")
    assert r.active == 1


def test_calls_in_flight_are_bounded_per_peer_and_in_all(tmp_path: Path) -> None:
    r = relay(tmp_path, calls_at_once=100, calls_per_peer=2)
    assert r.at_once == 6  # never more than the API's connections per address: each call is one
    head = CallRequest(path="/v1/lease", length=100)
    assert r._admit(PEER, head) == r._admit(PEER, head) == (0, b"")
    assert refusal(r._admit(PEER, head)) == (429, "rate_limited")
    for n in range(4):
        assert r._admit(f"{PEER[:-1]}{'abcd'[n]}", head) == (0, b"")
    assert refusal(r._admit(PEER[:-1] + "e", head)) == (503, "rate_limited")


def test_only_the_runs_key_makes_the_relay_token() -> None:
    key = crypto.generate_key()
    token = relay_token(key, "run1")
    assert token == relay_token(key, "run1") and len(token) == 64
    assert token not in (relay_token(key, "run2"), relay_token(crypto.generate_key(), "run1"))
    assert relayed_address({}, token) is None
    assert relayed_address({TOKEN_HEADER: token, PEER_HEADER: PEER}, token) == f"p2p:{PEER}"
    for headers in ({TOKEN_HEADER: "0" * 64, PEER_HEADER: PEER}, {TOKEN_HEADER: "", PEER_HEADER: PEER},
                    {TOKEN_HEADER: token, PEER_HEADER: "127.0.0.1"}, {TOKEN_HEADER: token}):
        with pytest.raises(ProtocolError) as err:
            relayed_address(headers, token)
        assert err.value.reason is Reason.BAD_RELAY
