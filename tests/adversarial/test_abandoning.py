"""Selective reporting by abandoning, as a real process, in both sync modes (issue 37's must-show).

A client can read a job's prompts, generate its honest keyed result, score it with the task's public reward, and
return it only when it likes the reward — every returned result passes every check. What stops that from tilting
training is the reissue rule (coordinator.core.scheduling.decide_lease): a released job goes to the next client
**with its key at its version**, so whoever computes it produces the very tokens, and the very reward, the first
holder saw and dropped; the learner trains it anyway.

Here the adversary process (tests/adversarial/adversary.py ``above_median``) computes 100 distinct jobs and returns
only those scoring above the running median of what it computed; one honest ``echo-swarm join`` client works beside
it, in sequential pull with 2 jobs per version and in async push-pull (S = 2). From the store (results.ingested_step
says which results the learner trained) the test checks:

- the trained results of the adversary's jobs have the mean reward of everything it computed, within 2 standard
  errors (the honest expectation: jobs are drawn at random, and every one of them, returned or dropped, is trained);
- such a job, returned by the honest client at the adversary's version, holds the adversary's very tokens (same key,
  same version) — at least 4 in 5 of them (2 of 55 differed in one run; a fresh draw would match none): two
  processes' logits may differ at a near-tie within torch's 0.02 logit, and the keyed choice with them;
- while what the adversary chose to return scores more than 2 standard errors above that expectation — the attack
  is real, and without the reissue rule the trained mean would carry its tilt;
- and the second line: the selective-reporting rule flags the adversary (audit outcome ``flagged``) from what its
  dropped jobs scored in the honest client's hands, and never the honest client.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    server_errors,
    start_client,
    start_coordinator,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

LEASES = 100  # distinct jobs the adversary computes


def _adversary(url: str, tmp: Path) -> dict[str, Any]:
    out = tmp / "adv.json"
    proc = Proc([sys.executable, "-m", "tests.adversarial.adversary", "above_median", "--leases", str(LEASES),
                 "--url", url, "--home", str(tmp / "adv"), "--out", str(out)], tmp / "adv.log")
    rc = proc.proc.wait(1500)
    proc.stop()
    assert rc == 0 and out.exists(), f"the adversary crashed (rc {rc}):\n{proc.output()[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["error"] is None, report["error"]
    return report


def _settled(run_dir: Path, jobs: list[str]) -> bool:
    """Every one of ``jobs`` has a result that was trained or set aside, or will get none (no live lease and no
    queued reissue left for it): nothing of the adversary's jobs is still on its way to the learner."""
    marks = ",".join("?" * len(jobs))
    waiting = db_rows(run_dir, f"SELECT COUNT(*) FROM results WHERE job_id IN ({marks}) AND ingested_step IS NULL "
                               "AND stale_at IS NULL", tuple(jobs))[0][0]
    open_jobs = db_rows(run_dir, f"SELECT COUNT(*) FROM jobs WHERE job_id IN ({marks}) AND job_id NOT IN "
                                 "(SELECT job_id FROM results) AND state IN ('open', 'leased')", tuple(jobs))[0][0]
    return waiting == 0 and open_jobs == 0


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("mode", ["sequential-pull", "async-push-pull"])
def test_abandoned_jobs_are_trained_anyway(mode: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": mode, "max_staleness": 2},
                       learner={"max_steps": 100_000}, jobs={"lease_timeout_s": 60.0, "long_poll_s": 1.0})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    honest = start_client(url, tmp_path / "honest", tmp_path / "honest.log")
    try:
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 1, 300, "the honest client to train a version")
        report = _adversary(url, tmp_path)
        computed = report["notes"]["computed"]
        jobs = [c["job_id"] for c in computed]
        wait_until(lambda: _settled(run_dir, jobs), 600,
                   "every job the adversary computed to be trained, set aside or left without a result")
        assert honest.proc.poll() is None, f"the honest client died:\n{honest.output()[-3000:]}"
        assert server_errors(url) == 0, "a request got a 5xx: see coord.log for the traceback"
    finally:
        for p in (honest, coord):
            p.stop()

    assert len(set(jobs)) == LEASES
    mine = {c["job_id"]: c["reward"] for c in computed}
    rewards = list(mine.values())
    expectation, sd = statistics.fmean(rewards), statistics.stdev(rewards)
    se = sd / len(rewards) ** 0.5
    assert sd > 0, "every job scored alike: nothing to select by, the test shows nothing"
    returned = [c["reward"] for c in computed if c["returned"]]
    accepted = [a for a in report["attempts"] if a["status"] == 200]
    assert len(accepted) == len(returned), report["attempts"]  # honest results, each accepted

    marks = ",".join("?" * len(jobs))
    stored = db_rows(run_dir, f"SELECT job_id, client_id, version, mean_reward, completions_sha256, ingested_step "
                              f"FROM results WHERE job_id IN ({marks})", tuple(jobs))
    trained = [row[:4] for row in stored if row[5] is not None]
    (adversary,) = report["identities"]
    at = {c["job_id"]: c for c in computed}
    # what it returned was scored by the coordinator as it scored it itself (the task's public reward)
    for job, client, _, reward, _, _ in stored:
        if client == adversary:
            assert reward == pytest.approx(mine[job], abs=1e-9), (job, reward, mine[job])
    # a dropped job another client computed at the version the adversary had: its key there (async push-pull binds
    # one whose version fell out of reach anew: a fresh draw, chosen by nobody)
    again = [(job, sha) for job, client, v, _, sha, _ in stored if client != adversary and v == at[job]["version"]]
    same = sum(sha == at[job]["tokens_sha256"] for job, sha in again)
    by_others = [(job, r) for job, client, v, r in trained if client != adversary and v == at[job]["version"]]
    dropped = [c["job_id"] for c in computed if not c["returned"]]
    trained_mean = statistics.fmean(r for *_, r in trained)
    print(f"{mode}: computed {len(rewards)} (expectation {expectation:.3f} ± {se:.3f}), returned {len(returned)} "
          f"(mean {statistics.fmean(returned):.3f}), dropped {len(dropped)}, trained {len(trained)} "
          f"(mean {trained_mean:.3f}; {len(by_others)} from the honest client), offered again "
          f"{report['notes'].get('offered_again', 0)}; dropped jobs the honest client returned at their version with "
          f"the adversary's very tokens: {same} of {len(again)}")

    # the attack is real: what it returned is tilted well beyond the expectation's uncertainty
    assert statistics.fmean(returned) > expectation + 2 * se, (returned, expectation, se)
    # a dropped job reissued with its key at its version is the sample the adversary saw: the very tokens, but where
    # the two processes' logits differ at a near-tie within the class's tolerance (torch: 0.02 logit)
    assert same >= 0.8 * len(again), (same, len(again))
    # and what was trained of its jobs is the honest expectation, not its selection
    assert len(by_others) >= len(dropped) // 2, (len(by_others), len(dropped))
    assert abs(trained_mean - expectation) <= 2 * se, (trained_mean, expectation, se)
    # the second line: flagged for what its dropped jobs scored, the honest client never
    flags = db_rows(run_dir, "SELECT client_id, detail FROM audit WHERE outcome='flagged'")
    assert flags and {c for c, _ in flags} == {adversary}, flags
    assert any("jobs dropped" in detail for _, detail in flags), flags
