"""The relay header of the p2p call relay (coordinator.roles.p2p_relay, docs/protocol.md §6b) over plain HTTP: with the
run's relay token the API counts a call against the libp2p peer it names; without it the header is refused
(``bad_relay``), is charged to the sender's own address, and cannot buy a fresh rate-limit budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.run.relay import ADDRESS_HEADER, PEER_HEADER, TOKEN_HEADER
from shared.messages import ClientProfile, RegisterRequest
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import RawClient, db_rows

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


@pytest.fixture
def live(tmp_path: Path, tiny_model_dir: Path) -> Iterator[LiveCoordinator]:
    # a burst of 3 requests per address, then about one every 1000 s
    with running_coordinator(tmp_path, tiny_model_dir, limits={"per_address_rps": 0.001, "per_address_burst": 3},
                             learner={"max_steps": 1}) as live:
        yield live


def _register(client: RawClient, headers: dict[str, str]) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    profile = ClientProfile(name="relay", backend="torch", device="cpu", platform="Linux x86_64", cpu_count=2,
                            memory_gb=4.0, software="test")
    data = client.envelope("/v1/register", RegisterRequest(public_key=client.public_key, profile=profile))
    req = urllib.request.Request(client.url + "/v1/register", data=data, method="POST",
                                 headers={"Content-Type": "application/msgpack"} | headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_a_forged_relay_header_does_not_change_the_rate_limit_identity(live: LiveCoordinator) -> None:
    client = RawClient(live.url)
    for n in range(3):  # each names another peer: refused, and charged to 127.0.0.1 all the same
        status, body = _register(client, {TOKEN_HEADER: "0" * 64, PEER_HEADER: PEER[:-1] + "abc"[n]})
        assert (status, RawClient.error(body).error) == (401, "bad_relay")
    status, body = _register(client, {})  # 127.0.0.1's burst is spent
    assert (status, RawClient.error(body).error) == (429, "rate_limited")
    assert "127.0.0.1" in RawClient.error(body).message
    assert set(live.coordinator.guard.per_address._buckets) == {"127.0.0.1"}

    # the p2p role's own headers (the run's token): the call counts against the address the caller's libp2p
    # connection came from (never its peer id, which costs nothing to make)
    status, _ = _register(client, {TOKEN_HEADER: live.coordinator.relay_token, PEER_HEADER: PEER,
                                   ADDRESS_HEADER: "198.51.100.7"})
    assert status == 200
    assert db_rows(live.run_dir, "SELECT address FROM clients WHERE client_id=?", (client.client_id,)) == [
        ("198.51.100.7",)]
