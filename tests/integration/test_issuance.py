"""Issuance under Echo's protocols against a real coordinator on loopback (fake clock): the queue bound stops
issuing new work, and a client long-polling for work hears of a new policy version without asking again."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.verify import TokenStats
from shared import wire
from shared.messages import LeaseRequest, LeaseResponse, ReleaseRequest
from shared.records import open_job
from tests.integration.conftest import running_coordinator
from tests.integration.helpers import RawClient, db_rows, wait_until
from tests.integration.ops_helpers import honest_result, lease, register


def ask(client: RawClient) -> LeaseResponse:
    status, raw = client.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1))
    assert status == 200, raw
    return wire.decode(raw, LeaseResponse)


@pytest.mark.parametrize(("mode", "staleness", "slots"), [("sequential-pull", 1, 2), ("async-push-pull", 1, 4),
                                                          ("async-push-pull", 2, 6)])
@pytest.mark.parametrize("speed_aware", [True, False])
def test_issuance_stops_when_in_flight_work_would_exceed_the_bound(tmp_path: Path, tiny_model_dir: Path, mode: str,
                                                                   staleness: int, slots: int,
                                                                   speed_aware: bool) -> None:
    # B = 2 jobs per step (write_config: 4 prompts per step, 2 per job): B·(S+1) slots, B for sequential pull
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": mode, "max_staleness": staleness},
                             jobs={"speed_aware": speed_aware}, limits={"max_leases_per_client": 16}) as live:
        client = register(live)
        jobs = [lease(client, live.coordinator.public_key) for _ in range(slots)]
        assert len({j.job_id for j in jobs}) == slots and {j.version for j in jobs} == {0}
        refused = ask(client)
        assert refused.job is None and not refused.finished and refused.current_version == 0
        assert db_rows(live.run_dir, "SELECT COUNT(*) FROM jobs WHERE state='leased'") == [(slots,)]
        # once the leases expire the oldest job is reissued, not a new one planned
        live.clock.advance(31.0)
        again = ask(client)
        assert again.job is not None
        assert open_job(again.job, live.coordinator.public_key).job_id == jobs[0].job_id


def test_a_new_version_reaches_a_client_waiting_for_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1},
                             jobs={"long_poll_s": 20.0}, limits={"max_leases_per_client": 16}) as live:
        worker, waiter = register(live), register(live)
        jobs = [lease(worker, live.coordinator.public_key) for _ in range(4)]  # the queue is full
        results = [honest_result(live, j) for j in jobs[:2]]
        answer: list[LeaseResponse] = []
        thread = threading.Thread(target=lambda: answer.append(ask(waiter)), daemon=True)
        thread.start()
        wait_until(lambda: waiter.client_id in live.coordinator.issuer.waiters.clients(), 30, "the waiting client's long-poll")
        assert not answer  # still waiting: nothing to hand out
        for r in results:  # two results = one batch: the learner trains and publishes version 1
            status, raw = worker.post("/v1/results", r)
            assert status == 200, raw
        thread.join(60)
        assert answer, "the long-polling lease request did not return"
        resp = answer[0]
        assert resp.current_version == 1 and resp.job is not None  # woken by the new version, with work
        job = open_job(resp.job, live.coordinator.public_key)
        assert job.version in (0, 1) and job.job_id not in {j.job_id for j in jobs}
        assert db_rows(live.run_dir, "SELECT MAX(version) FROM versions") == [(1,)]


def test_a_new_version_wakes_the_clients_next_in_line_even_without_a_job(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    """Push without work: a version published while clients long-poll ends the wait at once for the B = 2
    fastest of them even though there is still no job (here the operator has paused issuing), so they pull the
    newest weights instead of sitting on old ones until the long-poll runs out (25 s here). The slowest keeps
    waiting: in a large idle swarm, waking everyone would have every client download every version."""
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1},
                             jobs={"long_poll_s": 25.0}) as live:
        worker = register(live)
        waiters = [register(live) for _ in range(3)]
        for pace, w in zip((1.0, 2.0, 3.0), waiters, strict=True):
            live.coordinator.issuer.pace[w.client_id] = pace  # as if measured from earlier results
        jobs = [lease(worker, live.coordinator.public_key) for _ in range(2)]
        results = [honest_result(live, j) for j in jobs]
        live.coordinator.issuing_paused = True
        answers: dict[str, LeaseResponse] = {}

        def wait_for_work(client: RawClient) -> None:
            status, raw = client.post("/v1/lease", LeaseRequest(backend="torch", held_version=0))
            assert status == 200, raw
            answers[client.client_id] = wire.decode(raw, LeaseResponse)

        threads = [threading.Thread(target=wait_for_work, args=(w,), daemon=True) for w in waiters]
        for thread in threads:
            thread.start()
        wait_until(lambda: all(w.client_id in live.coordinator.issuer.waiters.clients() for w in waiters), 30,
                   "three long-polls")
        for r in results:  # one batch: the learner trains and publishes version 1
            status, raw = worker.post("/v1/results", r)
            assert status == 200, raw
        for thread in threads[:2]:
            thread.join(20)  # well before the long-poll's own 25 s
        fast = [answers.get(w.client_id) for w in waiters[:2]]
        assert all(a is not None and a.current_version == 1 and a.job is None and a.paused for a in fast), fast
        assert all(a is not None and a.prefetch for a in fast)  # woken to pull the version: told to prefetch it
        status, _ = worker.get("/v1/status")  # served after the wake-up the version caused
        assert status == 200
        # not next in line: still waiting, and never told to prefetch
        assert threads[2].is_alive() and waiters[2].client_id in live.coordinator.issuer.waiters.clients()
        live.coordinator.issuing_paused = False
        threads[2].join(30)
        assert waiters[2].client_id in answers and not answers[waiters[2].client_id].prefetch


def test_a_refused_job_is_reissued_to_another_client(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A client whose result for a job was refused is not handed that job again (same seed, same version: an
    honest deterministic client would be refused again); the next client is."""
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1}
                             ) as live:
        first, second = register(live), register(live)
        job = lease(first, live.coordinator.public_key)
        bad = honest_result(live, job)
        c0 = bad.completions[0]
        bad = bad.model_copy(update={"completions": [
            c0.model_copy(update={"logprobs": [lp - 1.0 for lp in c0.logprobs]}), *bad.completions[1:]]})
        status, raw = first.post("/v1/results", bad)
        assert status == 422, raw
        status, _ = first.post("/v1/release", ReleaseRequest(job_id=job.job_id, lease_id=job.lease_id))
        assert status == 200
        other = lease(first, live.coordinator.public_key)
        assert other.job_id != job.job_id  # fresh work for the refused client ...
        assert lease(second, live.coordinator.public_key).job_id == job.job_id  # ... its job to the next one


def test_a_lease_that_runs_out_during_verification_is_honoured(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A result that arrived within its lease is accepted even if the lease ran out while the coordinator was
    verifying it (the delay was the coordinator's), and the job is not reissued to anyone meanwhile."""
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1}
                             ) as live:
        holder, other = register(live), register(live)
        job = lease(holder, live.coordinator.public_key)
        result = honest_result(live, job)
        service = live.coordinator
        recompute = service.intake.recompute_stats
        during: list[LeaseResponse] = []

        async def slow_recompute(*args: Any) -> TokenStats:  # while the result is being verified
            live.clock.advance(service.config.jobs.lease_timeout_s + 1.0)  # the lease has now run out
            during.append(await asyncio.to_thread(ask, other))  # served by the event loop meanwhile
            return await recompute(*args)

        service.intake.recompute_stats = slow_recompute  # type: ignore[method-assign,assignment]
        status, raw = holder.post("/v1/results", result)
        assert status == 200, raw
        assert during and during[0].job is not None
        assert open_job(during[0].job, service.public_key).job_id != job.job_id  # not reissued while verified
        assert db_rows(live.run_dir, f"SELECT state, lease_client FROM jobs WHERE job_id='{job.job_id}'") == [
            ("done", holder.client_id)]


@pytest.mark.parametrize("secret", [True, False])
def test_job_plans_are_keyed_with_the_runs_secret(tmp_path: Path, tiny_model_dir: Path, secret: bool) -> None:
    """jobs.secret_plans: the seed a leased job carries is not the one learner.seed alone gives for its number
    (so a client cannot compute a job's sampling key from its number), and the secret lives in the store."""
    from coordinator.core.jobs import plan_job

    with running_coordinator(tmp_path, tiny_model_dir, jobs={"secret_plans": secret}) as live:
        job = lease(register(live), live.coordinator.public_key)
        seq = int(job.job_id.removeprefix("j"))
        public = plan_job(live.coordinator.config.learner.seed, seq, len(live.coordinator.task.train),
                          live.coordinator.config.jobs.prompts_per_job)
        stored = db_rows(live.run_dir, "SELECT value FROM meta WHERE key='plan_secret'")
        if secret:
            assert job.seed != public.seed and len(stored) == 1 and len(stored[0][0]) == 32
        else:
            assert job.seed == public.seed and stored == []


def test_a_long_poll_behind_the_head_of_the_order_ends_with_a_reply_and_is_served_once_ahead(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Issue 32: of a waiting swarm only the head of rule 1's order re-checks (Issuer.waiters.in_window: 2·B·(S+1) =
    8 clients here); a client behind it waits without reading the queue. Its request still ends at the poll's end
    with the reply a decision gives (no job, not finished), and once the clients ahead of it have gone, its next
    request is served."""
    with running_coordinator(tmp_path, tiny_model_dir, top={"sync_mode": "async-push-pull", "max_staleness": 1},
                             jobs={"long_poll_s": 3.0}, limits={"max_leases_per_client": 16}) as live:
        issuer = live.coordinator.issuer
        worker = register(live)
        waiters = [register(live) for _ in range(9)]
        for pace, w in enumerate(waiters, start=1):
            issuer.pace[w.client_id] = float(pace)  # as if measured from earlier results
        jobs = [lease(worker, live.coordinator.public_key) for _ in range(4)]  # the queue is full
        answers: dict[str, LeaseResponse] = {}

        def wait_for_work(client: RawClient) -> None:
            answers[client.client_id] = ask(client)

        threads = [threading.Thread(target=wait_for_work, args=(w,), daemon=True) for w in waiters]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(answers) == 9 or all(w.client_id in issuer.waiters.clients() for w in waiters), 30,
                   "nine long-polls")
        if len(answers) < 9:  # all nine waited at once: the slowest stood behind the head
            assert not issuer.waiters.in_window(waiters[8].client_id)
            assert issuer.waiters.in_window(waiters[7].client_id)
        for thread in threads:
            thread.join(30)
        assert all(a.job is None and not a.finished for a in answers.values()) and len(answers) == 9
        live.clock.advance(31.0)  # the worker's leases expire: their jobs may be reissued
        resp = ask(waiters[8])  # alone now: the head of the order
        assert resp.job is not None
        assert open_job(resp.job, live.coordinator.public_key).job_id == jobs[0].job_id
