"""One volunteer, two coordinators (issue 34), with real processes: `join URL_A --share 3 --attach URL_B=1` works
for both runs from one process, each run with its own identity, and the machine's generation is handed between them
by resource share (swarm_client/shares.py) — so over 100+ jobs of one size the results reach the two runs 3:1,
within ±15 %, counted in each run's own database. The control page lists both runs (a Chromium screenshot for
docs/client.md) and `client status` says each run's share; Ctrl-C stops both, exit 0."""

from __future__ import annotations

import asyncio
import json
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
