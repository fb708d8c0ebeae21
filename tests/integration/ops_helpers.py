"""Protocol steps shared by the integration tests (refusals, issuance, admin API, /metrics, status page):
register a raw client, lease a job, generate an honest result with the real torch backend, submit it."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shared import wire
from shared.messages import (
    Job,
    LeaseRequest,
    LeaseResponse,
    Manifest,
    RegisterRequest,
    ResultSubmission,
    SignedManifest,
)
from shared.records import open_job, open_manifest
from swarm_client.backends.torch_backend import TorchBackend
from swarm_client.hardware import profile
from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import RawClient


def register(live: LiveCoordinator, name: str = "test") -> RawClient:
    return register_at(live.url, name)


def register_at(url: str, name: str = "test") -> RawClient:
    """A raw client registered with the coordinator at ``url`` (one in another process, too)."""
    client = RawClient(url)
    status, raw = client.post("/v1/register", RegisterRequest(public_key=client.public_key,
                                                              profile=profile("torch", "cpu", name)))
    assert status == 200, raw
    return client


def try_lease(client: RawClient, coordinator_key: bytes) -> Job | None:
    status, raw = client.post("/v1/lease", LeaseRequest(backend="torch", held_version=-1))
    assert status == 200, raw
    resp = wire.decode(raw, LeaseResponse)
    return None if resp.job is None else open_job(resp.job, coordinator_key)


def lease(client: RawClient, coordinator_key: bytes) -> Job:
    job = try_lease(client, coordinator_key)
    assert job is not None, "expected a job to be available"
    return job


def fetch_snapshot(live: LiveCoordinator, version: int) -> int:
    """Download a version's signed manifest and every file, as a client would; returns the bytes fetched."""
    raw_client = RawClient(live.url)
    status, raw = raw_client.get(f"/v1/snapshots/{version}")
    assert status == 200
    manifest, _ = open_manifest(wire.decode(raw, SignedManifest), live.coordinator.public_key)
    assert isinstance(manifest, Manifest)
    total = len(raw)
    for f in manifest.files:
        status, data = raw_client.get(f"/v1/blobs/{f.sha256}")
        assert status == 200
        total += len(data)
    return total


def honest_result(live: LiveCoordinator, job: Job) -> ResultSubmission:
    """What an honest torch client returns for ``job``: the version's signed manifest is checked first."""
    return honest_result_at(live.url, live.coordinator.public_key, live.run_dir, job)


def honest_result_at(url: str, coordinator_key: bytes, run_dir: Path, job: Job) -> ResultSubmission:
    """:func:`honest_result` for a coordinator at ``url`` with its key and run directory."""
    status, raw = RawClient(url).get(f"/v1/snapshots/{job.version}")
    assert status == 200
    manifest, _ = open_manifest(wire.decode(raw, SignedManifest), coordinator_key)
    assert isinstance(manifest, Manifest)
    backend = TorchBackend(device="cpu", threads=1)
    backend.load(run_dir / "snapshots" / f"v{job.version:06d}")
    samples = backend.generate(job, lambda: False)
    return ResultSubmission(
        job_id=job.job_id, lease_id=job.lease_id, version=job.version, prompt_hash=job.prompt_hash, seed=job.seed,
        group_size=job.group_size, backend="torch", generation_s=0.1,
        completions=[s.to_completion() for s in samples],
    )


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics and parse it with prometheus_client's own text parser: {(sample name, labels): value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def recomputes(url: str) -> float:
    """Recomputes the API at ``url`` asked of its verifiers for results (one per result, however often resent)."""
    return scrape(url).get(("echo_swarm_result_recomputes_total", ()), 0.0)
