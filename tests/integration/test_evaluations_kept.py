"""Every requested held-out evaluation is done, however far the learner runs ahead of a busy verifier (issue 37).

`echo-swarm coordinator` (API, learner and verifier processes) with two real clients, evaluating every version and
keeping only the newest 2 on disk; verifier 0 is held at the ``evaluate-v1`` hold point (coordinator.holds) while
the learner trains on. Before, version 1's folder was pruned under the waiting evaluation, which was then skipped
("no longer kept for verification") and the evals table lacked it; now the learner keeps it until the evaluation is
recorded, and the verifier reports none skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.helpers import (
    db_rows,
    get_status,
    start_client,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

STEPS = 5


def test_a_version_waiting_for_its_evaluation_is_kept_until_evaluated(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "evaluation-held"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir,
                       learner={"max_steps": STEPS, "eval_every": 1, "eval_size": 8}, snapshots={"keep_last": 2})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log", env={"ECHO_SWARM_HOLD": f"evaluate-v1={marker}"})
    clients = [start_client(url, tmp_path / f"c{k}", tmp_path / f"c{k}.log", "--exit-when-finished")
               for k in range(2)]
    try:
        wait_until(marker.exists, 180, "verifier 0 to hold version 1's evaluation")
        # the learner trains on past the window of 2 kept versions while the evaluation waits
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 4, 300, "the learner to reach version 4")
        assert (run_dir / "snapshots" / "v000001").is_dir()  # kept for its evaluation (keep_last alone prunes it)
        assert 1 not in {v for (v,) in db_rows(run_dir, "SELECT version FROM evals")}
        marker.unlink()  # the verifier goes on
        def evaluated() -> dict[str, Any]:  # the final status once every version is evaluated, else {}
            s = get_status(url) or {}
            done = s and s["finished"] and {e["version"] for e in s["evals"]} >= set(range(STEPS + 1))
            return s if done else {}

        final = wait_until(evaluated, 300, "every version's evaluation")
        for c in clients:
            assert c.proc.wait(120) == 0, c.output()[-3000:]
    finally:
        if marker.exists():
            marker.unlink()
        stop_all(*clients, coord)
    assert final["roles"]["verifier-0"]["evaluations_skipped"] == []
    assert [line for line in coord.output().splitlines() if "held-out evaluation of version" in line] == []
    assert sorted(v for (v,) in db_rows(run_dir, "SELECT DISTINCT version FROM evals")) == list(range(STEPS + 1))
