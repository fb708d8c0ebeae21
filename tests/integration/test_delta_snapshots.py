"""A client rebuilding versions from patches (issue 23), against the coordinator's own snapshot handlers on a real
aiohttp server over loopback and a real snapshot store: one patch, a chain of patches, and patches that are corrupt
or built on another base, which are refused for the full file (nothing half-applied is used)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import web

from coordinator.api.app import COORDINATOR, INTERNAL_ERRORS, blob, errors_middleware, snapshot_manifest
from coordinator.core.ratelimit import BurstLog
from coordinator.publish.deltas import layout
from coordinator.publish.snapshots import MANIFEST_FILE, SnapshotStore
from shared import crypto, wire
from shared.deltas import encode
from shared.hashing import sha256_file
from shared.messages import Manifest, ManifestFile, SignedManifest
from shared.records import manifest_file, sign_manifest
from swarm_client.api import CoordinatorClient, RetryPolicy
from swarm_client.snapshots import SnapshotCache
from tests.unit.test_deltas import _save_bf16, _weights

KEY = crypto.generate_key()


def _publish(store: SnapshotStore, versions: range, lr: float = 1e-4) -> None:
    for v in versions:
        def write(folder: Path, v: int = v) -> None:
            _save_bf16(folder / "model.safetensors", _weights(0, v, lr))
            (folder / "config.json").write_text('{"model_type": "qwen2"}')

        store.publish(v, write, now=1.0)


def _entries(store: SnapshotStore, version: int) -> dict[str, ManifestFile]:
    signed = store.signed_manifest(version)
    assert signed is not None
    return {f.path: f for f in wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files}


@asynccontextmanager
async def _serving(store: SnapshotStore, current: int) -> AsyncIterator[str]:
    app = web.Application(middlewares=[errors_middleware])
    # the two snapshot endpoints of the API with its error middleware; no budgets (one client, a few requests)
    app[COORDINATOR] = SimpleNamespace(snapshots=store, version=current, clock=time.time,  # type: ignore[assignment]
                                       guard=SimpleNamespace(check_address=lambda address, now: None))
    app[INTERNAL_ERRORS] = BurstLog(60.0)
    app.router.add_get("/v1/snapshots/{version}", snapshot_manifest)
    app.router.add_get("/v1/blobs/{sha256}", blob)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class RecordingPeers:
    """Stands in for `join --p2p`'s ClientPeer: records what the cache asks peers for and announces; delivers no
    byte (so HTTP fetches the rest, as after a p2p deadline)."""

    def __init__(self) -> None:
        self.asked: list[ManifestFile] = []
        self.announced: list[str] = []

    async def fetch(self, file: ManifestFile, partial: Path, on_bytes: Callable[[int], None],
                    digest: object = None) -> None:
        self.asked.append(file)

    async def announce(self, sha256s: list[str]) -> None:
        self.announced.extend(sha256s)

    async def announce_pending(self) -> None:
        pass


def _fetch(store: SnapshotStore, home: Path, versions: list[int], between: Callable[[int], None] = lambda v: None,
           peers: RecordingPeers | None = None, forms: frozenset[str] = frozenset({"hf"})
           ) -> tuple[SnapshotCache, list[Path], list[int]]:
    """Fetch ``versions`` in order with one client cache of ``forms`` (a torch client's by default; a llama.cpp
    client's: swarm_client.backends.llama_backend.GGUF_FORMS); the bytes downloaded for each."""
    async def go() -> tuple[SnapshotCache, list[Path], list[int]]:
        async with _serving(store, max(versions)) as url:
            client = CoordinatorClient(url, None, retry=RetryPolicy(attempts=2, base_s=0.01))
            try:
                cache = SnapshotCache(home, client, crypto.public_bytes(KEY), forms=forms)
                cache.peers = peers  # type: ignore[assignment]
                folders, downloaded = [], []
                for v in versions:
                    between(v)
                    before = cache.bytes_downloaded
                    folders.append(await cache.ensure("run", v, None))
                    downloaded.append(cache.bytes_downloaded - before)
                return cache, folders, downloaded
            finally:
                await client.close()

    return asyncio.run(go())


def _store(tmp: Path, anchor_every: int | None = 100) -> SnapshotStore:
    return SnapshotStore(tmp / "snapshots", KEY, "run", anchor_every=anchor_every)


def _same_as_published(store: SnapshotStore, version: int, folder: Path) -> None:
    entries = _entries(store, version)
    assert sha256_file(folder / "model.safetensors") == entries["model.safetensors"].sha256
    assert not (folder / "model.safetensors.delta").exists()  # patches are never part of a model folder


def test_a_client_holding_the_previous_version_downloads_only_the_patch(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(2))
    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 1])
    full, delta = _entries(store, 1)["model.safetensors"], _entries(store, 1)["model.safetensors.delta"]
    _same_as_published(store, 1, folders[1])
    assert downloaded[1] == delta.size < full.size / 2  # config.json is the same file: cached already
    assert cache.patches.patched == 1 and cache.patches.patches_refused == 0
    assert not list((tmp_path / "home" / "blobs").glob("*.rebuild"))


def test_a_client_that_missed_versions_takes_the_chain_when_it_is_smaller(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(4))
    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 3])
    deltas = [_entries(store, v)["model.safetensors.delta"].size for v in (1, 2, 3)]
    _same_as_published(store, 3, folders[1])
    assert downloaded[1] == sum(deltas) and cache.patches.patched == 3


def test_a_chain_larger_than_the_full_file_is_not_taken(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(6), lr=3e-3)  # big steps: each patch is a large share of the file
    full = _entries(store, 5)["model.safetensors"].size
    deltas = [_entries(store, v)["model.safetensors.delta"].size for v in range(1, 6)]
    assert sum(deltas) > full  # the premise
    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 5])
    _same_as_published(store, 5, folders[1])
    assert downloaded[1] == full and cache.patches.patched == 0


def test_an_anchor_is_fetched_whole_even_by_a_client_holding_the_previous_version(tmp_path: Path) -> None:
    store = _store(tmp_path, anchor_every=2)
    _publish(store, range(3))
    cache, folders, downloaded = _fetch(store, tmp_path / "home", [1, 2])
    assert downloaded[1] == _entries(store, 2)["model.safetensors"].size and cache.patches.patched == 0
    _same_as_published(store, 2, folders[1])


def test_a_patch_pruned_while_the_client_walks_its_chain_falls_back_to_the_full_file(tmp_path: Path) -> None:
    """The coordinator prunes old versions while clients download: a patch of the chain that is gone by the time
    it is asked for (HTTP 404) is no fault of anyone's; the full file is fetched instead (it once stopped the
    download with DownloadStalled)."""
    store = _store(tmp_path)
    _publish(store, range(4))

    def prune_v1_patch(v: int) -> None:
        if v == 3:  # v1's manifest is still served (the chain walks it), its patch no longer is
            (store.folder(1) / "model.safetensors.delta").unlink()

    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 3], between=prune_v1_patch)
    _same_as_published(store, 3, folders[1])
    assert cache.patches.patched == 0 and cache.patches.patches_refused == 0  # not a bad patch: an absent one
    assert downloaded[1] == _entries(store, 3)["model.safetensors"].size


def test_a_base_pruned_from_the_cache_during_the_rebuild_falls_back_to_the_full_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's own cache prunes an old version (a prefetch of another version finished) after the chain was
    walked and before the patch is applied: its base file is gone. The full file is fetched instead (this once
    ended the client with FileNotFoundError, seen with two runs on one machine: tests/integration/test_shares.py)."""
    from swarm_client import snapshot_patches

    real = snapshot_patches.apply_patch

    def base_gone(base: Path, *args: object, **kwargs: object) -> str:
        base.unlink()
        return real(base, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshot_patches, "apply_patch", base_gone)
    store = _store(tmp_path)
    _publish(store, range(2))
    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 1])
    _same_as_published(store, 1, folders[1])
    assert cache.patches.patched == 0 and cache.patches.patches_refused == 0  # not a bad patch: an absent base
    assert downloaded[1] >= _entries(store, 1)["model.safetensors"].size


def test_a_corrupted_patch_is_refused_and_the_full_file_fetched(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(2))
    patch = store.folder(1) / "model.safetensors.delta"

    def corrupt(v: int) -> None:
        if v == 1:  # the bytes served no longer match the manifest's sha256 for the patch
            data = bytearray(patch.read_bytes())
            data[len(data) // 2] ^= 0xFF
            patch.write_bytes(bytes(data))

    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 1], between=corrupt)
    _same_as_published(store, 1, folders[1])
    assert cache.patches.patched == 0 and cache.patches.patches_refused == 1
    assert downloaded[1] == _entries(store, 1)["model.safetensors"].size + 3 * patch.stat().st_size  # 3 tries
    assert not list((tmp_path / "home" / "blobs").glob("*.rebuild"))


def test_a_signed_patch_built_on_another_base_is_refused_and_the_full_file_fetched(tmp_path: Path) -> None:
    """The coordinator signed it, so it verifies as a file: only the rebuilt file's sha256 can catch it."""
    store = _store(tmp_path)
    _publish(store, range(3))
    e1, e2 = _entries(store, 1), _entries(store, 2)
    bad = store.folder(2) / "model.safetensors.delta"
    # v0 → v2's bytes, but claiming v1 as its base: applied to v1 it rebuilds neither file
    encode(store.blob_path(_entries(store, 0)["model.safetensors"].sha256), store.folder(2) / "model.safetensors",  # type: ignore[arg-type]
           layout(store.folder(2) / "model.safetensors"), base_sha256=e1["model.safetensors"].sha256,
           result_sha256=e2["model.safetensors"].sha256, out=bad)
    files = [f for f in e2.values() if f.form != "delta"] + [
        manifest_file(bad, base_sha256=e1["model.safetensors"].sha256, result_sha256=e2["model.safetensors"].sha256)]
    manifest = Manifest(protocol=5, run_id="run", version=2, created_at=1.0, format="hf-safetensors",
                        files=sorted(files, key=lambda f: f.path))
    (store.folder(2) / MANIFEST_FILE).write_bytes(wire.encode(sign_manifest(KEY, manifest)))
    store = _store(tmp_path)
    store.reconcile([0, 1, 2])  # a restarted coordinator serving the re-signed manifest

    cache, folders, downloaded = _fetch(store, tmp_path / "home", [1, 2])
    _same_as_published(store, 2, folders[1])
    assert cache.patches.patched == 0 and cache.patches.patches_refused == 1
    assert downloaded[1] == bad.stat().st_size + e2["model.safetensors"].size
    blobs = tmp_path / "home" / "blobs"
    assert not list(blobs.glob("*.rebuild"))
    assert {p.name for p in blobs.iterdir() if len(p.name) == 64} >= {e2["model.safetensors"].sha256}
    assert all(sha256_file(p) == p.name for p in blobs.iterdir() if len(p.name) == 64)  # only verified files


def test_a_small_step_changes_few_bf16_bytes_and_its_patch_is_under_5_percent(tmp_path: Path) -> None:
    """What makes patches small: at lr 1e-6 few f32 weights cross a bf16 rounding boundary."""
    store = _store(tmp_path)
    _publish(store, range(2), lr=1e-6)
    a = np.frombuffer(store.folder(0).joinpath("model.safetensors").read_bytes(), np.uint8)
    b = np.frombuffer(store.folder(1).joinpath("model.safetensors").read_bytes(), np.uint8)
    changed = np.count_nonzero(a != b) / a.size
    share = _entries(store, 1)["model.safetensors.delta"].size / b.size
    assert 0 < changed < 0.1 and share < 0.05


def test_a_chain_through_a_pruned_version_falls_back_to_the_full_file(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(4))

    def prune(v: int) -> None:
        if v == 3:  # the client holds v0; v1 and v2 are gone: v3's patch cannot be reached from it
            store.prune({0, 3})

    cache, folders, downloaded = _fetch(store, tmp_path / "home", [0, 3], between=prune)
    _same_as_published(store, 3, folders[1])
    assert downloaded[1] == _entries(store, 3)["model.safetensors"].size and cache.patches.patched == 0
    assert cache.patches.patches_refused == 0  # no patch was tried: the chain was never complete


def test_with_p2p_a_patch_is_asked_of_peers_piece_by_piece_and_the_rebuilt_file_announced(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _publish(store, range(2))
    peers = RecordingPeers()
    cache, folders, _ = _fetch(store, tmp_path / "home", [0, 1], peers=peers)
    delta, full = _entries(store, 1)["model.safetensors.delta"], _entries(store, 1)["model.safetensors"]
    assert delta in peers.asked and delta.pieces  # peers first, each piece checked against these hashes
    assert full not in peers.asked  # the full file was not needed
    assert full.sha256 in peers.announced and delta.sha256 in peers.announced  # served to others from now on
    _same_as_published(store, 1, folders[1])
