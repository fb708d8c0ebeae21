"""A signed call whose libp2p relay died after handing it to the API (the coordinator's p2p role killed mid-call):
the client's HTTP fallback is signed afresh, so it is answered instead of refused as a replay (issue 37's kill of the
p2p role found it: the same envelope over HTTP came back 409 replayed_nonce, a refusal that stops the client).

A real coordinator on loopback and the production client API (swarm_client.api.CoordinatorClient); only the libp2p
leg is stood in for, by a transport that delivers each call to the API exactly as the relay does and then fails as a
broken stream does (PeerCalls.send's None: "send this attempt over HTTP")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from shared.endpoints import LEASE, REGISTER, RESULTS
from shared.messages import Job, LeaseRequest, RegisterRequest, SubmitResponse
from shared.records import open_job
from swarm_client.api import CoordinatorClient
from swarm_client.hardware import profile
from swarm_client.identity import load_identity
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import db_rows
from tests.integration.ops_helpers import honest_result


class DeliveredThenBroken:
    """Each call reaches the API (its status kept), then the stream breaks before the reply gets back."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.delivered: list[tuple[str, int]] = []

    async def send(self, path: str, data: bytes) -> tuple[int, bytes] | None:
        async with aiohttp.ClientSession() as session, session.post(
                self.url + path, data=data, headers={"Content-Type": "application/msgpack"}) as resp:
            await resp.read()
            self.delivered.append((path, resp.status))
        return None


def test_a_call_the_dead_relay_delivered_is_answered_over_http(live_coordinator: LiveCoordinator,
                                                                tmp_path: Path) -> None:
    live = live_coordinator
    identity = load_identity(tmp_path / "c")
    relay = DeliveredThenBroken(live.url)

    async def main() -> tuple[Job, SubmitResponse]:
        api = CoordinatorClient(live.url, identity)
        api.calls = relay  # type: ignore[assignment]
        try:
            await api.call(REGISTER, RegisterRequest(public_key=identity.public_key,
                                                     profile=profile("torch", "cpu", "relayed")))
            granted = await api.call(LEASE, LeaseRequest(backend="torch", held_version=-1))
            assert granted.job is not None
            job = open_job(granted.job, live.coordinator.public_key)
            sub = await asyncio.to_thread(honest_result, live, job)
            return job, await api.call(RESULTS, sub)
        finally:
            await api.close()

    job, reply = asyncio.run(main())
    # every call reached the API over the "relay" first and was answered there
    assert [p for p, _ in relay.delivered] == [REGISTER.path, LEASE.path, RESULTS.path]
    assert all(status == 200 for _, status in relay.delivered), relay.delivered
    # the fallback's copy was answered too: the result accepted (it was, over the relay) and stored once
    assert reply.accepted and reply.job_id == job.job_id
    assert db_rows(live.run_dir, "SELECT client_id FROM results WHERE job_id=?", (job.job_id,)) == [
        (identity.client_id,)]
    assert db_rows(live.run_dir, "SELECT reason FROM rejections") == []
