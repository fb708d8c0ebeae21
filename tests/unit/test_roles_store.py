"""The store as the meeting point of role processes (issue 12): the work queue between the API and the verifiers,
the schema version, the torch-free text codec, and snapshot indexing in a reading process."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from pathlib import Path

import pytest

from coordinator.core.verify import TokenStats
from coordinator.errors import VersionGone
from coordinator.run.workqueue import (
    Bell,
    RemoteVerifier,
    VerificationError,
    VerifierUnavailable,
)
from coordinator.store.hops import (
    EVALUATE,
    RECOMPUTE,
    EvaluateRequest,
    Hop,
    RecomputeAnswer,
    RecomputedStats,
    RecomputeRequest,
)
from coordinator.store.store import SCHEMA_VERSION, Store
from shared import wire
from shared.errors import ProtocolError


@pytest.fixture
def store(store_target: str | Path) -> Store:
    s = Store(store_target)
    yield s
    s.close()


def _req(token: int) -> RecomputeRequest:
    return RecomputeRequest(prompts=[[1]], completions=[[token]])


def test_claims_are_exclusive_and_expire_to_another_worker(store: Store) -> None:
    a = store.work.submit(RECOMPUTE, 3, _req(1), 0.0)
    b = store.work.submit(RECOMPUTE, 3, _req(2), 0.0)
    first = store.work.claim("verifier-0", (RECOMPUTE,), 1, until=100.0, now=10.0)
    assert [r["id"] for r in first] == [a]
    second = store.work.claim("verifier-1", (RECOMPUTE,), 5, until=1000.0, now=10.0)
    assert [r["id"] for r in second] == [b]  # a is held by verifier-0
    assert store.work.claim("verifier-1", (RECOMPUTE,), 5, until=100.0, now=50.0) == []
    # verifier-0 died: its claim runs out and verifier-1 takes the request
    taken = store.work.claim("verifier-1", (RECOMPUTE,), 5, until=300.0, now=150.0)
    assert [(r["id"], r["attempts"]) for r in taken] == [(a, 2)]
    assert RecomputeRequest.decode(taken[0]["request"]) == _req(1)
    assert not store.work.finish(a, "verifier-0", RecomputeAnswer(gone=True))  # the old holder can no longer answer
    assert store.work.finish(a, "verifier-1", RecomputeAnswer(gone=False))
    assert RecomputeAnswer.decode(store.work.item(a)["answer"]) == RecomputeAnswer(gone=False)


def test_a_restarted_worker_hands_back_its_claims_at_once(store: Store) -> None:
    a = store.work.submit(RECOMPUTE, 1, _req(1), 0.0)
    store.work.claim("verifier-0", (RECOMPUTE,), 4, until=1e12, now=1.0)
    assert store.work.claim("verifier-1", (RECOMPUTE,), 4, until=1e12, now=2.0) == []
    assert store.work.unclaim("verifier-0") == 1
    assert [r["id"] for r in store.work.claim("verifier-1", (RECOMPUTE,), 4, until=1e12, now=3.0)] == [a]


def test_kinds_are_claimed_only_by_workers_that_take_them(store: Store) -> None:
    store.work.submit(EVALUATE, 2, EvaluateRequest(), 0.0)
    assert store.work.claim("verifier-1", (RECOMPUTE,), 4, until=10.0, now=1.0) == []
    assert len(store.work.claim("verifier-0", (RECOMPUTE, EVALUATE), 4, until=10.0, now=1.0)) == 1


def test_the_work_table_takes_only_its_kinds_records(store: Store) -> None:
    """Issue 33: a request or answer built by hand — a dict, its msgpack bytes, or another kind's record — is
    refused before anything is written, so a worker never meets a shape its kind does not declare."""
    hand_built = {"prompts": [[1]], "completions": [[2]]}
    for wrong in (hand_built, wire.pack(hand_built), EvaluateRequest()):
        with pytest.raises(TypeError, match="the recompute kind takes a RecomputeRequest, not a (dict|bytes|EvaluateRequest)"):
            store.work.submit(RECOMPUTE, 0, wrong, 0.0)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="the evaluate kind takes a EvaluateRequest, not a bytes"):
        store.work.submit(EVALUATE, 0, wire.pack({}), 0.0)  # type: ignore[type-var]
    assert store.work.counts() == {}
    item = store.work.submit(RECOMPUTE, 0, _req(3), 0.0)
    store.work.claim("verifier-0", (RECOMPUTE,), 1, until=1e12, now=1.0)
    for answer in ({"gone": True}, wire.pack({"gone": True})):
        with pytest.raises(TypeError, match="a work answer is a record"):
            store.work.finish(item, "verifier-0", answer)  # type: ignore[arg-type]
    assert store.work.counts() == {"claimed": 1}  # still unanswered
    # and a record decodes only as what it is: a misspelt or missing field is refused, never read as a default
    with pytest.raises(ProtocolError, match="RecomputeRequest"):
        RecomputeRequest.decode(wire.pack({"prompts": [[1]], "completion": [[2]]}))
    assert isinstance(RecomputeAnswer.decode(RecomputeAnswer(gone=True).encode()), Hop)


def test_a_database_from_a_newer_release_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer echo-swarm"):
        Store(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()


def test_schema_version_is_recorded(store: Store) -> None:
    assert store.schema_version() == SCHEMA_VERSION


def test_a_signed_request_never_waits_for_the_main_databases_write_lock(tmp_path: Path) -> None:
    """SQLite: nonces live in their own file, so another role holding the main write lock (through a long fsync,
    say) does not delay remembering a nonce, and a replay is still refused."""
    store = Store(tmp_path / "coordinator.sqlite")
    other = sqlite3.connect(store.path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")  # another process in the middle of a commit
    try:
        assert store.nonces.remember(b"n" * 16, expires=100.0)
        assert not store.nonces.remember(b"n" * 16, expires=100.0)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            probe = sqlite3.connect(store.path, isolation_level=None, timeout=0)
            probe.execute("BEGIN IMMEDIATE")  # the main database really was locked
    finally:
        other.execute("ROLLBACK")
        other.close()
        store.close()
    assert store.nonce_path.exists() and store.nonce_path != store.path


def test_schema_3_nonces_move_to_their_own_file_and_still_refuse_a_replay(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    Store(path).close()
    conn = sqlite3.connect(path)  # as schema 3 left it: nonces inside the main database
    conn.execute("CREATE TABLE nonces(nonce BLOB PRIMARY KEY, expires REAL NOT NULL)")
    conn.execute("INSERT INTO nonces VALUES (?, ?)", (b"seen-before-upgrade", 1e12))
    conn.execute("PRAGMA user_version=3")
    conn.commit()
    conn.close()
    store = Store(path)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        assert not store.nonces.remember(b"seen-before-upgrade", 1e12)
        assert not store.conn.has_table("nonces")
    finally:
        store.close()


def _answer_with(store: Store, bell: Bell, answer: RecomputeAnswer | None, error: str | None = None
                 ) -> asyncio.Task[None]:
    async def worker() -> None:
        while not (rows := store.work.claim("verifier-0", (RECOMPUTE,), 1, until=1e12, now=1.0)):
            await bell.wait(0.01)
        store.work.finish(int(rows[0]["id"]), "verifier-0", answer, error)
        bell.ring()

    return asyncio.get_running_loop().create_task(worker())


def test_remote_verifier_returns_the_workers_stats_and_cleans_up(store: Store) -> None:
    stats = TokenStats(logprobs=[[-0.5, -1.25]], entropy=[[1.0, 2.0]], variance=[[0.1, 0.2]], top=[[-0.1, -0.2]])

    async def go() -> TokenStats:
        bell = Bell()
        remote = RemoteVerifier(store, bell, wait_s=30)
        task = _answer_with(store, bell, RecomputeAnswer(stats=RecomputedStats.of(stats)))
        out = await remote.recompute_stats([[1, 2]], [[3, 4]], 0)
        await task
        return out

    assert asyncio.run(go()) == stats
    assert store.work.counts() == {}  # the answered request is gone


def test_remote_verifier_maps_gone_failed_and_silent_workers(store: Store) -> None:
    async def ask(answer: RecomputeAnswer | None, error: str | None = None, wait_s: float = 30) -> None:
        bell = Bell()
        remote = RemoteVerifier(store, bell, wait_s=wait_s)
        task = _answer_with(store, bell, answer, error) if (answer or error) else None
        try:
            await remote.recompute_stats([[1]], [[2]], 5)
        finally:
            if task is not None:
                await task

    with pytest.raises(VersionGone):
        asyncio.run(ask(RecomputeAnswer(gone=True)))
    with pytest.raises(VerificationError, match="boom"):
        asyncio.run(ask(None, "RuntimeError: boom"))
    with pytest.raises(VerifierUnavailable):
        asyncio.run(ask(None, wait_s=0.2))  # no worker at all
    assert store.work.counts() == {}


def test_text_codec_matches_transformers_without_torch(tiny_model_dir: Path) -> None:
    import random
    import subprocess

    from coordinator.tasks.text import TextCodec
    from shared.policy import load_tokenizer, stop_token_ids

    probe = ("import sys; from coordinator.tasks.text import TextCodec; "
             f"c = TextCodec.from_folder({str(tiny_model_dir)!r}); c.decode(c.encode('1+2=')); "
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
    codec = TextCodec.from_folder(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    for text in ("12+34=", "What is 5 + 7? ", " spaces  and\nlines "):
        assert codec.encode(text) == list(tok.encode(text))
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(codec.vocab_size) for _ in range(24)]
        assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert codec.stop_ids == stop_token_ids(tok)


def test_a_role_with_another_coordinator_key_is_refused(store: Store, tmp_path: Path) -> None:
    """Roles on several hosts share the store: the first records the run's public key; a host whose
    coordinator.key was created there instead of copied refuses to start, saying what to copy."""
    from coordinator.run.runfiles import KeyMismatch, _same_key

    _same_key(store, "aa" * 32, tmp_path)
    _same_key(store, "aa" * 32, tmp_path)  # the same key again: fine
    with pytest.raises(KeyMismatch, match="copy coordinator.key"):
        _same_key(store, "bb" * 32, tmp_path)


def test_store_url_must_name_postgresql() -> None:
    from coordinator.config import CoordinatorConfig

    with pytest.raises(ValueError, match="postgresql://"):
        CoordinatorConfig.model_validate({"store": {"url": "mysql://db/run"}})
    assert CoordinatorConfig.model_validate({"store": {"url": ""}}).store.url is None
