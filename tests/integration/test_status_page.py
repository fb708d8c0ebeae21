"""End to end: a running swarm (coordinator + 2 volunteer client processes on loopback) and a real headless
Chromium on its status page. The page must draw the reward/accuracy plot, the throughput plot and the
credit leaderboard, then update them as training proceeds — without a reload — and a screenshot is saved to
test-artifacts/. The same run checks that /metrics counters move and that `echo-swarm admin --run-dir` finds
the coordinator by itself."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from typer.testing import CliRunner

from echo_swarm.cli import app
from tests.integration.browser import Chromium, Page, open_page
from tests.integration.helpers import (
    ARTIFACTS,
    Proc,
    db_rows,
    start_client,
    start_coordinator,
    write_config,
)
from tests.integration.ops_helpers import scrape


async def wait_for(page: Page, expression: str, timeout: float, what: str) -> Any:
    """Poll a JavaScript expression until it is truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            state = await page.evaluate("JSON.stringify(window.echoSwarm)")
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; page state {state}")
        await asyncio.sleep(0.25)


CREDIT = "[...document.querySelectorAll('#leaderboard tbody tr')].reduce((a, r) => a + Number(r.dataset.credit), 0)"
POINTS = "Number(document.getElementById('reward-chart').dataset.points)"


async def watch_page(url: str, browser: Chromium, shot: Path) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        page = await open_page(session, browser)
        await page.send("Page.navigate", url=url + "/")
        await wait_for(page, "window.echoSwarm && window.echoSwarm.polls >= 1", 60, "the first status poll")
        await page.evaluate("window.__sameDocument = 'yes'")  # gone if the page reloads
        await wait_for(page, f"{POINTS} >= 1 && {CREDIT} > 0", 240, "a plotted step and a leaderboard entry")
        first = {"points": await page.evaluate(POINTS), "credit": await page.evaluate(CREDIT)}
        await wait_for(page, f"{POINTS} > {first['points']} && {CREDIT} > {first['credit']}", 240,
                       "the plot and the leaderboard to update")
        later = await page.evaluate(f"""({{
            points: {POINTS}, credit: {CREDIT}, same: window.__sameDocument,
            rows: document.querySelectorAll('#leaderboard tbody tr').length,
            teams: [...document.querySelectorAll('#teams tbody tr')].map((r) => [r.dataset.team,
                                                                                Number(r.dataset.credit)]),
            teamsEmpty: getComputedStyle(document.getElementById('teams-empty')).display,
            teamCells: [...document.querySelectorAll('#leaderboard tbody tr')].map((r) => r.cells[2].textContent),
            paths: document.querySelectorAll('#reward-chart svg path').length,
            evalDots: document.querySelectorAll('#reward-chart circle').length,
            throughput: Number(document.getElementById('throughput-chart').dataset.points),
            backends: document.getElementById('by-backend').textContent,
            versions: document.querySelectorAll('#versions tbody tr').length,
            version: document.getElementById('version').textContent,
            errors: window.echoSwarm.errors,
        }})""")
        charts = await page.evaluate(CHARTS)
        size = await page.screenshot(shot)

        # the per-volunteer page: found by name, then their standing, results and versions
        await page.send("Page.navigate", url=url + "/volunteer?q=vol-1")
        await wait_for(page, "window.echoVolunteer && window.echoVolunteer.shown", 60, "vol-1's page")
        volunteer = await page.evaluate("""({
            who: document.getElementById('who').textContent,
            facts: document.getElementById('facts').textContent,
            results: document.querySelectorAll('#results tbody tr').length,
            versions: Number(document.getElementById('by-version').dataset.points),
            xlabel: (document.querySelector('#by-version .axis-label.x') || {}).textContent,
            credit: document.querySelector('.credit-note').textContent,
            errors: window.echoVolunteer.errors,
        })""")
        await page.screenshot(shot.with_name("volunteer-page.png"))
        await page.send("Page.navigate", url=url + "/volunteer?q=no-such-volunteer")
        await wait_for(page, "window.echoVolunteer && window.echoVolunteer.searches >= 1", 60, "an empty search")
        nobody = await page.evaluate("document.getElementById('matches-empty').textContent")
        await page.ws.close()
    return {"first": first, "later": later, "screenshot_bytes": size, "charts": charts, "volunteer": volunteer,
            "nobody": nobody}


# both charts' axes: labels, and tick labels that never repeat (the throughput axis once read "3m" twice)
CHARTS = """(() => {
    const axis = (id) => ({
        xlabel: (document.querySelector(`#${id} .axis-label.x`) || {}).textContent,
        ylabel: (document.querySelector(`#${id} .axis-label.y`) || {}).textContent,
        xticks: [...document.querySelectorAll(`#${id} .tick.x`)].map((t) => t.textContent),
        yticks: [...document.querySelectorAll(`#${id} .tick.y`)].map((t) => t.textContent),
    });
    return {reward: axis('reward-chart'), throughput: axis('throughput-chart'),
            credit: document.getElementById('credit-note').textContent,
            link: (document.querySelector('#leaderboard tbody a') || {}).href};
})()"""


@pytest.mark.slow
def test_status_page_updates_live_in_a_real_browser(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir,
                          learner={"max_steps": 60, "eval_every": 2, "eval_size": 32})
    coord, url = start_coordinator(config, tmp_path / "coordinator.log")
    procs: list[Proc] = [coord]
    browser: Chromium | None = None
    try:
        with urllib.request.urlopen(url + "/", timeout=10) as resp:
            html = resp.read().decode()
        assert "/static/status.js" in html and "cdn" not in html.lower()
        metrics_before = scrape(url)
        for k in range(2):
            procs.append(start_client(url, tmp_path / f"client{k}", tmp_path / f"client{k}.log", "--name", f"vol-{k}",
                                      "--team", "Team Ω"))  # both count for one team
        browser = Chromium(tmp_path / "chromium-profile", tmp_path / "chromium.log")
        shot = ARTIFACTS / "status-page.png"
        seen = asyncio.run(watch_page(url, browser, shot))
        later = seen["later"]
        assert later["same"] == "yes", "the page reloaded instead of updating in place"
        assert later["points"] > seen["first"]["points"] and later["credit"] > seen["first"]["credit"]
        assert later["rows"] == 2 and later["paths"] >= 1 and later["evalDots"] >= 1
        assert later["throughput"] >= 1 and ("torch" in later["backends"] or "llama" in later["backends"]) and later["versions"] >= 2
        assert later["errors"] == 0
        # the team leaderboard: one team of both volunteers, its credit theirs added up (the page's own figures)
        assert [name for name, _ in later["teams"]] == ["Team Ω"] and later["teamsEmpty"] == "none"
        assert later["teamCells"] == ["Team Ω", "Team Ω"]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and seen["screenshot_bytes"] > 20_000

        charts = seen["charts"]
        assert charts["reward"]["xlabel"] == "learner step (policy version)"
        assert charts["reward"]["ylabel"] == "reward / accuracy"
        assert charts["throughput"]["xlabel"] == "time since the run started"
        assert charts["throughput"]["ylabel"] == "tokens per second"
        for name, axis in charts.items():
            if name in ("reward", "throughput"):
                for ticks in (axis["xticks"], axis["yticks"]):
                    assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), f"{name} ticks repeat: {ticks}"
        assert "one unit per generated token" in " ".join(charts["credit"].split()) and "/volunteer?id=" in charts["link"]
        volunteer = seen["volunteer"]
        assert volunteer["who"].startswith("vol-1 — rank ") and "results accepted:" in volunteer["facts"]
        assert volunteer["results"] >= 1 and volunteer["versions"] >= 1 and volunteer["errors"] == 0
        assert volunteer["xlabel"] == "policy version" and "verified and accepted" in " ".join(volunteer["credit"].split())
        assert "No volunteer matches" in seen["nobody"]
        found = json.loads(urllib.request.urlopen(url + "/v1/volunteers?q=VOL-", timeout=30).read())
        assert {v["name"] for v in found["volunteers"]} == {"vol-0", "vol-1"}  # any case, by name
        one = found["volunteers"][0]
        mine = json.loads(urllib.request.urlopen(f"{url}/v1/volunteers/{one['client_id']}", timeout=30).read())
        assert mine["accepted"] >= len(mine["results"]) >= 1 and mine["rank"] in (1, 2)
        assert {r["job_id"] for r in mine["results"]} <= {r[0] for r in db_rows(
            run_dir, "SELECT job_id FROM results WHERE client_id = ?", (one["client_id"],))}
        by_prefix = json.loads(urllib.request.urlopen(f"{url}/v1/volunteers?q={one['client_id'][:6]}",
                                                      timeout=30).read())
        assert one["client_id"] in {v["client_id"] for v in by_prefix["volunteers"]}

        full, page = (json.loads(urllib.request.urlopen(url + q, timeout=30).read())
                      for q in ("/v1/status", "/v1/status?view=page"))
        old_keys = {"run_id", "version", "max_steps", "finished", "sync_mode", "max_staleness", "task", "uptime_s",
                    "learner", "jobs", "totals", "reward_curve", "steps", "evals", "clients"}
        new_keys = {"server_time", "issuing_paused", "throughput", "clients_summary", "leaderboard", "teams",
                    "recent_versions"}
        assert old_keys | new_keys <= set(full) and "in_flight" in full["jobs"]  # backward compatible
        assert new_keys <= set(page) and "clients" not in page and "steps" not in page
        assert [r["credit"] for r in page["leaderboard"]] == sorted((r["credit"] for r in page["leaderboard"]),
                                                                    reverse=True)
        # the team's figures are its members' added up (one reply: both read by the API process that writes results)
        (team,) = page["teams"]
        board = page["leaderboard"]
        assert (team["rank"], team["team"], team["members"]) == (1, "Team Ω", 2) and {r["team"] for r in board} == {"Team Ω"}
        assert (team["accepted"], team["credit"]) == (sum(r["accepted"] for r in board), sum(r["credit"] for r in board))

        metrics_after = scrape(url)
        key = ("echo_swarm_jobs_leased_total", ())
        assert metrics_after[key] > metrics_before[key]
        assert metrics_after[("echo_swarm_results_accepted_total", ())] > 0
        assert metrics_after[("echo_swarm_learner_step_seconds_count", ())] >= 2

        # the operator CLI finds the URL (endpoint.json) and key (admin.key) from the run directory alone
        result = CliRunner().invoke(app, ["admin", "--run-dir", str(run_dir), "status", "--json"])
        assert result.exit_code == 0, result.output
        status = json.loads(result.output)
        assert status["version"] >= 2 and status["clients"]["total"] == 2
    finally:
        if browser is not None:
            browser.stop()
        for p in reversed(procs):
            p.stop()


@pytest.mark.slow
def test_each_rewards_mean_is_drawn_live(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A task that combines two rewards: the page draws each one's mean beside the total, and redraws it as steps
    arrive (a co-located run: the learner's own rollouts, no clients needed)."""
    from echo_swarm.demo_tasks import DEMO_DATA

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "colocated"},
                          learner={"max_steps": 500},  # still stepping when the page looks; stopped after
                          task={"type": "dataset", "train_path": str(DEMO_DATA / "sums.jsonl"),
                                "prompt_column": "question", "prompt_template": "Q: {prompt}= A:", "heldout_size": 32})
    with config.open("a") as f:
        f.write('\n[[task.rewards]]\nname = "last_number"\n\n[[task.rewards]]\nname = "regex"\npattern = "^ [0-9]+$"\n'
                "weight = 0.5\n")
    coord, url = start_coordinator(config, tmp_path / "coordinator.log")
    browser = Chromium(tmp_path / "chromium-profile", tmp_path / "chromium.log")

    async def watch() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            page = await open_page(session, browser)
            await page.send("Page.navigate", url=url + "/")
            await wait_for(page, "window.echoSwarm && window.echoSwarm.polls >= 1", 60, "the first status poll")
            series = "Number(document.getElementById('reward-means').dataset.series)"
            await wait_for(page, f"{series} === 2 && {POINTS} >= 1", 240, "the per-reward means")
            first = await page.evaluate(POINTS)
            await wait_for(page, f"{POINTS} > {first}", 240, "the chart to update")
            seen = await page.evaluate("""({
                legend: document.getElementById('reward-means').textContent,
                lines: document.querySelectorAll('#reward-chart path.reward-mean').length,
                errors: window.echoSwarm.errors })""")
            await page.ws.close()
        return dict(seen)

    try:
        seen = asyncio.run(watch())
    finally:
        browser.stop()
        coord.stop()
    assert "last_number (mean)" in seen["legend"] and "regex (mean)" in seen["legend"]
    assert seen["lines"] == 2 and seen["errors"] == 0
