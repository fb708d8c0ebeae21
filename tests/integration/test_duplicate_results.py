"""Copies through the real HTTP path: a result whose completions are token for token another job's accepted
result is refused with duplicate_result (409) before any recompute, writes no result and costs no trust; the
copier's own honest work for the same lease is accepted afterwards. A real coordinator on loopback, raw protocol
clients, the production torch backend for the honest results."""

from __future__ import annotations

from pathlib import Path

from coordinator.core.duplicates import MIN_COPY_SURPRISAL_NATS, surprisal
from shared import wire
from shared.hashing import tokens_sha256
from shared.messages import Job, ResultSubmission, SubmitResponse
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register


def copied(original: ResultSubmission, onto: Job) -> ResultSubmission:
    """``original``'s completions (tokens and logprobs) sent as the result of another job."""
    return original.model_copy(update={"job_id": onto.job_id, "lease_id": onto.lease_id, "version": onto.version,
                                       "prompt_hash": onto.prompt_hash, "seed": onto.seed,
                                       "group_size": onto.group_size})


def refused_as_copy(client: RawClient, sub: ResultSubmission, of: str) -> None:
    status, raw = client.post("/v1/results", sub)
    err = RawClient.error(raw)
    assert (status, err.error) == (409, "duplicate_result"), f"{status} {err}"
    assert f"job {of}" in err.message and "copy" in err.message


def accepted(client: RawClient, sub: ResultSubmission) -> None:
    status, raw = client.post("/v1/results", sub)
    assert status == 200, RawClient.error(raw)
    assert wire.decode(raw, SubmitResponse).accepted


def test_a_copied_result_is_refused_and_the_copiers_own_work_accepted(tmp_path: Path, tiny_model_dir: Path) -> None:
    # first come, first served, several jobs open at once: three leases for two clients without waiting; jobs of
    # the default run's shape (8 prompts × 8 samples), so a result holds far more than the 20 nats of choice below
    # which an identical result could be an honest coincidence (core.duplicates)
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1},
                             jobs={"speed_aware": False, "prompts_per_job": 8},
                             learner={"group_size": 8, "prompts_per_step": 16}) as live:
        honest, copier = register(live, "honest"), register(live, "copier")
        key = live.coordinator.public_key
        first, again = lease(honest, key), lease(honest, key)
        theirs = lease(copier, key)
        original = honest_result(live, first)
        assert surprisal([c.logprobs for c in original.completions]) >= 2 * MIN_COPY_SURPRISAL_NATS
        accepted(honest, original)
        (stored,), = db_rows(live.run_dir, "SELECT completions_sha256 FROM results WHERE job_id=?", (first.job_id,))
        assert stored == tokens_sha256([c.token_ids for c in original.completions])

        # another identity's copy, then the same identity's own copy onto another job: both refused, nothing written
        refused_as_copy(copier, copied(original, theirs), first.job_id)
        refused_as_copy(honest, copied(original, again), first.job_id)
        assert db_rows(live.run_dir, "SELECT job_id FROM results") == [(first.job_id,)]
        assert db_rows(live.run_dir, "SELECT client_id, job_id, reason FROM rejections ORDER BY id") == [
            (copier.client_id, theirs.job_id, "duplicate_result"), (honest.client_id, again.job_id, "duplicate_result")]
        assert db_rows(live.run_dir, "SELECT outcome, reason FROM audit WHERE client_id=?", (copier.client_id,)) == [
            ("rejected", "duplicate_result")]
        # no trust lost: a copy earns nothing, but is no evidence of forged tokens
        assert db_rows(live.run_dir, "SELECT consecutive_invalid FROM trust WHERE consecutive_invalid > 0") == []

        # the same lease, now with the copier's own work: accepted
        accepted(copier, honest_result(live, theirs))
        assert {r[0] for r in db_rows(live.run_dir, "SELECT job_id FROM results")} == {first.job_id, theirs.job_id}


def test_a_resend_of_the_same_result_is_no_copy(live_coordinator: LiveCoordinator) -> None:
    """The same client sending the same result for the same job again (its reply was lost) is answered as before,
    not refused as its own duplicate."""
    client = register(live_coordinator, "resender")
    job = lease(client, live_coordinator.coordinator.public_key)
    sub = honest_result(live_coordinator, job)
    accepted(client, sub)
    accepted(client, sub)
