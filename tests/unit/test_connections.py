"""coordinator/core/connections.py: which connection gives up its place at a cap, when one has overstayed its
phase, how the overall cap follows the file limit, and what counts as one address."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from coordinator.core.connections import (
    FDS_PER_CONNECTION,
    Caps,
    Phase,
    Timeouts,
    address_key,
    admit,
    total_cap,
    victim,
)

T = Timeouts(header_s=10.0, body_s=120.0, keepalive_s=30.0, send_s=60.0)


@dataclass
class Conn:
    name: str
    phase: Phase
    since: float
    stalled_since: float | None = None


def test_the_stalest_idle_connection_gives_way_and_a_handled_request_never_does() -> None:
    busy = Conn("long-poll", Phase.HANDLING, 0.0)
    body = Conn("uploading", Phase.BODY, 1.0)
    old_loris = Conn("slowloris", Phase.HEADERS, 2.0)
    new_idle = Conn("idle", Phase.IDLE, 5.0)
    assert victim([busy, body, new_idle, old_loris]) is old_loris
    assert victim([busy, body]) is body  # a body still arriving goes only when nothing idler is left
    assert victim([busy]) is None


def test_admission_evicts_within_the_address_then_from_the_busiest_then_refuses() -> None:
    caps = Caps(total=4, per_address=2)
    mine = [Conn("a", Phase.FRESH, 1.0), Conn("b", Phase.IDLE, 3.0)]
    decision = admit(mine, len(mine), 2, None, caps)
    assert decision.admit and decision.evict is mine[0]
    busy = [Conn("c", Phase.HANDLING, 0.0), Conn("d", Phase.HANDLING, 0.0)]
    assert admit(busy, 2, 2, None, caps).refusal == "per_address"
    # the server is full: the address holding the most connections gives one up
    flood = [Conn(f"f{k}", Phase.HEADERS, float(k)) for k in range(3)]
    decision = admit([], 0, 4, flood, caps)
    assert decision.admit and decision.evict is flood[0]
    assert admit([], 0, 4, busy, caps).refusal == "total"
    assert admit([], 0, 3, None, caps) == admit([], 0, 3, None, caps) and admit([], 0, 3, None, caps).evict is None


@pytest.mark.parametrize(("phase", "age", "expected"), [
    (Phase.FRESH, 9.0, None), (Phase.FRESH, 11.0, "header"),  # connected and sent nothing
    (Phase.HEADERS, 11.0, "header"),  # slowloris
    (Phase.BODY, 100.0, None), (Phase.BODY, 121.0, "body"),
    (Phase.IDLE, 29.0, None), (Phase.IDLE, 31.0, "idle"),
    (Phase.HANDLING, 10_000.0, None),  # long-polls and verification are the app's to bound
])
def test_each_phase_has_its_bound(phase: Phase, age: float, expected: str | None) -> None:
    assert T.expiry(Conn("x", phase, 100.0), 100.0 + age) == expected


def test_a_client_that_stops_reading_its_reply_is_cut_off() -> None:
    assert T.expiry(Conn("x", Phase.HANDLING, 0.0, stalled_since=50.0), 100.0) is None
    assert T.expiry(Conn("x", Phase.HANDLING, 0.0, stalled_since=30.0), 100.0) == "send"
    assert 0.05 <= T.tick_s <= 1.0 and Timeouts(0.2, 1, 1, 1).tick_s == 0.05


def test_the_total_cap_stays_below_the_file_limit() -> None:
    assert total_cap(1024, 256, 0) == (1024 - 256) // FDS_PER_CONNECTION
    assert total_cap(1024, 256, 100) == 100
    assert total_cap(1024, 256, 10_000) == 384  # a configured cap never exceeds what the descriptors allow
    assert total_cap(200, 256, 0) == 1  # a tiny limit still serves someone
    assert total_cap(20_000, 256, 0) * FDS_PER_CONNECTION + 256 <= 20_000
    assert total_cap(1024, 256, 0, in_flight=512) == 128  # room for sockets accepted but not yet decided


@pytest.mark.parametrize(("host", "key"), [
    ("203.0.113.7", "203.0.113.7"),
    ("::ffff:203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
    ("", "?"), ("/tmp/sock", "?"),
])
def test_an_ipv6_subscriber_prefix_counts_as_one_address(host: str, key: str) -> None:
    assert address_key(host) == key


def test_an_address_cap_above_the_total_cap_is_refused_with_how_to_fix_it() -> None:
    from coordinator.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"max_connections_per_address \(100\) exceeds server.max_connections \(50\)"):
        load_config(None, {"server.max_connections": 50, "server.max_connections_per_address": 100})
    assert load_config(None, {"server.max_connections_per_address": 100}).server.max_connections == 0  # derived
