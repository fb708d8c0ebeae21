"""`echo-swarm join --idle-only` holds a job in progress while someone uses the machine (issue 34): a real client
process generating for a real coordinator stops decoding within a couple of seconds of keyboard or mouse input and
goes on, finishing the same job, once nobody has touched them for --idle-input-minutes. The input is simulated
through the client's own X11 probe (`xprintidle` on PATH, a stand-in that reports what the test sets)."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from swarm_client.control import read_status
from swarm_client.reporting import IN_USE_STATE
from swarm_client.webcontrol import PAGE_FILE, TOKEN_FILE
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import Proc, db_rows, wait_until


def _status(home: Path) -> dict[str, Any]:
    return read_status(home) or {}


def _page_state(home: Path) -> dict[str, Any]:
    """The live counters of the client's control page (its job_steps move while it decodes)."""
    base = json.loads((home / PAGE_FILE).read_text())["url"].rstrip("/")
    token = (home / TOKEN_FILE).read_text().strip()
    req = urllib.request.Request(f"{base}/api/state", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_idle_only_holds_the_job_in_hand_while_someone_uses_the_machine(tmp_path: Path,
                                                                      live_coordinator: LiveCoordinator) -> None:
    touched = tmp_path / "touched"  # exists: someone is at the keyboard now
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    probe = bin_dir / "xprintidle"  # milliseconds since the last input, as the real one prints them
    calls = tmp_path / "probe-calls"  # one line per time the client asked
    probe.write_text(f"#!/bin/sh\necho >> '{calls}'\nif [ -e '{touched}' ]; then echo 0; else echo 3600000; fi\n")
    probe.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DISPLAY": ":99", "DBUS_SESSION_BUS_ADDRESS": ""}
    home = tmp_path / "client"
    # 0.2 % of the CPU: each decoding step rests 500× its compute time, so one job lasts many seconds
    client = Proc([sys.executable, "-m", "echo_swarm", "join", live_coordinator.url, "--home", str(home),
                   "--threads", "1", "--no-panel", "--no-benchmark", "--idle-only", "--idle-input-minutes", "0.05",
                   "--max-cpu-percent", "0.2"], tmp_path / "client.log", env=env)
    try:
        wait_until(lambda: _status(home).get("state") == "generating", 240, "the client to start generating")
        touched.touch()
        t0 = time.monotonic()
        wait_until(lambda: _status(home).get("state") == IN_USE_STATE, 60, "the job to be held for the user")
        held_after = time.monotonic() - t0
        steps = _page_state(home)["job_steps"]
        # held: several input checks later, not one decoding step more, and nothing submitted
        wait_until(lambda: "someone is using this machine" in client.output(), 30, "the client to say why it holds")
        asked = len(calls.read_text().splitlines())
        wait_until(lambda: len(calls.read_text().splitlines()) >= asked + 3, 60,
                   "three more looks at the input while the user is still there")
        assert _page_state(home)["job_steps"] == steps and _status(home).get("state") == IN_USE_STATE
        assert _status(home).get("accepted", 0) == 0  # the held job is the first: nothing returned meanwhile
        assert db_rows(live_coordinator.run_dir, "SELECT COUNT(*) FROM jobs WHERE state = 'leased'") == [(1,)]
        touched.unlink()  # the user leaves: after --idle-input-minutes (3 s) without input the job goes on
        wait_until(lambda: _status(home).get("state") != IN_USE_STATE, 60, "the job to go on")
        wait_until(lambda: _status(home).get("accepted", 0) >= 1, 240, "the held job's result to be accepted")
        print(f"\nheld {held_after:.2f} s after the input (at step {steps})")
        assert "the job goes on" in client.output()
    finally:
        client.stop()
