"""The coordinator's notices (issue 34) end to end: an operator publishes them with `echo-swarm admin notice`, a
real client fetches the signed board at join and shows each notice on its terminal (a real pseudo-terminal read
back on a VT100 screen), in `echo-swarm client status`, on its control page (a real headless Chromium) and as a
desktop notification (a `notify-send` on PATH that records what it was given); bad input to the admin command is
one line, exit 2, and nothing is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.api.admin_keys import ADMIN_KEY_FILE
from coordinator.run.notices import NOTICES_KEY
from shared.exit_codes import ExitCode
from swarm_client.control import read_status
from swarm_client.webcontrol import PAGE_FILE
from tests.integration.browser import Page, on_control_page
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import ARTIFACTS, REPO, Proc, db_rows, wait_until
from tests.integration.test_status_page import wait_for
from tests.integration.test_stop_reasons import COLUMNS, ROWS, Shown

pytestmark = pytest.mark.slow

# what an operator might write: markup-like text must reach the volunteer as written, never as markup
NEWS = "The next run starts Monday 09:00 UTC [bold]thanks[/bold] <b>all</b>"


@pytest.fixture()
def live_coordinator(tmp_path: Path, tiny_model_dir: Path) -> Iterator[LiveCoordinator]:
    """A run that does not finish while these tests look (the learner announces a finished run with a notice of
    its own: coordinator.run.notices.announce_finished): the board holds the operator's notices only."""
    with running_coordinator(tmp_path, tiny_model_dir, learner={"max_steps": 100_000}) as live:
        yield live


def _echo_swarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echo_swarm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def _admin(live: LiveCoordinator, *args: str) -> subprocess.CompletedProcess[str]:
    return _echo_swarm("admin", "--url", live.url, "--key", str(live.run_dir / ADMIN_KEY_FILE), *args)


def _publish(live: LiveCoordinator) -> None:
    for args in (["notice", NEWS, "--run"], ["notice", "Please update: this run needs a newer client",
                                             "--min-version", "999.0"]):
        res = _admin(live, *args)
        assert res.returncode == 0 and res.stdout.startswith("published notice "), res.stderr


def _status(home: Path) -> dict[str, Any]:
    return read_status(home) or {}


def _recording_notify_send(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `notify-send` first on PATH that appends its arguments to a file, and a desktop session's variable."""
    bin_dir, record = tmp_path / "bin", tmp_path / "notified.jsonl"
    bin_dir.mkdir()
    script = bin_dir / "notify-send"
    script.write_text(f"#!{sys.executable}\nimport json, sys\n"
                      f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DISPLAY": ":99"}, record


def test_bad_notices_are_one_line_exit_2_and_nothing_is_written(live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator

    def state() -> tuple[object, ...]:
        log = live.run_dir / "admin.log"
        return (db_rows(live.run_dir, "SELECT value FROM meta WHERE key=?", (NOTICES_KEY,)),
                log.exists() and log.read_bytes())

    before = state()
    cases = [
        (["notice", ""], "text '' does not fit: a notice is one line of 1 to 500 printable characters"),
        (["notice", "x" * 501], "text does not fit: a notice is one line of 1 to 500 printable characters"),
        (["notice", "line one\nline two"], "text does not fit: a notice is one line of 1 to 500 printable characters"),
        (["notice", "bell \x07"], "text 'bell \\x07' does not fit: a notice is one line of 1 to 500 printable "
                                  "characters"),
        (["notice", "update", "--min-version", "1.x"], "min client version '1.x' does not fit: a release number "
                                                       "such as 0.4 or 1.2.3, as `echo-swarm --version` prints it"),
        (["notice", "both", "--run", "--min-version", "1.0"], "a notice is about runs (--run) or asks for a release "
                                                              "(--min-version), not both"),
        (["notice"], "give the notice's text (or --withdraw ID)"),
        (["notice", "text", "--withdraw", "1"], "--withdraw takes no text, --run or --min-version"),
    ]
    for args, line in cases:
        res = _admin(live, *args)
        assert (res.returncode, res.stderr, res.stdout) == (ExitCode.USAGE, f"error: {line}\n", ""), args
    assert state() == before
    # withdrawing a notice that is not there is the coordinator's refusal: exit 1, one line, nothing written
    res = _admin(live, "notice", "--withdraw", "7")
    assert res.returncode == ExitCode.FAILED and res.stderr.count("\n") == 1 and "no notice 7" in res.stderr, res
    assert state() == before
    # and a good one is published, listed, and withdrawn
    assert _admin(live, "notice", "hello").stdout == "published notice 1 (operator); 1 in force\n"
    listed = json.loads(_admin(live, "notices", "--json").stdout)
    assert [(n["notice_id"], n["kind"], n["text"]) for n in listed] == [(1, "operator", "hello")]
    assert _admin(live, "notice", "--withdraw", "1").stdout == "withdrew notice 1; 0 in force\n"


def test_a_notice_is_read_on_the_terminal_in_client_status_and_as_a_desktop_notification(
        tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    from tests.terminal import run_on_terminal, terminal_env

    live = live_coordinator
    _publish(live)
    home = tmp_path / "client"
    env, record = _recording_notify_send(tmp_path)
    argv = [sys.executable, "-m", "echo_swarm", "join", live.url, "--home", str(home), "--threads", "1",
            "--backend", "torch", "--no-benchmark", "--no-control-page"]
    shown_bytes = run_on_terminal(argv, columns=COLUMNS, rows=ROWS, timeout_s=300, env=terminal_env(**env),
                                  until=lambda _: len(_status(home).get("notices", [])) == 2,
                                  then=lambda proc: proc.send_signal(signal.SIGINT))
    shown = Shown(shown_bytes.raw)
    (tmp_path / "screen.txt").write_text(str(shown))  # what the volunteer saw, for a failure's reader
    (tmp_path / "screen.raw").write_bytes(shown_bytes.raw)
    assert shown_bytes.returncode == 0, shown
    news = shown.row("notice from the coordinator about runs:")
    assert f"notice from the coordinator about runs: {NEWS}" in shown.words, shown  # as written, never markup
    update = shown.row("notice from the coordinator: Please update")
    assert "needs echo-swarm 999.0 or newer; this client is" in shown.words and "please update (pip install -U " \
        "echo-swarm)" in shown.words, shown
    panel = shown.last_panel_row()
    assert news < panel and update < panel, shown  # above the final panel, not wiped by it
    in_panel = " ".join(" ".join(shown.lines[panel:]).split())
    assert "│ notice Please update: this run needs a newer client" in in_panel and "(+1 more: `echo-swarm client " \
        "status`)" in in_panel, shown  # the panel's row: the newest notice

    said = _echo_swarm("client", "status", "--home", str(home)).stdout
    assert f"notice from the coordinator about runs: {NEWS}" in said and "needs echo-swarm 999.0" in said, said
    # one notification each (notify-send runs detached: they may land in either order, and after the client exits)
    wait_until(lambda: record.exists() and len(record.read_text().splitlines()) >= 2, 60, "two notifications")
    notified = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(notified) == 2 and all(n[:2] == ["--app-name=echo-swarm", "echo-swarm"] for n in notified), notified
    texts = sorted(n[-1] for n in notified)
    assert texts[0] == f"notice from the coordinator about runs: {NEWS}", texts
    assert texts[1].startswith("notice from the coordinator: Please update: this run needs a newer client"), texts

    # a restart shows them in the panel and the status, but neither prints nor notifies them again
    again = run_on_terminal(argv, columns=COLUMNS, rows=ROWS, timeout_s=300, env=terminal_env(**env),
                            until=lambda _: _status(home).get("state") not in (None, "stopped", "starting")
                            and len(_status(home).get("notices", [])) == 2,
                            then=lambda proc: proc.send_signal(signal.SIGINT))
    assert again.returncode == 0
    assert "notice from the coordinator about runs:" not in Shown(again.raw).words
    assert len(record.read_text().splitlines()) == 2


def test_a_notice_is_on_the_control_page(tmp_path: Path, live_coordinator: LiveCoordinator) -> None:
    live = live_coordinator
    _publish(live)
    home = tmp_path / "client"
    client = Proc([sys.executable, "-m", "echo_swarm", "join", live.url, "--home", str(home), "--threads", "1",
                   "--backend", "torch", "--no-benchmark", "--no-panel"], tmp_path / "client.log")

    async def look(page: Page) -> dict[str, Any]:
        await wait_for(page, "document.querySelectorAll('#notice-list li').length === 2", 60, "the notices on the page")
        await page.screenshot(ARTIFACTS / "control-page-notices.png")
        return dict(await page.evaluate("""({hidden: document.getElementById('notices').hidden,
            items: [...document.querySelectorAll('#notice-list li')].map(li => li.textContent),
            markup: document.querySelectorAll('#notices b').length})"""))

    try:
        wait_until(lambda: (home / PAGE_FILE).exists() and len(_status(home).get("notices", [])) == 2, 240,
                   "the client's page and its notices")
        seen = on_control_page(tmp_path, home, look)
    finally:
        code = client.stop()
    assert code == 0, client.output()[-3000:]
    assert seen["hidden"] is False and seen["markup"] == 0, seen
    assert "Please update" in seen["items"][0] and "999.0" in seen["items"][0], seen  # newest first
    assert seen["items"][1].endswith(f"about runs: {NEWS}"), seen
