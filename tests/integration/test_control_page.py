"""The client's local control page (issue 25) in a real headless Chromium, against a real client process working
for a real coordinator: its Pause and Resume buttons change what the running client does; a request without the
token is refused; the page answers on 127.0.0.1 and on no other address of this machine; its Snooze, bandwidth
and Finish controls reach the client too (a snooze holds back work until Resume, a typed cap shows in the client's
status, Finish ends it with exit code 0)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from swarm_client.control import read_controls, read_status
from swarm_client.webcontrol import PAGE_FILE, TOKEN_FILE
from tests.integration.browser import Chromium, Page, open_control_page
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import ARTIFACTS, REPO, db_rows, start_client, wait_until
from tests.integration.test_status_page import wait_for

pytestmark = pytest.mark.slow


def _leases(live: LiveCoordinator) -> int:
    return int(db_rows(live.run_dir, "SELECT COALESCE(SUM(issue_count), 0) FROM jobs")[0][0])


def _status(home: Path) -> dict[str, Any]:
    return read_status(home) or {}


def _non_loopback_address() -> str:
    """An address of this machine that is not loopback (the one its default route would use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the outgoing interface
        address = str(s.getsockname()[0])
    assert not address.startswith("127."), "this machine has no non-loopback IPv4 address to test against"
    return address


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
             body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=body)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def _click(page: Page, button: str) -> None:
    before = await page.evaluate("window.echoControl.actions")
    await page.evaluate(f"document.getElementById('{button}').click()")
    await wait_for(page, f"window.echoControl.actions > {before}", 30, f"the {button} action to be acknowledged")


def test_the_control_page_pauses_and_resumes_the_running_client(tmp_path: Path,
                                                                live_coordinator: LiveCoordinator) -> None:
    home = tmp_path / "client"
    client = start_client(live_coordinator.url, home, tmp_path / "client.log", "--no-panel", "--no-benchmark")
    browser: Chromium | None = None
    try:
        wait_until(lambda: _status(home).get("accepted", 0) >= 1, 240, "the client's first accepted result")
        info = json.loads((home / PAGE_FILE).read_text())
        token = (home / TOKEN_FILE).read_text().strip()
        base = info["url"].rstrip("/")
        assert base.startswith("http://127.0.0.1:") and info["pid"] == client.pid
        assert oct((home / TOKEN_FILE).stat().st_mode & 0o777) == "0o600"

        # `client open --print` gives the URL with the token
        opened = subprocess.run([sys.executable, "-m", "echo_swarm", "client", "open", "--print", "--home", str(home)],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
        assert opened.returncode == 0 and opened.stdout.strip() == f"{base}/?token={token}"

        # without the token (or with a wrong one, or another Host) nothing is served and nothing changes
        for path in ("/", "/api/state", "/static/control.js"):
            status, body = _request(base + path)
            assert status == 401 and b"echo-swarm client open" in body, path
        assert _request(base + "/?token=not-it")[0] == 403
        assert _request(base + "/api/pause", method="POST", body=b"{}",
                        headers={"Content-Type": "application/json"})[0] == 401
        assert _request(base + "/api/state", headers={"Authorization": f"Bearer {token}",
                                                      "Host": f"evil.example:{info['port']}"})[0] == 421
        status, body = _request(base + "/api/pause", method="POST", body=b"paused=1",
                                headers={"Authorization": f"Bearer {token}",
                                         "Content-Type": "application/x-www-form-urlencoded"})
        assert status == 415  # a cross-site form cannot send JSON
        assert not _status(home).get("state", "").startswith("paused")
        status, body = _request(base + "/api/state", headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(body)["client_id"] == _status(home)["client_id"]

        # never beyond loopback
        with socket.socket() as s:
            s.settimeout(10)
            assert s.connect_ex((_non_loopback_address(), int(info["port"]))) != 0

        browser = Chromium(tmp_path / "chromium-profile", tmp_path / "chromium.log")

        async def drive() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                page, _ = await open_control_page(session, browser, home)
                assert await page.evaluate("location.search") == ""  # the token left the address bar
                shown = await page.evaluate("document.getElementById('results').textContent")

                await _click(page, "pause")
                before = _leases(live_coordinator)
                await asyncio.to_thread(wait_until, lambda: _status(home).get("state") == "paused", 120,
                                        "the client to pause")
                at_pause = _leases(live_coordinator)
                assert at_pause - before <= 1  # at most a lease already in flight (handed back)
                await wait_for(page, "document.getElementById('state').dataset.state === 'paused'", 30,
                               "the page to show the pause")
                buttons = "['pause', 'resume'].map(b => document.getElementById(b).disabled)"
                assert await page.evaluate(buttons) == [True, False]  # only what would change something
                polls = _status(home)["gated_polls"]
                await asyncio.to_thread(wait_until, lambda: _status(home)["gated_polls"] >= polls + 3, 60,
                                        "three polls while paused")
                assert _leases(live_coordinator) == at_pause, "the client leased a job while paused"

                await _click(page, "resume")
                await asyncio.to_thread(wait_until, lambda: _leases(live_coordinator) > at_pause, 120,
                                        "a lease after Resume")
                accepted = _status(home)["accepted"]
                await asyncio.to_thread(wait_until, lambda: _status(home)["accepted"] > accepted, 240,
                                        "a result accepted after Resume")
                await wait_for(page, "document.getElementById('state').dataset.state !== 'paused'", 30,
                               "the page to show the client working again")
                await wait_for(page, "!document.getElementById('pause').disabled", 30, "Pause to be offered again")
                assert await page.evaluate(buttons) == [False, True]
                await wait_for(page, "document.querySelectorAll('#history tbody tr').length >= 1", 60,
                               "the history table")
                # the lifetime card: this run in the runs table and the credit series plotted (swarm_client/lifetime.py)
                await wait_for(page, "Number(document.getElementById('credit-plot').dataset.points) >= 2", 60,
                               "two points of the lifetime credit plot")
                await page.screenshot(ARTIFACTS / "control-page.png")
                state = await page.evaluate("""({rows: document.querySelectorAll('#history tbody tr').length,
                    credit: document.getElementById('credit').textContent, errors: window.echoControl.errors,
                    runs: [...document.querySelectorAll('#runs tbody tr')].map((r) => r.dataset.run),
                    plotted: document.querySelectorAll('#credit-plot path.credit').length,
                    lifetime: document.getElementById('lifetime-total').textContent})""")

                # Snooze 30 min: no new work, the page and the status say until when; Resume ends it early
                await _click(page, "snooze-30")
                await asyncio.to_thread(wait_until, lambda: _status(home).get("state", "").startswith("snoozed until"),
                                        120, "the client to snooze")
                at_snooze, polls = _leases(live_coordinator), _status(home)["gated_polls"]
                await wait_for(page, "document.getElementById('state').dataset.state.startsWith('snoozed until')", 30,
                               "the page to show the snooze")
                await asyncio.to_thread(wait_until, lambda: _status(home)["gated_polls"] >= polls + 3, 60,
                                        "three polls while snoozed")
                assert _leases(live_coordinator) == at_snooze, "the client leased a job while snoozed"
                await _click(page, "resume")
                await asyncio.to_thread(wait_until, lambda: _leases(live_coordinator) > at_snooze, 120,
                                        "a lease after the snooze was ended")

                # a download cap typed into the page reaches the running client's throttle (its status line)
                await page.evaluate("document.getElementById('bandwidth').value = '2.5'")
                await _click(page, "bandwidth-set")
                await wait_for(page, "document.getElementById('bandwidth').dataset.current === '2.5'", 30,
                               "the page to show the cap in force")
                await asyncio.to_thread(wait_until, lambda: str(_status(home).get("bandwidth", "")).endswith(
                    "limit 2.5 MB/s"), 120, "the client's status to show the 2.5 MB/s cap")

                # Finish and stop: the job in hand is submitted, then the client exits 0 by itself
                done_before = _status(home)["accepted"]
                await _click(page, "finish")
                await page.ws.close()
                await asyncio.to_thread(wait_until, lambda: client.proc.poll() is not None, 240,
                                        "the client to finish and exit")
                assert client.proc.returncode == 0, client.output()[-3000:]
                assert "finishing (`echo-swarm client finish`)" in client.output()
                return state | {"shown": shown, "accepted_at_finish": done_before}

        seen = asyncio.run(drive())
        assert seen["rows"] >= 1 and seen["errors"] == 0 and "accepted" in seen["shown"]
        assert seen["runs"] == [_status(home)["run_id"]] and seen["plotted"] == 1
        assert "results accepted over 1 run since" in seen["lifetime"]
        assert not read_controls(home).finish  # obeyed and cleared: the next start works normally
        assert _status(home)["state"] == "stopped" and _status(home)["accepted"] >= seen["accepted_at_finish"]
    finally:
        if browser is not None:
            browser.stop()
        assert client.stop() == 0, client.output()[-3000:]
    assert not (home / PAGE_FILE).exists()  # the page is gone with the client
