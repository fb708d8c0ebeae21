"""`echo-swarm admin` against a real coordinator (aiohttp on loopback, real SQLite, real learner): every
subcommand, through the real CLI, plus the admin API's authentication refusals."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from coordinator.api.admin_keys import ADMIN_KEY_FILE
from coordinator.api.service import Coordinator
from echo_swarm.cli import app
from shared import crypto, wire
from shared.admin import AdminEmpty
from shared.exit_codes import ExitCode
from shared.messages import LeaseRequest, LeaseResponse, ResultSubmission
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register, try_lease
from tests.integration.test_untrusted_strings import store_profile
from tests.terminal import run_on_terminal

runner = CliRunner()


def cli(live: LiveCoordinator, *args: str, key: Path | None = None, ok: bool = True) -> str:
    result = runner.invoke(app, ["admin", "--url", live.url, "--key", str(key or live.run_dir / ADMIN_KEY_FILE),
                                 *args], catch_exceptions=False, env={"COLUMNS": "200"})
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def cli_json(live: LiveCoordinator, *args: str, key: Path | None = None) -> Any:
    return json.loads(cli(live, *args, "--json", key=key))


def admin_envelope(key: Any, path: str, body: bytes | None = None) -> bytes:
    import time

    return wire.encode(crypto.sign_request(key, path, body if body is not None else wire.encode(AdminEmpty()),
                                           timestamp=time.time()))


def test_admin_api_refuses_unauthenticated_requests(live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator
    raw = RawClient(live.url)
    status, body = raw.send("/v1/admin/status", b"")
    assert (status, RawClient.error(body).error) == (401, "not_admin")
    # a registered volunteer's valid signature is not an operator's
    volunteer = register(live)
    status, body = volunteer.post("/v1/admin/status", AdminEmpty())
    assert (status, RawClient.error(body).error) == (401, "not_admin")
    assert "admin_keys" in RawClient.error(body).message
    operator = crypto.load_private_key(live.run_dir / ADMIN_KEY_FILE)
    # signed for another endpoint
    status, body = raw.send("/v1/admin/clients", admin_envelope(operator, "/v1/admin/status"))
    assert (status, RawClient.error(body).error) == (401, "bad_signature")
    # replayed
    env = admin_envelope(operator, "/v1/admin/status")
    assert raw.send("/v1/admin/status", env)[0] == 200
    status, body = raw.send("/v1/admin/status", env)
    assert (status, RawClient.error(body).error) == (409, "replayed_nonce")
    # a forged signature
    forged = bytearray(admin_envelope(operator, "/v1/admin/status"))
    forged[-5] ^= 0xFF
    status, body = raw.send("/v1/admin/status", bytes(forged))
    assert (status, RawClient.error(body).error) == (401, "bad_signature")
    # a strict body: unknown parameters are refused
    status, body = raw.send("/v1/admin/ban", admin_envelope(operator, "/v1/admin/ban", wire.pack({"client": "abc"})))
    assert (status, RawClient.error(body).error) == (422, "schema_invalid")
    assert raw.get("/v1/admin/status")[0] == 405
    # no CLI key → a clear message, exit 2 (a wrong command line: nothing was sent)
    result = runner.invoke(app, ["admin", "--url", live.url, "--key", str(live.run_dir / "nope.key"), "status"])
    assert result.exit_code == ExitCode.USAGE and "cannot read key file" in result.output


def test_cli_says_what_to_do_without_a_coordinator(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    assert runner.invoke(app, ["admin", "keys", "generate", str(key)]).exit_code == 0
    result = runner.invoke(app, ["admin", "--url", "http://127.0.0.1:9", "--key", str(key), "status"])
    assert result.exit_code == 1 and "cannot reach the coordinator at http://127.0.0.1:9" in result.output
    result = runner.invoke(app, ["admin", "--run-dir", str(tmp_path), "status"], env={"COLUMNS": "200"})
    assert result.exit_code == 1 and "endpoint.json is missing" in result.output
    result = runner.invoke(app, ["admin", "status"], env={"ECHO_SWARM_ADMIN_URL": "", "ECHO_SWARM_ADMIN_KEY": ""})
    assert result.exit_code == ExitCode.USAGE and "--run-dir" in result.output


HINT_CLIENTS = "give the whole client id or at least its first 6 digits, as `echo-swarm admin clients` shows them"
HINT_KEYS = "give the whole key id or at least its first 6 digits, as `echo-swarm admin keys list` shows them"
# a command line that no coordinator would accept: (arguments after `admin --url U --key K`, the line on stderr)
USAGE_ERRORS = [
    (["ban", "abc"], f"client 'abc' is too short (3 hex digits): {HINT_CLIENTS}"),
    (["unban", "xyz12345"], f"client 'xyz12345' is not hex (0-9, a-f): {HINT_CLIENTS}"),
    (["ban", "0" * 33], f"client '{'0' * 33}' is longer than a client id (32 hex digits): {HINT_CLIENTS}"),
    (["audit", "--client", "ab"], f"client 'ab' is too short (2 hex digits): {HINT_CLIENTS}"),
    (["audit", "--outcome", "Not Valid"],
     "outcome 'Not Valid' does not fit: an outcome is lowercase letters and '_', e.g. accepted or rejected"),
    (["audit", "--job", "a/b"],
     "job id 'a/b' does not fit: a job id is 1 to 64 letters, digits, '_' or '-', as `echo-swarm admin jobs` lists them"),
    (["ban", "abcdef", "--note", "x" * 300], "note does not fit: a note is one line of at most 256 characters"),
    (["registration", "bogus"], "registration mode must be 'open' or 'invite', not 'bogus'"),
    (["keys", "add", "12"], "'12' is not a public key: give its 64 hex digits, as `echo-swarm admin keys generate` "
                            "printed them"),
    (["keys", "remove", "12"], f"key '12' is too short (2 hex digits): {HINT_KEYS}"),
]


def echo_swarm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, timeout=120,
                          env=os.environ | (env or {}))


def test_usage_errors_exit_2_with_one_line_and_change_nothing(live_coordinator: LiveCoordinator,
                                                              tmp_path: Path) -> None:
    """README's exit codes: 2 is bad usage. Each wrong command line is one line on stderr saying what was wrong
    and what to give instead (never a schema's regex), nothing on stdout, and the run is unchanged."""
    live = live_coordinator
    register(live)
    key = str(live.run_dir / ADMIN_KEY_FILE)

    def state() -> tuple[object, ...]:
        admin_log = live.run_dir / "admin.log"
        return (db_rows(live.run_dir, "SELECT * FROM clients"), (live.run_dir / ADMIN_KEY_FILE).read_bytes(),
                (live.run_dir / "admin_keys").read_bytes(), admin_log.exists() and admin_log.read_bytes())

    before = state()
    for args, line in USAGE_ERRORS:
        res = echo_swarm("admin", "--url", live.url, "--key", key, *args)
        assert (res.returncode, res.stderr, res.stdout) == (ExitCode.USAGE, f"error: {line}\n", ""), args
    assert state() == before
    assert cli_json(live, "clients")[0]["state"] != "banned" and cli_json(live, "status")["issuing_paused"] is False

    # the command line names no usable coordinator or key
    no_env = {"ECHO_SWARM_ADMIN_URL": "", "ECHO_SWARM_ADMIN_KEY": ""}
    res = echo_swarm("admin", "status", env=no_env)
    assert (res.returncode, res.stderr) == (ExitCode.USAGE, "error: say which coordinator to administer: --run-dir "
                                            "DIR on the coordinator's machine, or --url http://HOST:PORT --key PATH "
                                            "(an operator key listed in the run's admin_keys)\n")
    missing = tmp_path / "nope.key"
    res = echo_swarm("admin", "--url", live.url, "--key", str(missing), "status", env=no_env)
    assert (res.returncode, res.stderr) == (ExitCode.USAGE, f"error: cannot read key file {missing}: No such file "
                                                            f"or directory\n")
    res = echo_swarm("admin", "keys", "generate", key)
    assert (res.returncode, res.stderr) == (ExitCode.USAGE, f"error: {key} already exists; choose another file "
                                                            f"(keys are never overwritten)\n")
    # a refusal by the coordinator is not a usage error: 1, as before
    res = echo_swarm("admin", "--url", live.url, "--key", key, "ban", "ffffff")
    assert res.returncode == ExitCode.FAILED and res.stderr.startswith("error: refused (404 ") and \
        "no client id starts with 'ffffff'" in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_clients_fit_an_80_column_terminal(live_coordinator: LiveCoordinator) -> None:
    """`admin clients` on an 80-column terminal (a real pty, as an operator's ssh session): every line fits, each
    client is one line with its id, name, state and counts, and the columns left out are named. On a wide terminal
    every column shows, whole."""
    live = live_coordinator
    names = ["alice", "a volunteer's laptop in the kitchen", "gpu-box-3"]
    volunteers = [register(live, name=n) for n in names]
    store_profile(live, volunteers[1].client_id, {"device": "cuda:NVIDIA GeForce RTX 4090 Laptop GPU",
                                                  "platform": "Windows AMD64"})
    argv = [sys.executable, "-m", "echo_swarm", "admin", "--url", live.url, "--key",
            str(live.run_dir / ADMIN_KEY_FILE), "clients"]

    screen = run_on_terminal(argv, columns=80)
    assert screen.returncode == 0, screen.text()
    lines = [line.rstrip() for line in screen.lines() if line.strip()]
    assert screen.widest() <= 80, screen.text()
    assert lines[0].strip() == "3 clients"
    assert lines[1].split() == ["client", "name", "state", "accepted", "rejected", "credit", "last", "seen"]
    rows = {line[:8]: line for line in lines[2:5]}  # one line per client (in the coordinator's order)
    for volunteer, name in zip(volunteers, names, strict=True):
        row = rows[volunteer.client_id[:8]]
        assert row.startswith(f"{volunteer.client_id[:8]}  {name[:15]}") and row.endswith(" ago"), row
    hidden = " ".join(lines[5:])
    assert hidden.startswith("not shown (too narrow): ") and hidden.endswith("; widen the terminal or use --json")
    assert "platform" in hidden and "device" in hidden

    wide = run_on_terminal(argv, columns=240)
    assert wide.returncode == 0 and "not shown" not in wide.text(), wide.text()
    assert "cuda:NVIDIA GeForce RTX 4090 Laptop GPU" in wide.text() and names[1] in wide.text()
    assert all(h in wide.text() for h in ("backend", "device", "platform", "accepted", "rejected", "last seen"))


@pytest.fixture
def live(tmp_path: Path, tiny_model_dir: Path) -> Iterator[LiveCoordinator]:
    with running_coordinator(tmp_path, tiny_model_dir) as live:
        yield live


def test_status_clients_versions_jobs_audit(live: LiveCoordinator) -> None:
    client = register(live, name="alice")
    job_a = lease(client, live.coordinator.public_key)
    good = honest_result(live, job_a)
    bad = ResultSubmission.model_validate(good.model_dump() | {"seed": good.seed + 1})
    assert client.post("/v1/results", wire.encode(bad))[0] == 422
    assert client.post("/v1/results", wire.encode(good))[0] == 200
    job_b = lease(client, live.coordinator.public_key)

    s = cli_json(live, "status")
    assert s["version"] == 0 and s["issuing_paused"] is False and s["sync_mode"] == "sequential-pull"
    assert s["totals"]["accepted"] == 1 and s["totals"]["rejected"] == 1
    assert s["rejections_by_reason"] == {"binding_mismatch": 1}
    assert s["clients"]["by_state"]["working"] == 1
    assert "policy version" in cli(live, "status")

    rows = cli_json(live, "clients")
    (row,) = rows
    assert row["client_id"] == client.client_id and row["name"] == "alice" and row["backend"] == "torch"
    assert row["platform"] and row["state"] == "working" and row["credit"] > 0 and row["accepted"] == 1
    assert client.client_id[:8] in cli(live, "clients")

    v = cli_json(live, "versions")
    assert v["current"] == 0 and v["versions"][0]["version"] == 0 and v["versions"][0]["served"] is True
    assert "policy versions" in cli(live, "versions")

    j = cli_json(live, "jobs")
    assert j["counts"]["leased"] == 1 and j["counts"]["done"] == 1 and j["leases_issued"] == 2
    assert [x["job_id"] for x in j["jobs"] if x["state"] == "leased"] == [job_b.job_id]
    live.clock.advance(31)  # past the 30 s lease timeout: the job is expired, waiting to be reissued
    j = cli_json(live, "jobs")
    assert j["counts"]["expired"] == 1 and j["jobs"][0]["state"] == "expired"
    other = register(live, name="bob")
    assert lease(other, live.coordinator.public_key).job_id == job_b.job_id
    j = cli_json(live, "jobs")
    assert j["reissued"] == 1 and j["jobs"][0]["reissued"] is True
    assert job_b.job_id in cli(live, "jobs")

    entries = cli_json(live, "audit")
    assert [e["outcome"] for e in entries] == ["accepted", "rejected"]
    acc, rej = entries
    assert acc["job_id"] == job_a.job_id and acc["client_id"] == client.client_id and acc["version"] == 0
    assert len(acc["content_sha256"]) == 64 and acc["reason"] == "ok"
    assert rej["reason"] == "binding_mismatch" and rej["job_id"] == job_a.job_id and len(rej["content_sha256"]) == 64
    assert acc["content_sha256"] != rej["content_sha256"]
    assert [e["outcome"] for e in cli_json(live, "audit", "--outcome", "rejected")] == ["rejected"]
    assert cli_json(live, "audit", "--client", other.client_id[:8]) == []
    assert "binding_mismatch" in cli(live, "audit")
    assert "outcome" in cli(live, "audit", "--outcome", "Not Valid", ok=False)


def test_ban_refuses_everything_and_writes_nothing_unban_restores(live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator
    client = register(live)
    job = lease(client, live.coordinator.public_key)
    r = cli_json(live, "ban", client.client_id[:10], "--note", "sent garbage")
    assert r == {"client_id": client.client_id, "banned": True, "released_jobs": [job.job_id]}
    assert db_rows(live.run_dir, "SELECT state FROM jobs WHERE job_id=?", (job.job_id,)) == [("open",)]
    tables = ("jobs", "results", "rejections", "nonces", "clients")
    before = {t: db_rows(live.run_dir, f"SELECT * FROM {t}") for t in tables}
    status, body = client.post("/v1/results", wire.encode(honest_result(live, job)))
    err = RawClient.error(body)
    assert (status, err.error) == (403, "banned") and "banned" in err.message
    status, body = client.send("/v1/lease", client.envelope("/v1/lease", wire.pack({"backend": "torch",
                                                                                       "held_version": -1})))
    assert (status, RawClient.error(body).error) == (403, "banned")
    assert {t: db_rows(live.run_dir, f"SELECT * FROM {t}") for t in tables} == before
    assert cli_json(live, "clients")[0]["state"] == "banned"
    assert "sent garbage" in (live.run_dir / "admin.log").read_text()
    assert "no client id starts with 'ffffff'" in cli(live, "ban", "ffffff", ok=False)

    assert "unbanned" in cli(live, "unban", client.client_id)
    assert lease(client, live.coordinator.public_key).job_id == job.job_id
    assert "banned" in cli(live, "ban", client.client_id)


def test_pause_resume_checkpoint_and_keys(live_coordinator: LiveCoordinator, tmp_path: Path,
                                          tiny_model_dir: Path) -> None:
    live = live_coordinator
    client = register(live)
    assert cli_json(live, "pause") == {"paused": True, "changed": True}
    assert try_lease(client, live.coordinator.public_key) is None
    status, raw = client.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1))
    assert status == 200 and wire.decode(raw, LeaseResponse).paused  # the client is told why it gets no work
    assert cli_json(live, "status")["issuing_paused"] is True
    assert db_rows(live.run_dir, "SELECT value FROM meta WHERE key='issuing_paused'") == [("1",)]
    assert "already" in cli(live, "pause")
    # a coordinator started on this run directory (a restart) is still paused
    restarted = Coordinator(live.coordinator.config, model_dir=tiny_model_dir)
    asyncio.run(restarted.start())
    try:
        assert restarted.issuing_paused is True
    finally:
        asyncio.run(restarted.stop())
    assert "resumed" in cli(live, "resume")
    assert try_lease(client, live.coordinator.public_key) is not None

    cp = cli_json(live, "checkpoint")
    folder = Path(cp["path"])
    assert cp["version"] == 0 and folder.parent == live.run_dir / "exports" and cp["bytes"] > 0
    assert (folder / "model" / "config.json").exists() and (folder / "checkpoint.json").exists()
    # the learner's newest checkpoint comes along (weights and optimizer state: what a restart resumes from)
    assert json.loads((folder / "checkpoint.json").read_text())["checkpoint_version"] == 0
    assert (folder / "checkpoint" / "optimizer.pt").exists() and (folder / "checkpoint" / "checkpoint.json").exists()
    db = sqlite3.connect(folder / "coordinator.sqlite")
    assert db.execute("SELECT version FROM versions").fetchall() == [(0,)]
    db.close()
    assert "checkpoint of version 0" in cli(live, "checkpoint")

    keys = cli_json(live, "keys", "list")
    (mine,) = keys["admin_keys"]
    assert mine["you"] is True and keys["coordinator_public_key"] == live.coordinator.public_key.hex()
    assert live.coordinator.public_key.hex() in cli(live, "keys", "list")
    new_key = tmp_path / "ops.key"
    gen = json.loads(runner.invoke(app, ["admin", "keys", "generate", str(new_key), "--json"]).output)
    assert new_key.stat().st_mode & 0o777 == 0o600
    assert runner.invoke(app, ["admin", "keys", "generate", str(new_key)]).exit_code == ExitCode.USAGE  # never overwritten
    assert "not an operator key" in cli(live, "status", key=new_key, ok=False)
    assert cli_json(live, "keys", "add", gen["public_key"], "--comment", "ops laptop")["added"] is True
    assert cli_json(live, "status", key=new_key)["version"] == 0
    unknown = next(c for c in "0123456789abcdef" if c not in (mine["key_id"][0], gen["key_id"][0])) * 8
    assert (f"no admin key id starts with '{unknown}'; `echo-swarm admin keys list` lists them"
            in cli(live, "keys", "remove", unknown, key=new_key, ok=False))
    assert cli_json(live, "keys", "remove", mine["key_id"][:8], key=new_key)["remaining"] == 1
    assert "not an operator key" in cli(live, "status", ok=False)
    assert "only operator key" in cli(live, "keys", "remove", gen["key_id"], key=new_key, ok=False)

    rotated = cli_json(live, "keys", "rotate", key=new_key)
    assert rotated["old_key_id"] == gen["key_id"] and rotated["new_key_id"] != gen["key_id"]
    listed = cli_json(live, "keys", "list", key=new_key)["admin_keys"]
    assert [k["key_id"] for k in listed] == [rotated["new_key_id"]] and listed[0]["you"] is True
    assert crypto.client_id_for(crypto.public_bytes(crypto.load_private_key(new_key))) == rotated["new_key_id"]


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out: list[tuple[str, click.Command]] = [] if prefix else [("", group)]
    for name, cmd in group.commands.items():
        out.append((prefix + name, cmd))
        if isinstance(cmd, click.Group):
            out.extend(_commands(cmd, prefix + name + " "))
    return out


@pytest.mark.parametrize("name", [n for n, _ in _commands(get_command(app).commands["admin"])])  # type: ignore[attr-defined]
def test_every_admin_command_and_option_has_help(name: str) -> None:
    cmd = dict(_commands(get_command(app).commands["admin"]))[name]  # type: ignore[attr-defined]
    assert cmd.help and len(cmd.help) > 20, f"`admin {name}` has no help text"
    for param in cmd.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help and len(param.help) > 10, f"`admin {name}` option {param.opts} has no help"
        if isinstance(param, click.Argument):
            assert getattr(param, "help", None), f"`admin {name}` argument {param.name} has no help"
    result = runner.invoke(app, ["admin", *name.split(), "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "Usage" in result.output
