"""Pure rules of the operator/contributor views (coordinator.core.ops) and the admin key file format."""

from __future__ import annotations

import pytest

from coordinator.api.admin_keys import parse_admin_keys
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.ops import (
    ADMIN_KEYS,
    ClientLookupError,
    active_window_s,
    client_state,
    count_by,
    job_status,
    resolve_client,
    throughput_series,
)
from shared import crypto


def test_client_state_precedence() -> None:
    base = {"last_seen": 1000.0, "now": 1010.0, "window_s": 120.0}
    assert client_state(banned=True, holds_live_lease=True, **base) == "banned"
    assert client_state(banned=False, holds_live_lease=True, **base) == "working"
    assert client_state(banned=False, holds_live_lease=False, **base) == "active"
    assert client_state(banned=False, holds_live_lease=False, last_seen=0.0, now=1000.0, window_s=120.0) == "idle"
    assert active_window_s(30) == 120.0 and active_window_s(600) == 1200.0


def test_job_status() -> None:
    view = LeaseView("j", JobState.LEASED, 0, 0.0, "l", "c", 100.0)
    assert job_status(view, 99.0) == "leased"
    assert job_status(view, 100.0) == "expired"
    assert job_status(LeaseView("j", JobState.OPEN, None, 0.0), 0.0) == "open"
    assert job_status(LeaseView("j", JobState.DONE, 0, 0.0), 0.0) == "done"


def test_resolve_client_needs_a_unique_prefix() -> None:
    ids = ["abcdef0123", "abcdef9999", "123456aaaa"]
    assert resolve_client("123456", ids) == "123456aaaa"
    assert resolve_client("ABCDEF01", ids) == "abcdef0123"
    with pytest.raises(ClientLookupError, match="matches 2 clients"):
        resolve_client("abcdef", ids)
    with pytest.raises(ClientLookupError, match="no client id starts with"):
        resolve_client("ffffff", ids)
    with pytest.raises(ClientLookupError, match="at least 6"):
        resolve_client("abc", ids)


def test_resolve_names_what_it_looked_up_and_how_to_list_them() -> None:
    """The refusals speak of what was looked up: an operator key's id says `echo-swarm admin keys list` (it once
    said "`echo-swarm admin admin keys` lists them", a client's message rewritten word by word)."""
    keys = ["abcdef0123", "abcdef9999"]
    cases = {"ffffff": "no admin key id starts with 'ffffff'; `echo-swarm admin keys list` lists them",
             "abc": "give at least 6 characters of the admin key id (got 'abc'); `echo-swarm admin keys list` lists "
                    "them",
             "abcdef": "'abcdef' matches 2 admin keys (abcdef0123, abcdef9999…); give more characters"}
    for ref, message in cases.items():
        with pytest.raises(ClientLookupError) as caught:
            resolve_client(ref, keys, ADMIN_KEYS)
        assert str(caught.value) == message
    with pytest.raises(ClientLookupError) as caught:
        resolve_client("ffffff", keys)
    assert str(caught.value) == "no client id starts with 'ffffff'; `echo-swarm admin clients` lists them"


def test_throughput_series_buckets_tokens_per_second() -> None:
    series = throughput_series([(0, 1, 10), (1, 1, 20), (3, 1, 40), (97, 1, 1), (-2, 1, 5)], start=0.0, end=4.0,
                               bins=4)
    assert [b["tokens_per_s"] for b in series] == [15.0, 20.0, 0.0, 41.0]  # outliers clamp into the end buckets
    assert [b["t"] for b in series] == [1.0, 2.0, 3.0, 4.0]
    assert series[0]["results_per_min"] == 120.0
    assert throughput_series([], 5.0, 5.0, 3)[0]["tokens_per_s"] == 0.0


def test_count_by_sorts_by_count() -> None:
    assert list(count_by(["b", "a", "b", "c", "a", "b"]).items()) == [("b", 3), ("a", 2), ("c", 1)]


def test_admin_keys_file_reports_bad_lines() -> None:
    pub = crypto.public_bytes(crypto.generate_key())
    text = f"# comment\n\n{pub.hex()} ops laptop\nnot-a-key x\n{'ab' * 31}\n"
    keys, problems = parse_admin_keys(text)
    assert [(k.key_id, k.comment) for k in keys] == [(crypto.client_id_for(pub), "ops laptop")]
    assert len(problems) == 2 and problems[0].startswith("line 4")
