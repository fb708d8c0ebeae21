"""An operator's reward plug-in that raises or returns a non-finite value fails the result it was scoring, with a
``reward_failed`` refusal in the audit log, and never the learner: here in the co-located layout, where the
learner's own rollouts go through the same intake (a real coordinator process, a real plug-in file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_swarm.demo_tasks import DEMO_DATA
from tests.integration.helpers import db_rows, get_status, start_coordinator, wait_until, write_config

pytestmark = pytest.mark.slow

# fails the first two results it scores (a result has several completions; a held-out evaluation scores one at a
# time and is left alone): the first by raising, the second with a NaN
PLUGIN = '''
import math

calls = 0


def flaky(prompts, completions, answer, **columns):
    global calls
    if len(completions) > 1:
        calls += 1
        if calls == 1:
            raise ValueError("cannot parse the reference answer")
        if calls == 2:
            return [math.nan] * len(completions)
    return [1.0 if c.strip() else 0.0 for c in completions]
'''


def test_a_failing_plugin_fails_its_results_not_the_colocated_learner(tmp_path: Path, tiny_model_dir: Path) -> None:
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(PLUGIN)
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "colocated"},
                       learner={"max_steps": 3},
                       task={"type": "dataset", "train_path": str(DEMO_DATA / "sums.jsonl"),
                             "prompt_column": "question", "prompt_template": "Q: {prompt}= A:", "heldout_size": 64})
    with cfg.open("a") as f:
        f.write(f'\n[[task.rewards]]\nname = "last_number"\n\n[[task.rewards]]\nfunction = "{plugin}:flaky"\n'
                f"weight = 0.5\n")
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    try:
        status = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 240, "the co-located run")
    finally:
        coord.stop()
    assert status["version"] == 3, coord.output()[-3000:]
    assert status["roles"]["learner"].get("last_error") in (None, ""), status["roles"]["learner"]
    refusals = db_rows(run_dir, "SELECT outcome, reason, detail FROM audit WHERE outcome = 'rejected' ORDER BY id")
    assert [(o, r) for o, r, _ in refusals] == [("rejected", "reward_failed")] * 2, refusals
    assert f"{plugin}:flaky raised ValueError: cannot parse the reference answer" in refusals[0][2]
    assert "returned nan" in refusals[1][2] and "finite" in refusals[1][2]
    failed_jobs = {j for (j,) in db_rows(run_dir, "SELECT job_id FROM rejections")}
    trained = {j for (j,) in db_rows(run_dir, "SELECT job_id FROM results WHERE ingested_step IS NOT NULL")}
    assert len(failed_jobs) == 2 and not failed_jobs & trained and len(trained) == 6
    means = [m for (m,) in db_rows(run_dir, "SELECT json_extract(metrics, '$.reward_means') FROM steps")]
    assert all(m is not None and "last_number" in m and f"{plugin}:flaky" in m for m in means), means
