"""The call relay's bounds and its token (coordinator.roles.p2p_relay, docs/protocol.md §6b), without a libp2p peer: what
it refuses from the head alone, and who may claim to be it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.roles.p2p_relay import CallRelay, PeersPerAddress
from coordinator.run.relay import (
    ADDRESS_HEADER,
    PEER_HEADER,
    TOKEN_HEADER,
    observed_address,
    relay_token,
    relayed_address,
)
from shared import crypto, wire
from shared.errors import ProtocolError, Reason
from shared.messages import CallRequest, ErrorBody

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
HOST = "198.51.100.7"


def relay(tmp_path: Path, **p2p: object) -> CallRelay:
    config = load_config(None, {"run_dir": str(tmp_path), "p2p": {"enabled": True, **p2p},
                                "server": {"max_connections_per_address": 6}})
    return CallRelay(config, "t" * 64)


def refusal(answer: tuple[int, bytes]) -> tuple[int, str]:
    return answer[0], wire.decode(answer[1], ErrorBody).error


def test_the_head_alone_refuses_unknown_paths_and_oversized_bodies(tmp_path: Path) -> None:
    r = relay(tmp_path)
    assert refusal(r._admit(PEER, HOST, CallRequest(path="/v1/admin/ban", length=10))) == (404, "not_found")
    assert refusal(r._admit(PEER, HOST, CallRequest(path="/v1/lease", length=64 * 1024 + 1))) == (413, "body_too_large")
    assert r._admit(PEER, HOST, CallRequest(path="/v1/lease", length=64 * 1024)) == (0, b"")
    assert r.active == 1


def test_calls_in_flight_are_bounded_per_peer_and_in_all(tmp_path: Path) -> None:
    r = relay(tmp_path, calls_at_once=100, calls_per_peer=2)
    assert r.at_once == 6  # never more than the API's connections per address: each call is one
    head = CallRequest(path="/v1/lease", length=100)
    assert r._admit(PEER, HOST, head) == r._admit(PEER, HOST, head) == (0, b"")
    assert refusal(r._admit(PEER, HOST, head)) == (429, "rate_limited")
    for n in range(4):
        assert r._admit(f"{PEER[:-1]}{'abcd'[n]}", HOST, head) == (0, b"")
    assert refusal(r._admit(PEER[:-1] + "e", HOST, head)) == (503, "rate_limited")


def test_only_the_runs_key_makes_the_relay_token() -> None:
    key = crypto.generate_key()
    token = relay_token(key, "run1")
    assert token == relay_token(key, "run1") and len(token) == 64
    assert token not in (relay_token(key, "run2"), relay_token(crypto.generate_key(), "run1"))
    assert relayed_address({}, token) is None
    good = {TOKEN_HEADER: token, PEER_HEADER: PEER, ADDRESS_HEADER: HOST}
    assert relayed_address(good, token) == HOST  # the caller's IP, never its peer id
    for headers in (good | {TOKEN_HEADER: "0" * 64}, good | {TOKEN_HEADER: ""}, good | {PEER_HEADER: "127.0.0.1"},
                    {TOKEN_HEADER: token}, {TOKEN_HEADER: token, PEER_HEADER: PEER},
                    good | {ADDRESS_HEADER: f"p2p:{PEER}"}, good | {ADDRESS_HEADER: "2001:db8::1"},
                    good | {TOKEN_HEADER: "\udcff" * 64}):
        with pytest.raises(ProtocolError) as err:
            relayed_address(headers, token)
        assert err.value.reason is Reason.BAD_RELAY


@pytest.mark.parametrize(("multiaddr", "address"), [
    ("/ip4/198.51.100.7/tcp/4001", "198.51.100.7"),
    ("/ip4/198.51.100.7/udp/4001/quic", "198.51.100.7"),
    ("/ip6/2001:db8::1/tcp/4001", "2001:db8::/64"),  # one subscriber's /64, like the HTTP per-address caps
    # a relay circuit: the coordinator's connection is to the relay, so the relay's address is what it saw
    ("/ip4/203.0.113.9/tcp/4001/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo/p2p-circuit", "203.0.113.9"),
    ("/dns4/example.org/tcp/4001", "?"),
    ("", "?"),
])
def test_a_call_is_charged_to_the_observed_ip(multiaddr: str, address: str) -> None:
    assert observed_address(multiaddr) == address


def test_peer_ids_per_address_are_bounded_and_age_out() -> None:
    book = PeersPerAddress(per_address=3, window_s=100.0, max_addresses=4)
    ids = [f"{PEER[:-1]}{c}" for c in "abcdef"]
    assert all(book.admit(HOST, p, 0.0) for p in ids[:3])
    assert not book.admit(HOST, ids[3], 1.0)  # a fourth id from the same host
    assert book.admit(HOST, ids[0], 2.0)  # a known one still may
    assert book.admit("198.51.100.8", ids[3], 2.0)  # another host is another address
    assert book.admit(HOST, ids[3], 150.0)  # ids[1], ids[2] went quiet for longer than the window
    for n in range(10):  # a flood of addresses keeps at most max_addresses of them
        book.admit(f"192.0.2.{n}", PEER, 200.0)
    assert len(book) == 4


def test_a_new_peer_id_beyond_the_bound_is_refused_from_the_head(tmp_path: Path) -> None:
    r = relay(tmp_path, peers_per_address=2, calls_at_once=100)
    head = CallRequest(path="/v1/register", length=100)
    assert r._admit(PEER, HOST, head) == (0, b"")
    assert r._admit(PEER[:-1] + "a", HOST, head) == (0, b"")
    code, data = r._admit(PEER[:-1] + "b", HOST, head)
    assert (code, wire.decode(data, ErrorBody).error) == (429, "rate_limited")
    assert "peer ids" in wire.decode(data, ErrorBody).message
    assert r._admit(PEER[:-1] + "b", "198.51.100.8", head) == (0, b"")
