"""Every kind of bad result is refused with its reason code and the right HTTP status, and changes nothing:
no job, result or version row moves. Uses a real coordinator on loopback and a raw protocol client."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from shared import PROTOCOL_VERSION, wire
from shared.messages import (
    Job,
    ReleaseRequest,
    ResultSubmission,
    SubmitResponse,
)
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register


def state(run_dir: Path) -> dict[str, Any]:
    return {
        "jobs": db_rows(run_dir, "SELECT job_id, state, lease_id, lease_client FROM jobs ORDER BY job_id"),
        "results": db_rows(run_dir, "SELECT job_id, client_id, ingested_step FROM results ORDER BY job_id"),
        "versions": db_rows(run_dir, "SELECT version FROM versions"),
    }


def refused(client: RawClient, path: str, data: bytes, status: int, reason: str) -> str:
    got_status, raw = client.send(path, data)
    err = RawClient.error(raw)
    assert (got_status, err.error) == (status, reason), f"{got_status} {err}"
    assert len(err.message) > 10
    return err.message


def tamper(sub: ResultSubmission, **changes: Any) -> ResultSubmission:
    data = copy.deepcopy(sub.model_dump())
    data.update(changes)
    return ResultSubmission.model_validate(data)


@pytest.fixture
def setup(live_coordinator: LiveCoordinator) -> tuple[LiveCoordinator, RawClient, Job, ResultSubmission]:
    client = register(live_coordinator)
    job = lease(client, live_coordinator.coordinator.public_key)
    return live_coordinator, client, job, honest_result(live_coordinator, job)


def test_honest_result_is_accepted_and_durable(setup: Any) -> None:
    live, client, job, result = setup
    status, raw = client.post("/v1/results", result)
    assert status == 200, raw
    reply = wire.decode(raw, SubmitResponse)
    assert reply.accepted and reply.credit == sum(len(c.token_ids) for c in result.completions)
    assert db_rows(live.run_dir, "SELECT client_id FROM results WHERE job_id=?", (job.job_id,)) == [(client.client_id,)]


def test_bad_signature_is_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    envelope = bytearray(client.envelope("/v1/results", result))
    envelope[-5] ^= 0xFF  # inside the trailing signature bytes
    refused(client, "/v1/results", bytes(envelope), 401, "bad_signature")
    # a body signed by someone else's key under this client's id
    other = RawClient(live.url)
    forged = RawClient(live.url, key=other.key)
    data = forged.envelope("/v1/results", result)
    req = wire.unpack(data)
    req["client_id"] = client.client_id
    refused(client, "/v1/results", wire.pack(req), 401, "bad_signature")
    assert state(live.run_dir) == before


def test_result_for_unleased_job_is_refused(setup: Any) -> None:
    live, client, job, result = setup
    intruder = register(live)
    # a job that exists but is leased to nobody: another client leases it and gives it back
    other = lease(intruder, live.coordinator.public_key)
    status, _ = intruder.post("/v1/release", ReleaseRequest(job_id=other.job_id, lease_id=other.lease_id))
    assert status == 200
    before = state(live.run_dir)
    assert (other.job_id, "open") in [(r[0], r[1]) for r in before["jobs"]]
    msg = refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, job_id=other.job_id)),
                  403, "not_lease_holder")
    assert "lease" in msg
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, job_id="j999999")), 404,
            "unknown_job")
    # another registered client submitting this client's leased job
    refused(intruder, "/v1/results", intruder.envelope("/v1/results", result), 403, "not_lease_holder")
    assert state(live.run_dir) == before


def test_result_after_lease_expiry_is_refused_and_job_reissued(setup: Any) -> None:
    live, client, job, result = setup
    live.clock.advance(31.0)  # lease_timeout_s is 30
    before = state(live.run_dir)
    refused(client, "/v1/results", client.envelope("/v1/results", result, timestamp=live.clock.now), 410,
            "lease_expired")
    assert state(live.run_dir) == before
    other = register(live)
    again = lease(other, live.coordinator.public_key)
    assert again.job_id == job.job_id and again.lease_id != job.lease_id  # oldest job first: reissued


def test_wrong_version_is_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, version=job.version + 1)), 409,
            "wrong_version")
    assert state(live.run_dir) == before


def test_tokens_out_of_range_are_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    vocab = live.coordinator.vocab_size
    comps = [c.model_dump() for c in result.completions]
    comps[0]["token_ids"][0] = vocab + 5
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, completions=comps)), 422,
            "token_out_of_range")
    long = [c.model_dump() for c in result.completions]
    n = job.sampling.max_tokens + 1
    long[0] = {"token_ids": [17] * n, "logprobs": [-1.0] * n, "finish_reason": "length"}
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, completions=long)), 422,
            "token_out_of_range")
    assert state(live.run_dir) == before


def test_binding_and_shape_mismatches_are_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, seed=job.seed ^ 1)), 422,
            "binding_mismatch")
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, prompt_hash="0" * 64)), 422,
            "binding_mismatch")
    refused(client, "/v1/results",
            client.envelope("/v1/results", tamper(result, completions=[c.model_dump() for c in result.completions][:-1])),
            422, "shape_mismatch")
    assert state(live.run_dir) == before


def test_fabricated_logprobs_are_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    comps = [c.model_dump() for c in result.completions]
    for c in comps:
        c["logprobs"] = [-0.01] * len(c["logprobs"])  # "the model was very sure": not what the policy says
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, completions=comps)), 422,
            "logprob_mismatch")
    assert state(live.run_dir) == before


def test_malformed_and_unknown_requests_are_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    refused(client, "/v1/results", b"\xc1\x00garbage", 400, "malformed")
    refused(client, "/v1/results", wire.pack({"protocol": 1}), 422, "schema_invalid")
    stranger = RawClient(live.url)
    refused(stranger, "/v1/results", stranger.envelope("/v1/results", result), 401, "unknown_client")
    # signed for another endpoint, then sent here
    refused(client, "/v1/results", client.envelope("/v1/lease", result), 401, "bad_signature")
    assert state(live.run_dir) == before


def test_replayed_result_is_refused_and_a_resent_result_is_idempotent(setup: Any) -> None:
    live, client, job, result = setup
    data = client.envelope("/v1/results", result)
    assert client.send("/v1/results", data)[0] == 200
    after_accept = state(live.run_dir)
    refused(client, "/v1/results", data, 409, "replayed_nonce")
    # the same client re-sending the same result (as after a lost reply) gets the same answer, nothing new
    status, raw = client.post("/v1/results", result)
    assert status == 200 and wire.decode(raw, SubmitResponse).accepted
    # a different result for the finished job is refused
    comps = [c.model_dump() for c in result.completions]
    comps.reverse()
    refused(client, "/v1/results", client.envelope("/v1/results", tamper(result, completions=comps)), 409,
            "job_completed")
    assert state(live.run_dir) == after_accept
    rejections = db_rows(live.run_dir, "SELECT reason FROM rejections WHERE client_id=?", (client.client_id,))
    assert ("job_completed",) in rejections


def test_other_protocol_version_is_refused(setup: Any) -> None:
    live, client, job, result = setup
    before = state(live.run_dir)
    req = wire.unpack(client.envelope("/v1/results", result))
    req["protocol"] = PROTOCOL_VERSION + 1
    msg = refused(client, "/v1/results", wire.pack(req), 426, "protocol_version")
    assert "upgrade" in msg
    assert state(live.run_dir) == before


def test_a_failing_reward_refuses_the_result_and_changes_nothing(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's reward that raises fails that result (reward_failed, 422, in the audit log), writes no result
    and costs the client no trust; the next result is scored again."""
    from coordinator.tasks.rewards import RewardFailed

    live, client, job, result = setup
    task = live.coordinator.task

    def failing(items: Any, completions: Any) -> Any:
        raise RewardFailed("reward my_rewards:f raised KeyError: 'solution'")

    monkeypatch.setattr(task, "score", failing)
    before = state(live.run_dir)
    message = refused(client, "/v1/results", client.envelope("/v1/results", result), 422, "reward_failed")
    assert "my_rewards:f raised KeyError" in message
    assert state(live.run_dir) == before
    audit = live.coordinator.store.audit.lines(job_id=job.job_id)
    assert [(a.outcome, a.reason) for a in audit] == [("rejected", "reward_failed")]
    assert live.coordinator.guard.standings() == [] or all(
        s.consecutive_invalid == 0 for s in live.coordinator.guard.standings())
