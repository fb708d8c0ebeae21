"""Snapshot downloads by a client: signed manifest, sha256 per file, resumable transfers, corruption caught
(moved from tests/integration: the interrupted and corrupted downloads are fault cases)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shared import wire
from shared.errors import IntegrityError
from shared.hashing import sha256_bytes
from shared.messages import SignedManifest
from shared.records import open_manifest
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.identity import load_identity
from swarm_client.snapshots import SnapshotCache
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient, db_rows, wait_until


def _manifest(live: LiveCoordinator, version: int = 0) -> tuple[bytes, str]:
    status, raw = RawClient(live.url).get(f"/v1/snapshots/{version}")
    assert status == 200
    signed = wire.decode(raw, SignedManifest)
    _, sha = open_manifest(signed, live.coordinator.public_key)
    return raw, sha


def _ensure(live: LiveCoordinator, home: Path, manifest_sha: str) -> tuple[Path, int]:
    async def go() -> tuple[Path, int]:
        client = CoordinatorClient(live.url, load_identity(home), retry=RetryPolicy(attempts=2, base_s=0.01))
        try:
            cache = SnapshotCache(home / "cache", client, live.coordinator.public_key)
            folder = await cache.ensure(live.coordinator.run_id, 0, manifest_sha)
            return folder, cache.bytes_downloaded
        finally:
            await client.close()

    return asyncio.run(go())


def test_snapshot_is_verified_assembled_and_cached(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    _, sha = _manifest(live_coordinator)
    folder, downloaded = _ensure(live_coordinator, tmp_path / "home", sha)
    served = live_coordinator.run_dir / "snapshots" / "v000000"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == (served / name).read_bytes()
    assert downloaded == sum(p.stat().st_size for p in served.iterdir() if p.name != "manifest.msgpack")
    _, again = _ensure(live_coordinator, tmp_path / "home", sha)
    assert again == 0  # second time: from the cache


def test_interrupted_download_resumes_with_a_range_request(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    _, sha = _manifest(live_coordinator)
    weights = (live_coordinator.run_dir / "snapshots" / "v000000" / "model.safetensors").read_bytes()
    blobs = tmp_path / "home" / "cache" / "blobs"
    blobs.mkdir(parents=True)
    half = len(weights) // 2
    (blobs / f"{sha256_bytes(weights)}.partial").write_bytes(weights[:half])
    folder, downloaded = _ensure(live_coordinator, tmp_path / "home", sha)
    assert (folder / "model.safetensors").read_bytes() == weights
    total = sum(p.stat().st_size for p in folder.iterdir() if not p.name.startswith("."))
    assert downloaded == total - half


def test_corrupted_download_is_detected_and_never_used(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    _, sha = _manifest(live_coordinator)
    served = live_coordinator.run_dir / "snapshots" / "v000000" / "model.safetensors"
    good = served.read_bytes()
    # published files are never rewritten in place by the coordinator; this test does it, so first let the
    # evaluator finish reading version 0 (a reader of a file truncated under it may fault)
    wait_until(lambda: db_rows(live_coordinator.run_dir, "SELECT COUNT(*) FROM evals WHERE version=0") == [(1,)],
               120, "the evaluation of version 0")
    served.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # the bytes on the wire no longer match the manifest
    try:
        with pytest.raises(IntegrityError):
            _ensure(live_coordinator, tmp_path / "home", sha)
        snapshots = tmp_path / "home" / "cache" / "snapshots"
        assert not any(snapshots.rglob("model.safetensors"))
        assert not (tmp_path / "home" / "cache" / "blobs" / sha256_bytes(good)).exists()
    finally:
        served.write_bytes(good)
    folder, _ = _ensure(live_coordinator, tmp_path / "home", sha)  # fetched again, now verified
    assert (folder / "model.safetensors").read_bytes() == good


def test_manifest_not_matching_the_job_is_refused(live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    with pytest.raises(IntegrityError):
        _ensure(live_coordinator, tmp_path / "home", "0" * 64)


def test_prefetch_and_job_fetch_of_one_version_share_one_download(live_coordinator: LiveCoordinator,
                                                                   tmp_path: Path) -> None:
    _, sha = _manifest(live_coordinator)
    home = tmp_path / "home"

    async def go() -> tuple[list[Path], int]:
        client = CoordinatorClient(live_coordinator.url, load_identity(home), retry=RetryPolicy(attempts=2))
        try:
            cache = SnapshotCache(home / "cache", client, live_coordinator.coordinator.public_key)
            run_id = live_coordinator.coordinator.run_id
            folders = await asyncio.gather(cache.ensure(run_id, 0, None), cache.ensure(run_id, 0, sha))
            return list(folders), cache.bytes_downloaded
        finally:
            await client.close()

    (prefetched, for_job), downloaded = asyncio.run(go())
    assert prefetched == for_job and (for_job / ".complete").exists()
    served = live_coordinator.run_dir / "snapshots" / "v000000"
    assert downloaded == sum(p.stat().st_size for p in served.iterdir() if p.name != "manifest.msgpack")


def test_cache_cap_prunes_least_recently_used_and_precheck_runs_before_download(
        live_coordinator: LiveCoordinator, tmp_path: Path) -> None:
    import os

    from shared.messages import Manifest

    _, sha = _manifest(live_coordinator)
    home = tmp_path / "home"
    blobs, models = home / "cache" / "blobs", home / "cache" / "snapshots"
    old = models / "an-older-run" / "v000003"  # left over from another run, used long ago
    old.mkdir(parents=True)
    blobs.mkdir(parents=True)
    (blobs / ("f" * 64)).write_bytes(b"x" * 4096)
    os.link(blobs / ("f" * 64), old / "model.safetensors")
    (old / ".complete").write_text("")
    seen: list[tuple[int, int]] = []

    def precheck(manifest: Manifest, missing: int) -> None:
        assert not any(p.name.endswith(".partial") for p in blobs.iterdir())  # nothing fetched yet
        seen.append((sum(f.size for f in manifest.files), missing))

    async def go() -> Path:
        client = CoordinatorClient(live_coordinator.url, load_identity(home), retry=RetryPolicy(attempts=2))
        try:
            cache = SnapshotCache(home / "cache", client, live_coordinator.coordinator.public_key,
                                  max_bytes=1, precheck=precheck)
            return await cache.ensure(live_coordinator.coordinator.run_id, 0, sha)
        finally:
            await client.close()

    folder = asyncio.run(go())
    ((total, missing),) = seen
    assert missing == total > 0  # nothing of this version was cached
    assert not old.exists() and not (blobs / ("f" * 64)).exists()  # over the cap: the LRU folder went
    assert (folder / ".complete").exists()  # the folder just fetched stays even though it exceeds the cap


def test_two_runs_fetching_the_same_file_into_one_cache_at_once(live_coordinator: LiveCoordinator,
                                                                 tmp_path: Path) -> None:
    """A `join --attach` client's runs each have a cache object over one folder (swarm_client/multirun.py), and two
    coordinators of one base model serve the same files: both fetching them at once wrote one partial file together
    (the second rename failed, FileNotFoundError, and the client died). Now one downloads, the other waits for it,
    and every byte crosses the link once."""
    _, sha = _manifest(live_coordinator)
    home = tmp_path / "home"
    load_identity(home)

    async def go() -> tuple[list[Path], list[int]]:
        clients = [CoordinatorClient(live_coordinator.url, load_identity(home), retry=RetryPolicy(attempts=2,
                                                                                                   base_s=0.01))
                   for _ in range(2)]
        try:
            caches = [SnapshotCache(home / "cache", c, live_coordinator.coordinator.public_key) for c in clients]
            folders = await asyncio.gather(*(c.ensure(live_coordinator.coordinator.run_id, 0, sha) for c in caches))
            return list(folders), [c.bytes_downloaded for c in caches]
        finally:
            for c in clients:
                await c.close()

    folders, downloaded = asyncio.run(go())
    served = live_coordinator.run_dir / "snapshots" / "v000000"
    assert folders[0] == folders[1]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folders[0] / name).read_bytes() == (served / name).read_bytes()
    assert sum(downloaded) == sum(p.stat().st_size for p in served.iterdir() if p.name != "manifest.msgpack")
    assert not list((home / "cache" / "blobs").glob("*.partial"))
