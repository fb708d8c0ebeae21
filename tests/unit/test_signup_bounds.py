"""A bounded sign-up (issue 24) on a real store (SQLite and PostgreSQL): a global rate of new identities across
all addresses, a cap on identities that never had a result accepted (the longest idle removed), and the burst log
that keeps a flood of one internal error to one log line a window."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.api.guard import Guard
from coordinator.config import CoordinatorConfig
from coordinator.core.ratelimit import BurstLog
from coordinator.store.store import Store
from shared.errors import ProtocolError, Reason

T0 = 1_000_000.0


def guard(target: str | Path, **limits: object) -> tuple[Guard, Store]:
    store = Store(target)
    return Guard(CoordinatorConfig.model_validate({"limits": limits}), store), store


def test_new_identities_from_many_addresses_are_bounded_by_the_global_rate(store_target: str | Path) -> None:
    g, _ = guard(store_target, new_identity_burst=5, new_identities_per_min=60, registration_burst=2)
    for n in range(5):  # five addresses, one new identity each: the swarm's burst
        g.check_registration(f"127.0.0.{n + 2}", "", T0, True)
    with pytest.raises(ProtocolError) as err:
        g.check_registration("127.0.0.9", "", T0, True)  # a fresh address, but the swarm's budget is spent
    assert err.value.reason is Reason.RATE_LIMITED and "all addresses together" in err.value.message
    g.check_registration("127.0.0.9", "", T0, False)  # a known identity re-registering is not a sign-up
    g.check_registration("127.0.0.10", "", T0 + 1.0, True)  # refilled at one a second


def test_the_global_rate_can_be_turned_off(store_target: str | Path) -> None:
    g, _ = guard(store_target, new_identities_per_min=0, registration_burst=1)
    for n in range(200):
        g.check_registration(f"10.0.{n // 250}.{n % 250}", "", T0, True)


def register(store: Store, cid: str, at: float) -> None:
    store.clients.register(cid, b"k" * 32, {"backend": "torch", "device": "cpu"}, at, address="127.0.0.2")


def test_idle_identities_beyond_the_cap_are_removed_oldest_first(store_target: str | Path) -> None:
    _, store = guard(store_target)
    for n in range(6):
        register(store, f"{n:032x}", T0 + n)
    store.conn.execute("UPDATE clients SET accepted=1 WHERE client_id=?", (f"{0:032x}",))  # has done work
    store.conn.execute("UPDATE clients SET banned=1 WHERE client_id=?", (f"{1:032x}",))  # banned: kept, as evidence
    store.trust.put(f"{2:032x}", "torch/cpu", 0, 3, 1, T0 + 10_000, False)  # quarantined: kept, or it would escape
    # idle: 2 (quarantined), 3, 4, 5; keep 2 → the two longest idle that may go (3, 4) are removed; 5 is spared
    gone = store.clients.expire_idle(2, T0 + 10, spare=f"{5:032x}")
    assert gone == [f"{3:032x}", f"{4:032x}"]
    left = {r["client_id"] for r in store.conn.execute("SELECT client_id FROM clients").fetchall()}
    assert left == {f"{n:032x}" for n in (0, 1, 2, 5)}
    assert store.clients.expire_idle(2, T0 + 10) == []  # at the cap: nothing more
    assert store.clients.count() == 4


def test_a_flood_of_sign_ups_leaves_the_store_at_the_cap(store_target: str | Path) -> None:
    _, store = guard(store_target)
    for n in range(300):
        register(store, f"{n:032x}", T0 + n)
        store.clients.expire_idle(50, T0 + n, spare=f"{n:032x}")
    assert store.clients.count() == 50
    newest = {r["client_id"] for r in store.conn.execute("SELECT client_id FROM clients").fetchall()}
    assert newest == {f"{n:032x}" for n in range(250, 300)}  # the longest idle went first


def test_a_burst_of_one_failure_is_logged_once_per_window_with_its_count() -> None:
    log = BurstLog(window_s=60.0, max_keys=2)
    assert log.allow("KeyError /v1/lease", 0.0) == 0  # the first: logged
    assert all(log.allow("KeyError /v1/lease", t) is None for t in (1.0, 2.0, 59.0))  # held back, counted
    assert log.allow("OSError /v1/results", 3.0) == 0  # another kind is its own burst
    assert log.allow("KeyError /v1/lease", 61.0) == 3  # the next window's first says how many were held back
    for n in range(10):
        log.allow(f"k{n}", 70.0)
    assert len(log._last) == 2  # bounded
