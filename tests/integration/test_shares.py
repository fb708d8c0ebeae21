"""One volunteer, two coordinators (issue 34), with real processes: `join URL_A --share 3 --attach URL_B=1` works
for both runs from one process, each run with its own identity, and the machine's generation is handed between them
by resource share (swarm_client/shares.py) — so over 100+ jobs of one size the results reach the two runs 3:1,
within ±15 %, counted in each run's own database. The control page lists both runs (a Chromium screenshot for
docs/client.md) and `client status` says each run's share; Ctrl-C stops both, exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from swarm_client.control import read_status
from swarm_client.identity import load_identity
from swarm_client.multirun import attached_home
from tests.integration.browser import Chromium, open_control_page
from tests.integration.helpers import (
    ARTIFACTS,
    REPO,
    Proc,
    db_rows,
    start_client,
    start_coordinator,
    wait_until,
    write_config,
)
from tests.integration.test_status_page import wait_for

pytestmark = pytest.mark.slow
JOBS = 104  # the issue's ≥ 100
RATIO, TOLERANCE = 3.0, 0.15


def _results(run_dir: Path) -> int:
    return int(db_rows(run_dir, "SELECT COUNT(*) FROM results")[0][0])


def test_two_coordinators_get_results_in_the_ratio_of_their_shares(tmp_path: Path, tiny_model_dir: Path) -> None:
    procs: list[Proc] = []
    runs, urls = [tmp_path / "run-a", tmp_path / "run-b"], []
    browser: Chromium | None = None
    try:
        for run_dir in runs:  # work for the taking all along: async push-pull, one client can never keep up
            config = write_config(tmp_path / f"{run_dir.name}.toml", run_dir, tiny_model_dir,
                                  top={"sync_mode": "async-push-pull", "max_staleness": 4},
                                  learner={"max_steps": 100_000}, snapshots={"keep_last": 6})
            coord, url = start_coordinator(config, tmp_path / f"coord-{run_dir.name}.log")
            procs.append(coord)
            urls.append(url)
        home = tmp_path / "client"
        client = start_client(urls[0], home, tmp_path / "client.log", "--no-benchmark", "--share", "3",
                              "--attach", f"{urls[1]}=1")
        procs.append(client)
        wait_until(lambda: sum(_results(r) for r in runs) >= JOBS, 480, f"{JOBS} results over both runs")

        browser = Chromium(tmp_path / "chromium-profile", tmp_path / "chromium.log")

        async def look() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                page, _ = await open_control_page(session, browser, home)
                await wait_for(page, "document.querySelectorAll('#share-runs tbody tr').length === 2", 60,
                               "both runs on the control page")
                await page.screenshot(ARTIFACTS / "control-page-shares.png")
                seen = await page.evaluate("""({hidden: document.getElementById('shares').hidden,
                    urls: [...document.querySelectorAll('#share-runs tbody tr')].map((r) => r.dataset.url)})""")
                await page.ws.close()
                return dict(seen)

        seen = asyncio.run(look())
        assert client.stop() == 0, client.output()[-3000:]
        assert seen == {"hidden": False, "urls": urls}
        a, b = (_results(r) for r in runs)
        print(json.dumps({"results": [a, b], "runs": (read_status(home) or {}).get("runs")}))
        assert a + b >= JOBS and abs(a / b / RATIO - 1) <= TOLERANCE, (a, b)

        # each run its own identity: URL_A's in the home as ever, URL_B's under attached/
        ids = [load_identity(home).client_id, load_identity(attached_home(home, urls[1])).client_id]
        assert ids[0] != ids[1]
        for run_dir, client_id in zip(runs, ids, strict=True):
            assert {r[0] for r in db_rows(run_dir, "SELECT DISTINCT client_id FROM results")} == {client_id}
        status = read_status(home) or {}
        assert [(r["url"], r["share"]) for r in status["runs"]] == [(urls[0], 3.0), (urls[1], 1.0)]
        shown = subprocess.run([sys.executable, "-m", "echo_swarm", "client", "status", "--home", str(home)],
                               capture_output=True, text=True, timeout=60, cwd=REPO)
        assert f"run at {urls[0]}: share 3 (" in shown.stdout and f"run at {urls[1]}: share 1 (" in shown.stdout
        log = (tmp_path / "client.log").read_text()
        assert f"[{urls[1]}] joined run " in log and f"[{urls[0]}] joined run " in log
        # one model in memory at a time: each switch of the machine frees the other run's (shares.py)
        diagnostics = (home / "logs" / "client.log").read_text()
        assert f"unloaded {urls[1]}'s model: {urls[0]} has the machine" in diagnostics
        assert f"unloaded {urls[0]}'s model: {urls[1]} has the machine" in diagnostics

    finally:
        if browser is not None:
            browser.stop()
        for p in reversed(procs):
            p.stop()


def test_one_panel_on_the_terminal_lists_both_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`join A --attach B=1` on a terminal (a real pseudo-terminal, read back on a VT100 screen): one live panel,
    A's, with a row per run — each coordinator, its share, its results — and every run's lines tagged with its
    coordinator above it; no plain status line of the attached run beside the panel (it would be erased by the next
    redraw). Ctrl-C stops both runs, exit 0."""
    from tests.integration.conftest import running_coordinator
    from tests.integration.test_stop_reasons import Shown, _join_argv
    from tests.terminal import run_on_terminal

    home = tmp_path / "client"

    def both_accepted(_: bytes) -> bool:
        runs = (read_status(home) or {}).get("runs") or []
        return len(runs) == 2 and all(int(r.get("accepted", 0)) >= 1 for r in runs)

    with contextlib.ExitStack() as stack:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
        a, b = (stack.enter_context(running_coordinator(tmp_path / name, tiny_model_dir)) for name in ("a", "b"))
        argv = _join_argv(a.url, home, "--share", "3", "--attach", f"{b.url}=1")
        shown_bytes = run_on_terminal(argv, columns=140, rows=200, timeout_s=400, until=both_accepted,
                                      then=lambda proc: proc.send_signal(signal.SIGINT))
    shown = Shown(shown_bytes.raw, columns=140, rows=200)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "terminal-shares.txt").write_text(str(shown).rstrip() + "\n")  # for docs/client.md
    assert shown_bytes.returncode == 0, shown
    panel = shown.lines[shown.row("╭"):]  # the final panel, drawn last
    head = next(i for i, line in enumerate(panel) if "coordinator" in line and "work so far" in line)
    row_a = next(line for line in panel[head:] if a.url in line)
    row_b = next(line for line in panel[head:] if b.url in line)
    for row, share in ((row_a, "3"), (row_b, "1")):
        cells = row.strip("│ ").split()
        assert cells[1] == share and cells[-4] != "0" and cells[-3] == "/", row  # share; accepted ≥ 1 / rejected
    above = shown.lines[:shown.row("╭")]
    assert any(line.startswith(f"[{b.url}] joined run") for line in above), shown
    assert any(line.startswith(f"[{a.url}] joined run") for line in above), shown
    assert not any(line.startswith("[echo-swarm ") for line in shown.lines), shown  # no plain status lines
