"""Two API processes lease at once from one PostgreSQL database (issue 16): many simulated clients, each with its
own identity, ask both APIs for jobs as fast as they answer, and no job is ever handed to two clients.

The run is real: the coordinator's supervisor (learner, verifier, API 0) and a second API process started alone
(``--role api --index 1``) on the same store URL; the clients speak the signed protocol over loopback. Leases are
long (nothing expires during the test), so any job granted twice would be a double lease.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordinator.store.store import Store
from shared import crypto, wire
from shared.messages import Info, LeaseRequest, LeaseResponse, RegisterRequest
from shared.records import open_job
from tests.integration.helpers import Proc, start_coordinator, stop_all, write_config

pytestmark = pytest.mark.slow

CLIENTS = 150
LEASES_PER_CLIENT = 4
ROUNDS = 8  # lease requests per client, alternating the two APIs (bounded: no job → ask again, at most this often)


async def _signed(session: aiohttp.ClientSession, url: str, key: Any, path: str, body: bytes) -> tuple[int, bytes]:
    env = wire.encode(crypto.sign_request(key, path, body, timestamp=time.time()))
    async with session.post(url + path, data=env, headers={"Content-Type": "application/msgpack"}) as resp:
        return resp.status, await resp.read()


async def _client(i: int, urls: list[str], info: Info, session: aiohttp.ClientSession, start: asyncio.Event,
                  grants: list[tuple[str, str, int]], statuses: Counter[int], registered: list[int]) -> None:
    from swarm_client.hardware import profile

    key = crypto.generate_key()
    client_id = crypto.client_id_for(crypto.public_bytes(key))
    reg = wire.encode(RegisterRequest(public_key=crypto.public_bytes(key), profile=profile("torch", "cpu", f"c{i}")))
    status, _ = await _signed(session, urls[i % 2], key, "/v1/register", reg)
    statuses[status] += 1
    registered[0] += 1
    if registered[0] == CLIENTS:
        start.set()
    await start.wait()  # every client asks at once, once all are registered (registration is not the point)
    body = wire.encode(LeaseRequest(backend="torch", held_version=-1))
    for r in range(ROUNDS):
        api = (i + r) % 2
        status, raw = await _signed(session, urls[api], key, "/v1/lease", body)
        statuses[status] += 1
        if status != 200:
            continue
        resp = wire.decode(raw, LeaseResponse)
        if resp.job is not None:
            job = open_job(resp.job, info.coordinator_public_key)
            grants.append((job.job_id, client_id, api))


async def _lease_storm(urls: list[str]) -> tuple[list[tuple[str, str, int]], Counter[int]]:
    grants: list[tuple[str, str, int]] = []
    statuses: Counter[int] = Counter()
    timeout = aiohttp.ClientTimeout(total=120, connect=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200), timeout=timeout) as session:
        async with session.get(urls[0] + "/v1/info") as resp:
            info = wire.decode(await resp.read(), Info)
        start = asyncio.Event()
        registered = [0]
        tasks = [asyncio.create_task(_client(i, urls, info, session, start, grants, statuses, registered))
                 for i in range(CLIENTS)]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
    return grants, statuses


def test_two_api_processes_on_one_postgresql_never_lease_a_job_twice(pg_url: str, tmp_path: Path,
                                                                      tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml", run_dir, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 2},
        store={"url": pg_url},
        learner={"max_steps": 1000, "prompts_per_step": 64, "group_size": 2, "eval_every": 0, "eval_size": 16,
                 "threads": 1},
        jobs={"prompts_per_job": 1, "lease_timeout_s": 600.0, "long_poll_s": 0.0, "speed_aware": False},
        # sign-up limits off: 150 identities register at once from one address (registration is not the point)
        limits={"per_address_rps": 0.0, "registrations_per_address_per_min": 0.0, "new_identities_per_min": 0.0,
                "max_leases_per_client": LEASES_PER_CLIENT},
        server={"max_connections_per_address": 1000})  # every simulated client connects from 127.0.0.1
    coord, url0 = start_coordinator(config, tmp_path / "coordinator.log")
    second = Proc([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(config), "--role", "api",
                   "--index", "1"], tmp_path / "api1.log", ready="listening on ")
    try:
        second.ready.wait(180)
        out = second.output()
        assert "listening on " in out, f"the second API did not start:\n{out[-3000:]}"
        url1 = out.split("listening on ")[1].split()[0]
        assert url1 != url0

        grants, statuses = asyncio.run(_lease_storm([url0, url1]))

        assert set(statuses) == {200}, statuses  # no refusal, no server error, under contention
        jobs = Counter(job for job, _, _ in grants)
        twice = {job: n for job, n in jobs.items() if n > 1}
        assert not twice, f"jobs leased to two clients: {twice}"
        by_api = Counter(api for _, _, api in grants)
        assert by_api[0] > 0 and by_api[1] > 0, by_api  # both APIs leased
        # the queue bound B·(S+1) = 64·3 jobs was reached: the storm contended for the last free slots
        assert len(grants) >= 150, len(grants)
        store = Store(pg_url)
        try:
            leased = {j.view.job_id: j for j in store.jobs.active()}
            for job, client, _ in grants:  # the database agrees: each job leased once, to the client told so
                assert leased[job].view.lease_client == client and leased[job].issue_count == 1
            assert len(leased) == len(grants)
        finally:
            store.close()
    finally:
        stop_all(second, coord)
