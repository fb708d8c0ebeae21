"""`echo-swarm coordinator` with the learner on 2 FSDP ranks (gloo, CPU) and a real client (issue 16).

The learner role starts its second rank itself; the run trains, publishes versions gathered from the shards, and
writes sharded checkpoints. Mid-run the second rank is killed: the learner's next collective fails, the supervisor
restarts the learner, which starts a new second rank, loads the sharded checkpoint and replays the recorded steps
since it, and the run completes with every step trained exactly once.

The client is held (SIGSTOP) from step 2 until the rank is dead, so steps are left for the learner's next
collective to fail on. (Killing the rank once the status said "version 3" of 5 raced the run: on an idle machine a
tiny step takes 0.4 s and the status is cached up to a second, so the run could end before the kill.)
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.integration.helpers import (
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

pytestmark = pytest.mark.slow

STEPS = 6




def test_learner_on_two_ranks_trains_and_survives_a_dead_rank(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"layout": "processes"},
                       learner={"max_steps": STEPS, "checkpoint_every_steps": 2, "world_size": 2})
    log = tmp_path / "coord.log"
    coord, url = start_coordinator(cfg, log)
    client = start_client(url, tmp_path / "c0", tmp_path / "c0.log", "--exit-when-finished")
    trained = "SELECT COALESCE(MAX(step), 0) FROM steps"
    try:
        wait_until(lambda: db_rows(run_dir, trained)[0][0] >= 2, 300, "two steps on two ranks")
        os.kill(client.proc.pid, signal.SIGSTOP)  # what it already sent can complete one more step, no more
        try:
            ((step,),) = db_rows(run_dir, trained)
            assert step <= STEPS - 2, f"the run reached step {step} before the client was held"
            follower = started_rank_pids(log, "learner")[-1]
            os.kill(follower, signal.SIGKILL)
        finally:
            os.kill(client.proc.pid, signal.SIGCONT)
        final = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 400, "the run to finish")
        assert client.proc.wait(120) == 0, client.output()[-3000:]
    finally:
        stop_all(client, coord)
    out = log.read_text()
    assert coord.proc.returncode == 0, out[-3000:]
    for pid in started_rank_pids(log, "learner"):  # no rank outlives the coordinator
        wait_until(lambda pid=pid: not process_alive(pid), 30, f"learner rank {pid} to exit")
    assert final["version"] == STEPS
    assert len(started_rank_pids(log, "learner")) >= 2  # the restarted learner started a new second rank
    assert re.search(r"learner \(pid \d+\) exited with 1; restarting it", out), out[-3000:]
    assert re.search(r"restored the checkpoint of version \d+ and replayed \d+ steps", out), out[-3000:]
    per_step = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results WHERE ingested_step IS NOT NULL "
                                "GROUP BY ingested_step ORDER BY 1")
    assert per_step == [(step, 2) for step in range(1, STEPS + 1)]
    (ckpt,) = [p for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")]
    info = json.loads((ckpt / "checkpoint.json").read_text())
    assert info["format"] == 2 and info["world_size"] == 2 and info["optimizer"] is True
    assert any(p.suffix == ".distcp" for p in ckpt.iterdir())  # torch.distributed.checkpoint's shards
