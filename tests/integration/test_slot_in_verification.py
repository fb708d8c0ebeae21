"""A result being verified keeps its job's place in the queue (issue 37: "an honest volunteer's work is never
dropped").

In sequential pull a version's B jobs are its whole batch. When the verifier is busy, the results of those jobs wait
in verification past their holders' leases; if the issuer then counted those jobs as gone, it would plan another job
at the same version, and of the B + 1 results the learner trains B — the last honest one credited but set aside as
stale, never trained. Here the coordinator runs as `echo-swarm coordinator` does (API, learner, verifier processes),
its verifier held at ``recompute-v0`` (coordinator.holds) while both results of step 0 wait past their leases: a third
client asking for work gets none, and once the verifier goes on both results are trained in step 0's batch and
nothing is set aside.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

from shared import wire
from shared.endpoints import RESULTS
from shared.messages import Info, SubmitResponse
from tests.integration.helpers import (
    RawClient,
    db_rows,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)
from tests.integration.ops_helpers import honest_result_at, lease, recomputes, register_at, try_lease

# far shorter than the verifier is held, and long enough for this test to compute both results under CI's load
# (twice at once on two cores: 11 s)
LEASE_S = 30.0


def test_results_in_verification_keep_their_slots_past_their_leases(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "verifier-held"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "sequential-pull"},
                       jobs={"lease_timeout_s": LEASE_S, "long_poll_s": 1.0}, learner={"max_steps": 1})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log", env={"ECHO_SWARM_HOLD": f"recompute-v0={marker}"})
    replies: list[tuple[int, bytes]] = []
    senders: list[threading.Thread] = []
    try:
        with urllib.request.urlopen(f"{url}/v1/info", timeout=30) as resp:
            key = wire.decode(resp.read(), Info).coordinator_public_key
        clients = [register_at(url, "a"), register_at(url, "b")]
        jobs = [lease(c, key) for c in clients]  # step 0's batch: B = 2 jobs
        assert {j.version for j in jobs} == {0}
        leased_at = time.monotonic()
        bodies = [wire.encode(honest_result_at(url, key, run_dir, j)) for j in jobs]
        assert time.monotonic() - leased_at < LEASE_S - 5, "the results took most of their lease to compute"

        def sends(client: RawClient, body: bytes) -> None:
            replies.append(client.send(RESULTS.path, client.envelope(RESULTS.path, body), timeout=300))

        senders = [threading.Thread(target=sends, args=cb) for cb in zip(clients, bodies, strict=True)]
        for t in senders:
            t.start()
        wait_until(lambda: marker.exists() and recomputes(url) == 2, 120,
                   "both results in verification, the verifier held on the first")
        # both leases run out while their results wait for the verifier
        wait_until(lambda: time.monotonic() - leased_at > LEASE_S + 1.0, 2 * LEASE_S + 30, "the leases to run out")
        assert all(t.is_alive() for t in senders)  # no verdict yet

        third = register_at(url, "c")
        extra = try_lease(third, key)  # long-polls, then answers
        assert extra is None, f"job {extra.job_id} issued at version {extra.version} beside step 0's batch in verification"

        marker.unlink()  # the verifier goes on
        for t in senders:
            t.join(300)
        assert sorted(s for s, _ in replies) == [200, 200], [RawClient.error(r) for _, r in replies]
        assert all(wire.decode(r, SubmitResponse).accepted for _, r in replies)
        wait_until(lambda: db_rows(run_dir, "SELECT COUNT(*) FROM results WHERE ingested_step IS NOT NULL") == [(2,)],
                   180, "step 0 to train both results")
    finally:
        if marker.exists():
            marker.unlink()
        for t in senders:
            t.join(60)
        stop_all(coord)
    # both trained by the step on version 0 (staleness 0, as sequential pull promises), none set aside
    assert db_rows(run_dir, "SELECT r.job_id, r.version, s.trained_version, r.stale_at FROM results r "
                            "JOIN steps s ON s.step = r.ingested_step ORDER BY r.job_id") == sorted(
        (j.job_id, 0, 0, None) for j in jobs)
    assert db_rows(run_dir, "SELECT COUNT(*) FROM jobs WHERE version = 0") == [(2,)]  # no third job at version 0
