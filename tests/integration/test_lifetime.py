"""A volunteer's lifetime statistics (issue 34), with real processes: a client that works for one run, is
restarted, then joins the operator's next run keeps its credit and results per run and in total
(``lifetime.json``, swarm_client/lifetime.py) — each run's figures exactly what that run's coordinator holds for it,
nothing counted twice by the restart — and `echo-swarm client status` says so. Its team is on the run's status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarm_client.control import read_status
from swarm_client.lifetime import FILE
from tests.integration.helpers import (
    REPO,
    Proc,
    db_rows,
    get_status,
    start_client,
    start_coordinator,
    write_config,
)

pytestmark = pytest.mark.slow


def _work(url: str, home: Path, log: Path, jobs: int) -> None:
    """One client session that ends by itself after ``jobs`` accepted results."""
    client = start_client(url, home, log, "--no-panel", "--no-benchmark", "--no-control-page", "--max-jobs",
                          str(jobs), "--name", "ada", "--team", "Night Owls")
    try:
        assert client.proc.wait(300) == 0, client.output()[-3000:]
    finally:
        client.stop()


def _held(run_dir: Path, client_id: str) -> tuple[int, float]:
    """What the run's coordinator holds for this client: (accepted, credit)."""
    (row,) = db_rows(run_dir, "SELECT accepted, credit FROM clients WHERE client_id = ?", (client_id,))
    return int(row[0]), float(row[1])


def test_credit_history_survives_a_restart_and_a_new_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    home = tmp_path / "client"
    procs: list[Proc] = []
    try:
        runs = []
        for name, sessions in (("a", (2, 1)), ("b", (2,))):  # run a: two sessions (a restart); then run b
            run_dir = tmp_path / f"run-{name}"
            coord, url = start_coordinator(write_config(tmp_path / f"{name}.toml", run_dir, tiny_model_dir,
                                                        learner={"max_steps": 500}), tmp_path / f"coord-{name}.log")
            procs.append(coord)
            for k, jobs in enumerate(sessions):
                _work(url, home, tmp_path / f"client-{name}{k}.log", jobs)
            status = get_status(url)
            assert status is not None
            if name == "a":  # the team on the run's status: the volunteer's figures, under its team's name
                (team,) = status["teams"]
                assert (team["team"], team["members"], team["accepted"]) == ("Night Owls", 1, 3)
            coord.stop()
            runs.append((url, status["run_id"], run_dir))

        client_id = read_status(home)["client_id"]
        ledger = json.loads((home / FILE).read_text())["runs"]
        held = {run_id: _held(run_dir, client_id) for _, run_id, run_dir in runs}
        assert held[runs[0][1]][0] == 3 and held[runs[1][1]][0] == 2  # the sessions' --max-jobs, as the store says
        assert {e["run_id"]: (e["accepted"], e["credit"]) for e in ledger.values()} == held
        assert {e["run_id"]: e["url"] for e in ledger.values()} == {run_id: url for url, run_id, _ in runs}

        shown = subprocess.run([sys.executable, "-m", "echo_swarm", "client", "status", "--home", str(home)],
                               capture_output=True, text=True, timeout=60, cwd=REPO)
        assert shown.returncode == 0, shown.stderr
        total = sum(credit for _, credit in held.values())
        assert f"lifetime: {total:,.0f} credit, 5 results accepted over 2 runs since " in shown.stdout, shown.stdout
        for url, run_id, _ in runs:
            accepted, credit = held[run_id]
            assert f"run {run_id} at {url}: {accepted} accepted, 0 refused, credit {credit:,.0f}" in shown.stdout
    finally:
        for p in reversed(procs):
            p.stop()
