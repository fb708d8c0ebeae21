"""The process layout under faults (issue 12): `echo-swarm coordinator` runs the API, the learner and a verifier as
separate processes; each is killed with SIGKILL mid-work while two real clients keep the run going.

What must hold: the supervisor restarts the killed role, the run completes, nothing accepted is lost (every result a
client was told was accepted is in the store), nothing is trained twice (each step ingests its own batch), and the
process that listens for HTTP never has torch loaded.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from swarm_client.identity import load_identity
from tests.integration.helpers import (
    db_rows,
    get_status,
    process_alive,
    start_client,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

STEPS = 9


def _roles(url: str) -> dict[str, Any]:
    status = get_status(url)
    return status["roles"] if status else {}


def _pid(url: str, role: str) -> int | None:
    pid = _roles(url).get(role, {}).get("pid")
    return int(pid) if pid else None


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _restarted(url: str, role: str, old: int) -> int | bool:
    pid = _pid(url, role)
    return pid if pid is not None and pid != old and process_alive(pid) else False


def test_each_role_killed_mid_work_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"layout": "processes"},
                       learner={"max_steps": STEPS, "checkpoint_every_steps": 3},
                       verification={"claim_s": 20.0})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    clients = [start_client(url, tmp_path / f"c{k}", tmp_path / f"c{k}.log", "--exit-when-finished")
               for k in range(2)]
    try:
        roles = wait_until(lambda: (r := _roles(url)) and all(r.get(n, {}).get("pid") for n in
                                                               ("api", "learner", "verifier-0")) and r, 120,
                           "every role to report its pid")
        api_pid = int(roles["api"]["pid"])
        assert api_pid != coord.pid  # the supervisor is not the API: roles are processes of their own

        # 1. the learner, in the middle of a step (it has results in training)
        wait_until(lambda: (r := _roles(url).get("learner", {})) and r.get("in_training") and r["version"] >= 1,
                   180, "the learner mid-step")
        assert "libtorch" not in _maps(api_pid)  # while the learner trains, the API has no torch loaded
        learner_pid = int(_roles(url)["learner"]["pid"])
        assert "libtorch" in _maps(learner_pid)  # (the check can fail: the learner's maps do show it)
        os.kill(learner_pid, signal.SIGKILL)
        wait_until(lambda: _restarted(url, "learner", learner_pid), 120, "a new learner process")
        v1 = get_status(url)["version"]  # type: ignore[index]
        wait_until(lambda: (s := get_status(url)) and s["version"] > v1, 180, "a step after the learner's restart")

        # 2. a verifier, holding claimed requests if it can be caught so
        verifier_pid = int(_roles(url)["verifier-0"]["pid"])
        wait_until(lambda: db_rows(run_dir, "SELECT COUNT(*) FROM work WHERE state='claimed'")[0][0] > 0, 60,
                   "the verifier to hold a claim", interval=0.02)
        os.kill(verifier_pid, signal.SIGKILL)
        wait_until(lambda: _restarted(url, "verifier-0", verifier_pid), 120, "a new verifier process")
        v2 = get_status(url)["version"]  # type: ignore[index]
        wait_until(lambda: (s := get_status(url)) and s["version"] > v2, 180, "a step after the verifier's restart")

        # 3. the API, while clients talk to it
        os.kill(api_pid, signal.SIGKILL)
        new_api = wait_until(lambda: _restarted(url, "api", api_pid), 120, "a new API process on the same port")
        assert "libtorch" not in _maps(int(new_api))
        final = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 400, "the run to finish")
        for c in clients:
            assert c.proc.wait(120) == 0, c.output()[-3000:]
    finally:
        stop_all(*clients, coord)
    assert coord.proc.returncode == 0, coord.output()[-3000:]
    assert final["version"] == STEPS
    # nothing trained twice: every step ingested its own batch of 2 results, each result at most once
    per_step = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results WHERE ingested_step IS NOT NULL "
                                "GROUP BY ingested_step ORDER BY 1")
    assert per_step == [(step, 2) for step in range(1, STEPS + 1)]
    # nothing accepted lost: each client's count of accepted results is what the store holds for it
    for k, c in enumerate(clients):
        said = re.search(r"stopped: (\d+) results accepted", c.output())
        assert said, c.output()[-2000:]
        client_id = load_identity(tmp_path / f"c{k}").client_id
        (held,), = db_rows(run_dir, "SELECT COUNT(*) FROM results WHERE client_id=?", (client_id,))
        assert held >= int(said.group(1))  # (>=: a result accepted as the API died is kept, its reply lost)
    log = (tmp_path / "coord.log").read_text()
    for role in ("learner", "verifier-0", "api"):
        assert re.search(rf"{role} \(pid \d+\) exited with -9; restarting it", log), role
    assert "resumed at version" in log
