"""Prefetch by need (issue 14): the join loop fetches a newer version ahead of a job only when a lease reply
says ``prefetch`` (the coordinator expects this client to work on it next); otherwise a version is fetched when
a job needs it. The real ``Runner._serve`` loop runs against the fakes of client_fakes.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from swarm_client.identity import Identity
from swarm_client.runner import JoinConfig, Runner

from .client_fakes import RecordingCache, make_client, reply, serve
from .factories import SHA


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Runner, Identity]:
    return make_client(tmp_path / "home", monkeypatch)


# ---- the join loop ---------------------------------------------------------------------------------------
def test_idle_client_not_asked_to_prefetch_downloads_nothing(client: tuple[Runner, Identity]) -> None:
    runner, identity = client
    # an idle swarm hears of versions 1, 2, 3 in turn; this client is never the one expected to work next
    coordinator, cache = serve(runner, identity, [reply(1), reply(2), reply(3)])
    assert cache.fetches == []
    assert coordinator.held == [-1, -1, -1, -1]  # it never claims a version it did not fetch
    assert runner.downloads.prefetch is None and runner.downloads.ready_version == -1


def test_woken_idle_client_pulls_the_version_before_asking_again(client: tuple[Runner, Identity]) -> None:
    runner, identity = client
    coordinator, cache = serve(runner, identity, [reply(1), reply(2, prefetch=True)])
    assert cache.fetches == [(2, None)]  # a prefetch: any manifest the coordinator signed for version 2
    assert coordinator.held == [-1, -1, 2]  # the next lease request holds the pulled version
    assert runner.downloads.ready_version == 2


def test_job_for_a_newer_version_fetches_only_what_the_job_needs(client: tuple[Runner, Identity]) -> None:
    runner, identity = client
    cid = identity.client_id
    # the reply announces version 3 but carries a job bound to version 2, with prefetch unset
    coordinator, cache = serve(runner, identity, [reply(3, job_version=2, client_id=cid)])
    assert cache.fetches == [(2, SHA)]  # the job's own version, pinned to the job's manifest hash; never 3
    assert coordinator.held == [-1, 2]
    assert coordinator.submitted == [2]


def test_prefetch_alongside_a_job_runs_in_the_background(client: tuple[Runner, Identity]) -> None:
    runner, identity = client
    cid = identity.client_id
    coordinator, cache = serve(runner, identity, [reply(3, prefetch=True, job_version=2, client_id=cid)])
    assert sorted(cache.fetches, key=lambda f: f[0]) == [(2, SHA), (3, None)]
    assert runner.downloads.ready_version == 3
    assert coordinator.held[-1] == 3  # the next lease holds the prefetched version


def test_prefetch_of_a_version_already_held_fetches_nothing(client: tuple[Runner, Identity]) -> None:
    runner, identity = client
    cid = identity.client_id
    coordinator, cache = serve(runner, identity, [reply(2, job_version=2, client_id=cid), reply(2, prefetch=True)])
    assert cache.fetches == [(2, SHA)]
    assert coordinator.held == [-1, 2, 2]


# ---- the decision itself -----------------------------------------------------------------------------------
def test_a_prefetch_asked_for_while_another_runs_follows_it(tmp_path: Path) -> None:
    runner = Runner(JoinConfig(url="http://coordinator.invalid", home=tmp_path, benchmark=False, panel=False))
    cache = RecordingCache(tmp_path)

    async def go() -> None:
        cache.hold[3] = asyncio.Event()
        assert runner.downloads.consider(reply(3, prefetch=True), 1, cache, "run-1")  # type: ignore[arg-type]
        first = runner.downloads.prefetch
        assert await cache.entered.get() == 3  # the fetch of version 3 is in progress (held)
        assert runner.downloads.consider(reply(4, prefetch=True), 1, cache, "run-1")  # type: ignore[arg-type]
        assert runner.downloads.prefetch is first  # one prefetch at a time: no second download races the first
        assert not runner.downloads.consider(reply(5), 1, cache, "run-1")  # type: ignore[arg-type]
        cache.hold[3].set()
        assert first is not None
        await first
        assert cache.fetches == [(3, None), (4, None)]  # 4 followed 3; 5 (not asked for) was never fetched
        assert runner.downloads.ready_version == 4

    asyncio.run(go())


def test_a_failed_prefetch_is_retried_by_the_next_reply_that_asks(tmp_path: Path) -> None:
    runner = Runner(JoinConfig(url="http://coordinator.invalid", home=tmp_path, benchmark=False, panel=False))
    cache = RecordingCache(tmp_path)

    async def go() -> None:
        cache.fail.add(3)
        assert runner.downloads.consider(reply(3, prefetch=True), 1, cache, "run-1")  # type: ignore[arg-type]
        assert runner.downloads.prefetch is not None
        assert await runner.downloads.prefetch is None  # only logged
        assert runner.downloads.ready_version == -1
        cache.fail.clear()
        assert runner.downloads.consider(reply(3, prefetch=True), 1, cache, "run-1")  # type: ignore[arg-type]
        await runner.downloads.prefetch
        assert runner.downloads.ready_version == 3 and cache.fetches == [(3, None), (3, None)]

    asyncio.run(go())


def test_reply_without_prefetch_starts_nothing(tmp_path: Path) -> None:
    runner = Runner(JoinConfig(url="http://coordinator.invalid", home=tmp_path, benchmark=False, panel=False))
    cache = RecordingCache(tmp_path)

    async def go() -> None:
        assert not runner.downloads.consider(reply(9), -1, cache, "run-1")  # type: ignore[arg-type]
        assert not runner.downloads.consider(reply(2, prefetch=True), 2, cache, "run-1")  # type: ignore[arg-type]
        assert runner.downloads.prefetch is None and cache.fetches == []

    asyncio.run(go())
