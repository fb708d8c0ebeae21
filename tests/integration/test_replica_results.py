"""Replicas through the real HTTP path (issue 37): a measured client refused a slot is leased a second copy of a job
an unproven client holds — same job, key and version — and whichever holder's result comes first is trained; the
other's is answered ``accepted`` and credited, never trained, never refused (docs/protocol.md §5). A real
coordinator on loopback, raw protocol clients, the production torch backend for the honest results."""

from __future__ import annotations

from pathlib import Path

from shared import wire
from shared.messages import Job, RegisterRequest, ResultSubmission, SubmitResponse
from swarm_client.hardware import profile
from tests.integration.conftest import running_coordinator
from tests.integration.helpers import RawClient, db_rows
from tests.integration.ops_helpers import honest_result, lease, register, try_lease


def claiming(url: str, name: str) -> RawClient:
    """A client that declares 10⁷ tokens/s at registration: unproven until its own results measure it."""
    client = RawClient(url)
    claimed = profile("torch", "cpu", name).model_copy(update={"benchmark_tokens_per_s": 1e7})
    status, raw = client.post("/v1/register", RegisterRequest(public_key=client.public_key, profile=claimed))
    assert status == 200, raw
    return client


def accepted(client: RawClient, sub: ResultSubmission) -> SubmitResponse:
    status, raw = client.post("/v1/results", sub)
    assert status == 200, RawClient.error(raw)
    reply = wire.decode(raw, SubmitResponse)
    assert reply.accepted and reply.job_id == sub.job_id
    return reply


def same_job(a: Job, b: Job) -> bool:
    return (a.job_id, a.version, a.seed, a.prompt_hash) == (b.job_id, b.version, b.seed, b.prompt_hash)


def test_both_holders_of_a_replicated_job_are_accepted_and_one_is_trained(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    # async push-pull, S = 1, B = 2: four slots at version 0
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1}
                             ) as live:
        key = live.coordinator.public_key
        measured = register(live, "measured")
        first = lease(measured, key)
        accepted(measured, honest_result(live, first))  # its pace is its results' now
        claims = [claiming(live.url, f"claim{i}") for i in range(3)]
        held = [lease(c, key) for c in claims]  # the other three slots, held by unproven clients
        # the queue is full: the measured client is given a replica of the oldest unproven lease, then the next
        rep1, rep2 = lease(measured, key), lease(measured, key)
        assert same_job(rep1, held[0]) and same_job(rep2, held[1])
        assert rep1.lease_id != held[0].lease_id and rep1.client_id == measured.client_id
        assert try_lease(claims[2], key) is None  # an unproven client gets no replica
        rows = db_rows(live.run_dir, "SELECT job_id, client_id FROM replica_leases ORDER BY job_id")
        assert rows == sorted([(held[0].job_id, measured.client_id), (held[1].job_id, measured.client_id)])

        # the replica first: trained; the first holder's result, the same tokens, is credited
        mine = honest_result(live, rep1)
        accepted(measured, mine)
        theirs = honest_result(live, held[0])
        assert [c.token_ids for c in theirs.completions] == [c.token_ids for c in mine.completions]  # same key
        reply = accepted(claims[0], theirs)
        assert reply.credit == sum(len(c.token_ids) for c in theirs.completions)
        assert accepted(claims[0], theirs) == reply  # a resend: answered as before, nothing credited again

        # the first lease first: trained; the replica's result is credited
        accepted(claims[1], honest_result(live, held[1]))
        accepted(measured, honest_result(live, rep2))

        trained = db_rows(live.run_dir, "SELECT job_id, client_id FROM results ORDER BY job_id")
        assert sorted(trained) == sorted([(first.job_id, measured.client_id), (held[0].job_id, measured.client_id),
                                          (held[1].job_id, claims[1].client_id)])
        credited = db_rows(live.run_dir, "SELECT job_id, client_id FROM replica_results ORDER BY job_id")
        assert sorted(credited) == sorted([(held[0].job_id, claims[0].client_id), (held[1].job_id,
                                                                                     measured.client_id)])
        assert db_rows(live.run_dir, "SELECT client_id, reason FROM rejections") == []
        lines = db_rows(live.run_dir, "SELECT client_id, outcome, reason FROM audit WHERE reason='replica'")
        assert sorted(lines) == sorted([(claims[0].client_id, "accepted", "replica"),
                                        (measured.client_id, "accepted", "replica")])
        (n,), = db_rows(live.run_dir, "SELECT accepted FROM clients WHERE client_id=?", (claims[0].client_id,))
        assert n == 1  # credited once, the resend nothing more
