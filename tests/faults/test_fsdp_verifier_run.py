"""`echo-swarm coordinator` with its verifier as a group of 2 FSDP ranks (gloo, CPU; ``verification.placement =
"fsdp"``) and a real torch client (issue 16).

The verifier role starts its second rank itself. Honest results (the client's, and one sent by a raw protocol
client) are accepted; the same result with fabricated logprobs is refused with ``logprob_mismatch``, as on a
single-device verifier. Mid-run the second rank is killed: verifier-0 notices, exits, and the supervisor restarts
it, which starts a new second rank; the run completes with every step's results ingested exactly once.

The order is what makes this deterministic: the raw client leases and answers at version 0 and the rank is killed
before the volunteer starts, so every later step has to be verified by the restarted group. (Killing the rank "at
version 3" of a run the volunteer drives raced it: on an idle machine five tiny steps take one second, and the run
had finished before the kill — CI failed that way.)
"""

from __future__ import annotations

import copy
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared import wire
from shared.messages import ResultSubmission, SubmitResponse
from tests.integration.helpers import (
    RawClient,
    db_rows,
    get_status,
    process_alive,
    start_client,
    start_coordinator,
    started_rank_pids,
    stop_all,
    wait_until,
    write_config,
)
from tests.integration.ops_helpers import honest_result, register, try_lease

pytestmark = pytest.mark.slow

STEPS = 5




def _tampered_then_honest(url: str, run_dir: Path) -> None:
    """A raw client leases a job: its result with made-up logprobs is refused, the honest one accepted."""
    key = wait_until(lambda: db_rows(run_dir, "SELECT value FROM meta WHERE key='coordinator_public_key'"), 300,
                     "the coordinator's key")[0][0]
    live = SimpleNamespace(url=url, run_dir=run_dir, coordinator=SimpleNamespace(public_key=bytes.fromhex(key)))
    client = register(live)  # type: ignore[arg-type]
    job = wait_until(lambda: try_lease(client, live.coordinator.public_key), 300, "a job for the raw client")
    result = honest_result(live, job)  # type: ignore[arg-type]
    data = copy.deepcopy(result.model_dump())
    for c in data["completions"]:
        c["logprobs"] = [-0.01] * len(c["logprobs"])  # "the model was very sure": not what the policy says
    status, raw = client.post("/v1/results", ResultSubmission.model_validate(data))
    assert (status, RawClient.error(raw).error) == (422, "logprob_mismatch"), raw
    status, raw = client.post("/v1/results", result)
    assert status == 200 and wire.decode(raw, SubmitResponse).accepted, raw


def _ranks_reported(url: str, pids: list[int]) -> bool:
    role = ((get_status(url) or {}).get("roles") or {}).get("verifier-0") or {}
    return role.get("ranks") == 2 and role.get("rank_pids") == pids


def test_verifier_on_two_ranks_verifies_and_survives_a_dead_rank(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"layout": "processes"},
                       learner={"max_steps": STEPS}, model={"device": "cpu"},
                       verification={"placement": "fsdp", "world_size": 2})
    log = tmp_path / "coord.log"
    coord, url = start_coordinator(cfg, log)
    client = None
    try:
        _tampered_then_honest(url, run_dir)  # at version 0: the volunteer has not started, the run cannot move
        (first,) = started_rank_pids(log, "verifier-0")
        wait_until(lambda: _ranks_reported(url, [first]), 60, "verifier-0's two ranks in the role status")
        os.kill(first, signal.SIGKILL)
        second = wait_until(lambda: started_rank_pids(log, "verifier-0")[1:], 300, "a new second rank")[0]
        wait_until(lambda: _ranks_reported(url, [second]), 120, "the restarted group in the role status")
        client = start_client(url, tmp_path / "c0", tmp_path / "c0.log", "--exit-when-finished")
        final = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 400, "the run to finish")
        assert client.proc.wait(120) == 0, client.output()[-3000:]
    finally:
        stop_all(*([client] if client is not None else []), coord)
    out = log.read_text()
    assert coord.proc.returncode == 0, out[-3000:]
    for pid in started_rank_pids(log, "verifier-0"):  # no rank outlives the coordinator
        wait_until(lambda pid=pid: not process_alive(pid), 30, f"verifier rank {pid} to exit")
    assert final["version"] == STEPS
    assert re.search(r"verifier-0 \(pid \d+\) exited with 1; restarting it", out), out[-3000:]
    assert "a rank of its group exited" in out or "on the verifier's ranks failed" in out, out[-3000:]
    per_step = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results WHERE ingested_step IS NOT NULL "
                                "GROUP BY ingested_step ORDER BY 1")
    assert per_step == [(step, 2) for step in range(1, STEPS + 1)]
    reasons = db_rows(run_dir, "SELECT reason FROM rejections")
    assert reasons == [("logprob_mismatch",)]
