"""Client strings stay data end to end, against a real coordinator (aiohttp on loopback, real SQLite): a
registration carrying a forged log line or an escape sequence is refused at the schema and writes nothing, and
`echo-swarm admin` renders whatever an (older) database holds as plain text — no markup, no raw escapes."""

from __future__ import annotations

import io
import json
import logging
import re
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.api.admin_keys import ADMIN_KEY_FILE
from echo_swarm.cli import app
from shared import wire
from shared.safe_text import SafeFormatter, escape, first_unsafe
from swarm_client.hardware import profile
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import register

FORGED = "\n2026-11-30 23:59:59,000 CRITICAL coordinator.api.app: learner loop stopped"
CLEAR = "\x1b[2J\x1b[H"
OSC8 = "\x1b]8;;https://evil.example\x07here\x1b]8;;\x07"

RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")

runner = CliRunner()


def admin(live: LiveCoordinator, *args: str) -> str:
    result = runner.invoke(app, ["admin", "--url", live.url, "--key", str(live.run_dir / ADMIN_KEY_FILE), *args],
                           catch_exceptions=False, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize(("field", "value"), [
    ("name", "m\n2026-11-30 23:59:59,000 CRITICAL coordinator.api.app: learner"), ("name", "x" + CLEAR), ("device", "cuda:" + OSC8), ("platform", "Linux\r"),
    ("software", "echo-swarm \u202e1.0"), ("gpu", "RTX\u20283060"),
])
def test_a_registration_with_control_characters_is_refused_and_writes_nothing(
        live_coordinator: LiveCoordinator, field: str, value: str) -> None:
    live = live_coordinator
    client = RawClient(live.url)
    body = {"public_key": client.public_key, "profile": profile("torch", "cpu", "m").model_dump() | {field: value}}
    before = {t: db_rows(live.run_dir, f"SELECT * FROM {t}") for t in ("clients", "nonces")}
    log = io.StringIO()
    handler = logging.StreamHandler(log)  # what coordinator.launch.main.run installs: the SafeFormatter, at INFO
    handler.setFormatter(SafeFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    coordinator_log = logging.getLogger("coordinator")
    coordinator_log.addHandler(handler)
    level = coordinator_log.level
    coordinator_log.setLevel(logging.INFO)
    try:
        status, raw = client.post("/v1/register", wire.pack(body))
        err = RawClient.error(raw)
        assert (status, err.error) == (422, "schema_invalid")
        assert f"RegisterRequest.profile.{field}:" in err.message and "printable text" in err.message
        assert {t: db_rows(live.run_dir, f"SELECT * FROM {t}") for t in ("clients", "nonces")} == before
        # the honest registration from the same key goes through, and is logged as one plain record
        honest = body | {"profile": profile("torch", "cpu", "m").model_dump()}
        assert client.post("/v1/register", wire.pack(honest))[0] == 200
    finally:
        coordinator_log.removeHandler(handler)
        coordinator_log.setLevel(level)
    lines = log.getvalue().splitlines()
    assert len([line for line in lines if f"registered client {client.client_id[:8]}" in line]) == 1
    assert all(RECORD.match(line) for line in lines), lines  # nothing the client sent starts a line
    assert "CRITICAL" not in log.getvalue() and first_unsafe(log.getvalue().replace("\n", "")) is None


HOSTILE = {
    "name": "[/]",
    "device": "[link=https://evil.example]cuda[/link]",
    "platform": "Linux " + OSC8,
    "backend": "torch" + CLEAR,
}


def store_profile(live: LiveCoordinator, client_id: str, fields: dict[str, str]) -> None:
    """Write profile values straight into the database (the clients table keeps the profile as JSON)."""
    db = sqlite3.connect(live.run_dir / "coordinator.sqlite", timeout=10)
    with db:
        (raw,) = db.execute("SELECT profile FROM clients WHERE client_id=?", (client_id,)).fetchone()
        db.execute("UPDATE clients SET profile=? WHERE client_id=?", (json.dumps(json.loads(raw) | fields), client_id))
    db.close()


def test_admin_clients_renders_stored_strings_as_text(live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator
    client = register(live, name="honest")
    other = register(live, name="placeholder")
    # an old database (or a bug elsewhere) holds strings the schema would refuse today: write them directly
    store_profile(live, other.client_id, HOSTILE)

    out = admin(live, "clients")
    assert "\x1b" not in out and "\x07" not in out  # no escape sequence reaches the terminal raw
    assert "[/]" in out  # markup is printed as written: it neither crashes nor styles anything
    assert HOSTILE["device"] in out
    assert escape(HOSTILE["platform"]) in out and escape(HOSTILE["backend"]) in out  # visible, escaped
    assert client.client_id[:8] in out and "honest" in out
    # the JSON view carries the values exactly, JSON-escaped
    rows = {r["client_id"]: r for r in json.loads(admin(live, "clients", "--json"))}
    assert "\x1b" not in admin(live, "clients", "--json")
    assert {k: rows[other.client_id][k] for k in HOSTILE} == HOSTILE


def test_admin_output_on_a_terminal_has_no_hyperlink_or_foreign_escape(live_coordinator: LiveCoordinator,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a real terminal rich emits its own styles (ESC [ ... m); a client's markup or escape must add none:
    no OSC 8 hyperlink, no screen clear, no cursor movement."""
    from rich.console import Console

    from echo_swarm import admin_cli

    live = live_coordinator
    other = register(live, name="x")
    store_profile(live, other.client_id, {"name": "[/]", "device": HOSTILE["device"],
                                          "platform": "Linux " + OSC8 + CLEAR})
    monkeypatch.setattr(admin_cli, "console", Console(force_terminal=True, width=400, color_system="truecolor"))
    out = admin(live, "clients")
    assert "\x1b]" not in out and "\x07" not in out  # no OSC sequence at all (rich adds none for plain cells)
    assert "\x1b[2J" not in out and "\x1b[H" not in out
    assert "[link=https://evil.example]cuda[/link]" in out and "[/]" in out
    assert "\\x1b]8;;https://evil.example\\x07here" in out


def test_admin_error_messages_are_not_markup(tmp_path: Path) -> None:
    # an error quoting text it did not write (here the URL, in a refusal it may be the coordinator's message)
    # prints as written: before, "[/]" in it crashed the command with a MarkupError
    key = tmp_path / "k.key"
    assert runner.invoke(app, ["admin", "keys", "generate", str(key)]).exit_code == 0
    url = "http://127.0.0.1:9/[/][link=https://evil.example]x"
    result = runner.invoke(app, ["admin", "--url", url, "--key", str(key), "status"], catch_exceptions=False,
                           env={"COLUMNS": "400"})
    assert result.exit_code == 1 and f"cannot reach the coordinator at {url}" in result.output


def test_admin_generate_prints_plain_lines(tmp_path: Path) -> None:
    key = tmp_path / "[red]op[/].key"
    result = runner.invoke(app, ["admin", "keys", "generate", str(key)], env={"COLUMNS": "400"})
    assert result.exit_code == 0 and f"wrote {key}" in result.output
