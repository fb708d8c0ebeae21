"""A result resent while its first copy is still being verified joins that verification (issue 37).

A volunteer whose upload gets no answer within its request timeout — the verifier busy for minutes — sends the same
result again. Here the coordinator runs as `echo-swarm coordinator` does (API, learner and verifier processes), its
verifier held busy at the ``recompute-v0`` hold point (coordinator.holds) while clients give up on their uploads and
resend them. What must hold: each result is recomputed once (``echo_swarm_result_recomputes_total``); every copy
gets the first copy's verdict — the honest one accepted, never refused ``lease_expired`` for its own earlier copy,
the forged one refused with one refusal recorded and one failure counted against its trust; and what the honest
client was told was accepted is what the store holds for it.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from pathlib import Path

from shared import wire
from shared.endpoints import RESULTS
from shared.messages import Info, ResultSubmission, SubmitResponse
from tests.integration.helpers import (
    RawClient,
    db_rows,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)
from tests.integration.ops_helpers import honest_result_at, lease, recomputes, register_at, scrape

GAVE_UP_S = 1.0  # the clients' request timeout here: far shorter than the verifier is held


def joined(url: str) -> float:
    return scrape(url).get(("echo_swarm_result_resends_joined_total", ()), -1.0)


def forged(sub: ResultSubmission) -> ResultSubmission:
    """The same tokens with one logprob moved by two nats (past `logprob_max_tol`): refused only once the recompute
    is known."""
    first = sub.completions[0]
    logprobs = [first.logprobs[0] - 2.0, *first.logprobs[1:]]
    return sub.model_copy(update={"completions": [first.model_copy(update={"logprobs": logprobs}),
                                                  *sub.completions[1:]]})


def gives_up(client: RawClient, body: bytes) -> None:
    """Upload ``body`` (freshly signed: a new nonce, as every retry) and hang up before the verdict comes."""
    try:
        status, raw = client.send(RESULTS.path, client.envelope(RESULTS.path, body), timeout=GAVE_UP_S)
    except (TimeoutError, urllib.error.URLError) as exc:
        assert "timed out" in str(exc), exc
        return
    raise AssertionError(f"a reply came while the verifier was held: {status} {raw[:200]!r}")


def test_a_resend_joins_the_verification_in_flight(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "verifier-held"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, jobs={"lease_timeout_s": 600.0})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log", env={"ECHO_SWARM_HOLD": f"recompute-v0={marker}"})
    replies: dict[str, list[tuple[int, bytes]]] = {"honest": [], "forger": []}
    waiters: list[threading.Thread] = []
    try:
        with urllib.request.urlopen(f"{url}/v1/info", timeout=30) as resp:
            key = wire.decode(resp.read(), Info).coordinator_public_key
        honest, forger = register_at(url, "honest"), register_at(url, "forger")
        job, other = lease(honest, key), lease(forger, key)
        sub = honest_result_at(url, key, run_dir, job)
        body, bad = wire.encode(sub), wire.encode(forged(honest_result_at(url, key, run_dir, other)))

        gives_up(honest, body)
        wait_until(marker.exists, 120, "the verifier to hold the result's recompute")
        gives_up(honest, body)  # two resends, each given up on as well
        gives_up(honest, body)

        def waits(name: str, client: RawClient, data: bytes) -> None:
            replies[name].append(client.send(RESULTS.path, client.envelope(RESULTS.path, data), timeout=300))

        waiters = [threading.Thread(target=waits, args=("honest", honest, body)),
                   *(threading.Thread(target=waits, args=("forger", forger, bad)) for _ in range(2))]
        for t in waiters:
            t.start()
        # every copy after each result's first has joined its verification: 3 honest resends, 1 forged
        # and each result's first copy has asked its recompute: the forged one's verification is a task of its own,
        # which may run only after its resend has joined (and after a scrape between the two), so wait for both
        wait_until(lambda: joined(url) == 4 and recomputes(url) == 2, 60,
                   "the resends to join the verifications in flight, each result's recompute asked", interval=0.3)
        assert recomputes(url) == 2  # asked while the verifier is held: one per result, none per copy
        marker.unlink()  # the verifier goes on
        for t in waiters:
            t.join(300)
        assert not any(t.is_alive() for t in waiters)

        # the honest client: accepted, once; its copies none refused
        (status, raw), = replies["honest"]
        assert status == 200, RawClient.error(raw)
        reply = wire.decode(raw, SubmitResponse)
        assert reply.accepted and reply.job_id == job.job_id
        told_accepted = 1  # the only reply it got; the three it gave up on said nothing
        # the forger: both copies refused alike, recorded once, one failure against its trust
        assert [s for s, _ in replies["forger"]] == [422, 422], replies["forger"]
        assert {RawClient.error(r).error for _, r in replies["forger"]} == {"logprob_mismatch"}
        scraped = scrape(url)
        assert scraped[("echo_swarm_result_recomputes_total", ())] == 2  # each result recomputed exactly once
        assert scraped[("echo_swarm_result_resends_joined_total", ())] == 4
        assert not marker.exists()  # no later recompute of v0 reached the hold point again
    finally:
        if marker.exists():
            marker.unlink()
        for t in waiters:
            t.join(60)
        stop_all(coord)
    assert db_rows(run_dir, "SELECT COUNT(*) FROM results WHERE client_id=?", (honest.client_id,)) == [(told_accepted,)]
    assert db_rows(run_dir, "SELECT client_id, reason FROM rejections") == [(forger.client_id, "logprob_mismatch")]
    assert db_rows(run_dir, "SELECT outcome, reason FROM audit WHERE job_id=?", (job.job_id,)) == [("accepted", "ok")]
    assert db_rows(run_dir, "SELECT consecutive_invalid FROM trust WHERE client_id=?", (forger.client_id,)) == [(1,)]
    assert db_rows(run_dir, "SELECT accepted, rejected FROM clients WHERE client_id IN (?, ?) ORDER BY accepted DESC",
                   (honest.client_id, forger.client_id)) == [(1, 0), (0, 1)]
