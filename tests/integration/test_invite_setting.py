""""Invite required" as a run setting (issue 24): the operator switches a running coordinator to invite-only and
back with `echo-swarm admin registration`, and issues tokens with `echo-swarm admin invite` — through the real CLI,
against a real coordinator. Invite-only refuses a registration without a valid token (403 registration_closed,
nothing written); the setting is kept in the store."""

from __future__ import annotations

from shared.messages import RegisterRequest
from swarm_client.hardware import profile
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.test_admin import cli, cli_json


def _register(live: LiveCoordinator, invite: str = "") -> tuple[int, str | None, RawClient]:
    client = RawClient(live.url)
    status, raw = client.post("/v1/register", RegisterRequest(public_key=client.public_key, invite=invite,
                                                              profile=profile("torch", "cpu", "newcomer")))
    return status, None if status == 200 else RawClient.error(raw).error, client


def clients(live: LiveCoordinator) -> int:
    return int(db_rows(live.run_dir, "SELECT COUNT(*) FROM clients")[0][0])


def test_the_operator_makes_a_running_swarm_invite_only_and_back(live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator
    assert cli_json(live, "status")["registration"] == "open"
    early = _register(live)[2]  # a volunteer who joined while the swarm was open
    # invite-only with no token anywhere would lock every newcomer out: refused, with what to do
    out = cli(live, "registration", "invite", ok=False)
    assert "admin_refused" in out and "echo-swarm admin invite" in out
    token = cli_json(live, "invite", "--note", "for alice")["token"]
    assert "registration is invite" in cli(live, "registration", "invite")
    assert cli_json(live, "status")["registration"] == "invite"
    assert db_rows(live.run_dir, "SELECT value FROM meta WHERE key='registration_mode'") == [("invite",)]

    before = clients(live)
    for invite in ("", "not-the-token"):
        status, reason, _ = _register(live, invite)
        assert (status, reason) == (403, "registration_closed")
    assert clients(live) == before  # nothing written
    status, _, _ = _register(live, token)
    assert status == 200 and clients(live) == before + 1
    second = cli_json(live, "invite")["token"]
    assert second != token and _register(live, second)[0] == 200  # each issued token is valid

    # identities registered before the switch stay in: re-registering needs no token
    status, raw = early.post("/v1/register", RegisterRequest(public_key=early.public_key,
                                                             profile=profile("torch", "cpu", "early")))
    assert status == 200, raw
    assert "registration is open" in cli(live, "registration", "open")
    assert _register(live)[0] == 200  # open again: no token needed
    assert "must be 'open' or 'invite'" in cli(live, "registration", "closed", ok=False)
