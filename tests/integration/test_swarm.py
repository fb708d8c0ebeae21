"""The whole system as separate OS processes on 127.0.0.1: a coordinator and `echo-swarm join` clients.

Covers a run to completion with every client contributing. The crash tests (kill -9 of a client or of the
coordinator) live in tests/faults/test_crashes.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import (
    db_rows,
    get_status,
    start_client,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow


def test_run_completes_with_every_client_contributing(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    coord, url = start_coordinator(write_config(tmp_path / "run.toml", run_dir, tiny_model_dir,
                                                learner={"max_steps": 6}), tmp_path / "coord.log")
    clients = [start_client(url, tmp_path / f"c{k}", tmp_path / f"c{k}.log", "--exit-when-finished")
               for k in range(2)]
    try:
        status: dict[str, Any] = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 240,
                                            "the run to finish")
        for c in clients:
            assert c.proc.wait(60) == 0, c.output()[-2000:]
    finally:
        stop_all(*clients, coord)
    assert coord.proc.returncode == 0, coord.output()[-3000:]
    assert status["version"] == 6
    per_client = {c["client_id"]: c["accepted"] for c in status["clients"]}
    assert len(per_client) == 2 and all(n > 0 for n in per_client.values()), per_client
    # 2 jobs per step × 6 steps, each ingested by exactly one learner step
    rows = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results GROUP BY ingested_step ORDER BY 1")
    assert rows == [(step, 2) for step in range(1, 7)]
    # sequential pull: every trained batch holds rollouts of exactly one version, the one it updated
    mixed = db_rows(run_dir, "SELECT ingested_step, COUNT(DISTINCT version), MIN(version) FROM results "
                    "WHERE ingested_step IS NOT NULL GROUP BY ingested_step ORDER BY 1")
    assert mixed == [(step, 1, step - 1) for step in range(1, 7)]
    assert "joined run" in clients[0].output() and "stopped:" in clients[0].output()
    # every role process kept its own log in the run directory, as it printed it (issue 34: the operator's record)
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert {"supervisor.log", "api.log", "learner.log", "verifier0.log"} <= set(logs), sorted(logs)
    assert "registered client" in logs["api.log"] and logs["learner.log"], logs["api.log"][-2000:]
    assert all(line.split(" ", 3)[2] in ("INFO", "WARNING", "ERROR", "CRITICAL") or line.startswith("  | ")
               for text in logs.values() for line in text.splitlines()), "a line that is not one record"
