"""Why a client stopped, where the volunteer looks next (issue 34). A client refused for good (banned, or its
coordinator's key changed) exits 3, and a service manager does not restart it: the reason must be readable on the
terminal (above rich's live panel, not wiped by its redraw), in `echo-swarm client status` after the process is
gone, and on the local control page a volunteer has open. A lost coordinator's warning must stay on the terminal
too. Real coordinators on loopback, real client processes, a real pseudo-terminal read back on a VT100 screen
(pyte), a real headless Chromium."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarm_client.control import read_status
from swarm_client.webcontrol import PAGE_FILE
from tests.integration.browser import Page, on_control_page
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import ARTIFACTS, REPO, start_client, wait_until
from tests.integration.test_status_page import wait_for

pytestmark = pytest.mark.slow

NOTE = "sent garbage <b>twice</b>\nerror: forged"  # an operator's ban note, as an operator might mistype it
NOTE_SHOWN = "sent garbage <b>twice</b>\\nerror: forged"  # escaped to one line
COLUMNS, ROWS = 100, 80  # tall enough that nothing scrolls off the top


def _status(home: Path) -> dict[str, Any]:
    return read_status(home) or {}


def _client_status(home: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "echo_swarm", "client", "status", "--home", str(home)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _join_argv(url: str, home: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "echo_swarm", "join", url, "--home", str(home), "--threads", "1",
            "--backend", "torch", "--no-benchmark", "--no-control-page", *extra]


class Shown:
    """A pty's bytes played on a VT100 screen: the lines a person sees at the end, and their colours."""

    def __init__(self, raw: bytes, *, columns: int = COLUMNS, rows: int = ROWS) -> None:
        import pyte

        self.screen = pyte.Screen(columns, rows)
        pyte.ByteStream(self.screen).feed(raw)
        self.lines = [line.rstrip() for line in self.screen.display]
        self.words = " ".join(" ".join(self.lines).split())

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__  # an assertion's message shows the screen

    def row(self, start: str) -> int:
        return next(i for i, line in enumerate(self.lines) if line.startswith(start))

    def red(self, row: int, width: int) -> bool:
        return all(self.screen.buffer[row][x].fg == "red" for x in range(width))

    def last_panel_row(self) -> int:
        """The row of the final panel's state line (the panel is drawn last)."""
        return [i for i, line in enumerate(self.lines) if "state" in line and "│" in line][-1]


def test_a_key_change_is_read_on_the_terminal_and_in_client_status(tmp_path: Path,
                                                                   live_coordinator: LiveCoordinator) -> None:
    """The client pinned another key for this URL (the coordinator's key changed since it first joined): exit 3, the
    reason in red above the final panel on the terminal, and `client status` says it after the process is gone."""
    from tests.terminal import run_on_terminal

    home = tmp_path / "client"
    home.mkdir(mode=0o700)
    pinned = "ab" * 32
    (home / "known_coordinators.json").write_text(json.dumps({live_coordinator.url: pinned}))

    shown_bytes = run_on_terminal(_join_argv(live_coordinator.url, home), columns=COLUMNS, rows=ROWS, timeout_s=300)
    shown = Shown(shown_bytes.raw)
    assert shown_bytes.returncode == 3, shown
    assert f"error: the coordinator at {live_coordinator.url} now presents a different signing key" in shown.words
    assert f"pinned: {pinned}" in shown.words and "remove its line from" in shown.words, shown
    row = shown.row("error: the coordinator at")
    assert shown.red(row, len("error:")), "the reason is not in red"
    assert shown.last_panel_row() > row, shown  # the final panel is below the reason, not drawn over it
    assert "stopped" in shown.lines[shown.last_panel_row()]

    said = _client_status(home)
    assert ": not running" in said.splitlines()[0], said
    assert "last stop: exit 3 (refused by the coordinator" in said, said
    assert "now presents a different signing key" in said and f"pinned:    {pinned}" in said, said
    assert _status(home)["exit_code"] == 3


def test_a_lost_coordinator_stays_on_the_terminal(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The coordinator goes away under a working client: "lost the coordinator" stays readable above the panel (it
    was wiped by the redraw), and so does the final error once the client gives up (exit 5)."""
    from tests.terminal import run_on_terminal

    home = tmp_path / "client"
    with contextlib.ExitStack() as stack:
        live = stack.enter_context(running_coordinator(tmp_path, tiny_model_dir))
        argv = _join_argv(live.url, home, "--give-up-after", "4")
        shown_bytes = run_on_terminal(argv, columns=COLUMNS, rows=ROWS, timeout_s=400,
                                      until=lambda _: _status(home).get("accepted", 0) >= 1,
                                      then=lambda _: stack.close())
    shown = Shown(shown_bytes.raw)
    assert shown_bytes.returncode == 5, shown
    lost = shown.row("lost the coordinator at")
    assert f"lost the coordinator at {live.url}" in shown.lines[lost], shown
    assert shown.red(lost, len("lost")), "the warning is not in red"
    gave_up = shown.row("error:")
    assert lost < gave_up < shown.last_panel_row(), shown
    said = _client_status(home)
    assert "last stop: exit 5 (the coordinator could not be reached" in said, said


def test_a_banned_service_client_says_why_in_client_status_and_on_the_open_control_page(
        tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    """A client run as a service (no terminal) with its control page open in a browser is banned with a note: it
    exits 3; the page still shows why (the client lets an open page take one more look before it stops serving),
    and `client status` says it afterwards."""
    from coordinator.api.admin_keys import ADMIN_KEY_FILE
    from echo_swarm.admin_client import AdminClient

    home = tmp_path / "client"
    client = start_client(live_coordinator.url, home, tmp_path / "client.log", "--no-panel", "--no-benchmark",
                          "--backend", "torch")

    async def ban_and_look(page: Page) -> dict[str, Any]:
        assert await page.evaluate("document.getElementById('alert').hidden") is True
        AdminClient.open(live_coordinator.url, key_path=live_coordinator.run_dir / ADMIN_KEY_FILE).ban(client_id, NOTE)
        await asyncio.to_thread(wait_until, lambda: client.proc.poll() is not None, 240, "the banned client to exit")
        await wait_for(page, "window.echoControl.errors >= 1", 30, "the page to find the client gone")
        await page.screenshot(ARTIFACTS / "control-page-stopped.png")
        return dict(await page.evaluate("""({hidden: document.getElementById('alert').hidden,
            reason: document.getElementById('stop-reason').textContent,
            markup: document.querySelectorAll('#alert b').length,
            pill: document.getElementById('state').textContent})"""))

    try:
        wait_until(lambda: (home / PAGE_FILE).exists() and bool(_status(home).get("client_id")), 240,
                   "the client's control page")
        client_id = _status(home)["client_id"]
        seen = on_control_page(tmp_path, home, ban_and_look)
    finally:
        code = client.stop()
    assert code == 3, client.output()[-3000:]
    assert seen["hidden"] is False, seen
    assert f"the coordinator has banned this client ({client_id})" in seen["reason"], seen
    assert "retrying will not help" in seen["reason"], seen
    # the operator's note comes with the ban, as one line of text: never markup, never a line of its own
    assert f"the operator's note: {NOTE_SHOWN}" in seen["reason"] and seen["markup"] == 0, seen
    assert seen["pill"].startswith("client stopped"), seen

    said = _client_status(home)
    assert f"client {client_id}: not running" in said, said
    assert "last stop: exit 3 (refused by the coordinator" in said, said
    assert f"error: the coordinator has banned this client ({client_id})" in said, said
    assert f"the operator's note: {NOTE_SHOWN}" in said and "\nerror: forged" not in said, said
