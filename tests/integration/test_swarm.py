"""The whole system as separate OS processes on 127.0.0.1: a coordinator and `echo-swarm join` clients.

Covers: a run to completion with every client contributing; a client killed (SIGKILL) mid-job whose job is
reissued and completed by another client; a coordinator killed (SIGKILL) and restarted, losing no accepted
result and resuming at the same policy version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    start_client,
    start_coordinator,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow


def _stop_all(*procs: Proc) -> None:
    for p in procs:
        p.stop()


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
        _stop_all(*clients, coord)
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


def test_killed_client_job_is_reissued_and_completed_by_another(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    coord, url = start_coordinator(
        write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, learner={"max_steps": 2},
                     jobs={"lease_timeout_s": 4.0, "prompts_per_job": 4}, sampling={"max_tokens": 8}),
        tmp_path / "coord.log")
    # a throttled client (2 % duty cycle) takes seconds per job, so it is reliably killed mid-job
    slow = start_client(url, tmp_path / "slow", tmp_path / "slow.log", "--max-cpu-percent", "2")
    fast: Proc | None = None
    try:
        held = wait_until(lambda: (s := get_status(url)) and s["jobs"]["in_flight"], 120, "the slow client to lease")
        victim_job, victim_id = held[0]["job_id"], held[0]["client_id"]
        slow.kill9()
        assert db_rows(run_dir, "SELECT COUNT(*) FROM results WHERE job_id=?", (victim_job,)) == [(0,)]
        fast = start_client(url, tmp_path / "fast", tmp_path / "fast.log", "--exit-when-finished")
        wait_until(lambda: (s := get_status(url)) and s["finished"], 180, "the run to finish after the kill")
        assert fast.proc.wait(60) == 0
    finally:
        _stop_all(*(p for p in (fast, slow, coord) if p is not None))
    (holder, issues), = db_rows(run_dir, "SELECT r.client_id, j.issue_count FROM results r JOIN jobs j USING(job_id) "
                                         "WHERE job_id=?", (victim_job,))
    assert holder != victim_id and issues >= 2
    assert db_rows(run_dir, "SELECT COUNT(*) FROM results WHERE client_id=?", (victim_id,)) == [(0,)]


def test_coordinator_killed_and_restarted_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, learner={"max_steps": 8})
    coord, url = start_coordinator(cfg, tmp_path / "coord1.log")
    port = int(url.rsplit(":", 1)[1])
    client = start_client(url, tmp_path / "c", tmp_path / "c.log", "--exit-when-finished")
    coord2: Proc | None = None
    try:
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 3 and s["totals"]["accepted"] >= 7, 180,
                   "a few versions and accepted results")
        coord.kill9()
        accepted = set(db_rows(run_dir, "SELECT job_id, client_id, content_sha256 FROM results"))
        (version,), = db_rows(run_dir, "SELECT MAX(version) FROM versions")
        assert accepted and version >= 3
        write_config(cfg, run_dir, tiny_model_dir, port=port, learner={"max_steps": 8})
        coord2, url2 = start_coordinator(cfg, tmp_path / "coord2.log")
        assert url2 == url
        first = get_status(url)
        assert first is not None and first["version"] == version  # resumed at the same policy version
        final = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 240,
                           "the resumed run to finish (the client reconnects by itself)")
        assert client.proc.wait(60) == 0, client.output()[-2000:]
    finally:
        _stop_all(*(p for p in (client, coord2, coord) if p is not None))
    assert final["version"] == 8
    after = set(db_rows(run_dir, "SELECT job_id, client_id, content_sha256 FROM results"))
    assert accepted <= after  # every result acknowledged before the kill is still there
    ingested = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results GROUP BY ingested_step ORDER BY 1")
    assert ingested == [(step, 2) for step in range(1, 9)]  # each exactly once
    assert "resumed at version" in (tmp_path / "coord2.log").read_text()
