"""A run that offers several GGUF precisions (snapshots.gguf_also): every version is published in each, a
llama.cpp volunteer runs the one it chose and names it in its lease, and its result is recomputed on that very
file — so asking for another precision than the one it ran buys nothing, and a torch identity cannot ask for one.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.engine.llama_verifier import LlamaRecompute
from coordinator.run.records import AcceptedResult
from shared import wire
from shared.messages import Job, LeaseRequest, Manifest, ResultSubmission, SignedManifest
from shared.sampler import plain_segments
from swarm_client.api import CoordinatorClient
from swarm_client.precision import choose_precision, offered_precisions
from swarm_client.resources import ResourceRefusal
from tests.adversarial.adversary import Adversary
from tests.integration.conftest import LiveCoordinator, running_coordinator
from tests.integration.helpers import REPO, db_rows

TWO = {"snapshots": {"gguf": "f16", "gguf_also": ["q4_K_M"]}}
#: 8 jobs a step, so that one identity can be refused several times before it has seen every job of the step
WIDE = {"prompts_per_step": 16}


def _manifest(live: LiveCoordinator, version: int = 0) -> Manifest:
    signed = wire.decode((live.run_dir / "snapshots" / f"v{version:06d}" / "manifest.msgpack").read_bytes(),
                         SignedManifest)
    return wire.decode(signed.manifest, Manifest)


def _join(live: LiveCoordinator, home: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "echo_swarm", "join", live.url, "--home", str(home), "--backend",
                           "llama", "--threads", "1", "--max-jobs", "2", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_each_volunteer_runs_and_is_checked_on_the_precision_its_lease_names(tmp_path: Path,
                                                                            tiny_model_dir: Path) -> None:
    with running_coordinator(tmp_path, tiny_model_dir, sections=TWO) as live:
        served = live.run_dir / "snapshots" / "v000000"
        assert {"model.gguf", "model.q4_K_M.gguf"} <= {p.name for p in served.iterdir()}
        stated = {f.path: f.precision for f in _manifest(live).files if f.form == "gguf"}
        assert stated == {"model.gguf": "f16", "model.q4_K_M.gguf": "q4_K_M"}  # from the header, from the name

        small, best = tmp_path / "small", tmp_path / "best"
        proc = _join(live, small, "--precision", "q4_K_M")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "running the q4_K_M GGUF" in proc.stdout
        proc = _join(live, best)  # --precision auto: the best offered that fits (this machine fits f16)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "running the f16 GGUF" in proc.stdout

        for home, only in ((small, "model.q4_K_M.gguf"), (best, "model.gguf")):  # the chosen file alone
            for folder in (home / "cache" / "snapshots" / live.coordinator.run_id).iterdir():
                assert {p.name for p in folder.iterdir() if not p.name.startswith(".")} == {only}
                assert (folder / only).read_bytes() == (served.parent / folder.name / only).read_bytes()
        assert db_rows(live.run_dir, "SELECT COUNT(*) FROM rejections") == [(0,)]
        # each accepted result was recomputed on its lease's file, and the learner trains it against that π_b
        rows = db_rows(live.run_dir, "SELECT j.lease_precision, r.payload FROM results r JOIN jobs j "
                                     "ON j.job_id = r.job_id")
        sources = sorted((precision, AcceptedResult.decode(payload).source) for precision, payload in rows)
        assert sources == [("f16", "llama-f16")] * 2 + [("q4_K_M", "llama-q4_K_M")] * 2


def test_a_torch_client_computing_in_bf16_is_checked_by_a_bf16_replay(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`join --torch-dtype bfloat16` leases in bf16; its results are recomputed by replaying its generations in
    bf16 (class torch-bf16) and accepted — judged by the float32 pass instead, about half were refused."""
    with running_coordinator(tmp_path, tiny_model_dir) as live:
        proc = subprocess.run([sys.executable, "-m", "echo_swarm", "join", live.url, "--home", str(tmp_path / "bf16"),
                               "--backend", "torch", "--torch-dtype", "bfloat16", "--threads", "1", "--max-jobs", "3"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert db_rows(live.run_dir, "SELECT COUNT(*) FROM rejections") == [(0,)]
        rows = db_rows(live.run_dir, "SELECT j.lease_precision, r.payload FROM results r JOIN jobs j "
                                     "ON j.job_id = r.job_id")
        assert sorted((p, AcceptedResult.decode(payload).source) for p, payload in rows) == [("bf16", "torch-bf16")] * 3


def test_asking_for_another_precision_than_the_one_run_buys_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Class shopping through the lease: a torch identity asking for a GGUF precision, and a llama.cpp identity
    asking for one the run does not publish, are refused before anything is leased; a llama.cpp identity that
    ran the q4_K_M file and leased as f16 is recomputed on the f16 file, so its result passes only where its
    tokens are f16's own keyed sample, or within the class's 0.1 logit of it."""
    with running_coordinator(tmp_path, tiny_model_dir, sections=TWO, learner=WIDE) as live:
        asks, askers, shops, ran = asyncio.run(_shop(live.url, tmp_path / "adversary"))
    refused = [o for o in asks if o["status"] == 409]
    assert [o["reason"] for o in refused] == ["precision_not_offered"] * 2, asks
    assert "publishes GGUF at f16, q4_K_M" in refused[1]["message"], refused[1]
    assert db_rows(live.run_dir, "SELECT COUNT(*) FROM jobs WHERE lease_client IN (?, ?)",
                   tuple(askers)) == [(0,)]  # nothing leased to the refused askers
    snapshots = live.run_dir / "snapshots"
    judge = LlamaRecompute(lambda v: snapshots / f"v{v:06d}", temperature=1.0, threads=1)
    tol = CoordinatorConfig().verification.choice_tolerance("llama-f16")
    for entry, (job, sub) in zip(shops, ran, strict=True):
        assert _worst_margin(judge, job, sub, "q4_K_M") == 0.0  # the file it ran: every token its keyed choice
        judged = _worst_margin(judge, job, sub, "f16")  # the file its lease named: what the coordinator judged
        if entry["same_as_honest"]:  # the q4_K_M sample is f16's keyed sample token for token: honest f16 work
            assert judged == 0.0 and (entry["status"], entry["reason"]) == (200, None), entry
        elif judged > tol / job.sampling.temperature:  # off f16's keyed choice by more than the class allows
            assert (entry["status"], entry["reason"]) in {(422, "choice_mismatch"), (422, "logprob_mismatch")}, entry
        else:  # within f16's 0.1 logit everywhere: as f16 work it passes (the tolerance's own freedom), or is
            assert entry["status"] in (200, 422), entry  # refused by the logprob check first


Attempt = dict[str, Any]


def _worst_margin(judge: LlamaRecompute, job: Job, sub: ResultSubmission, precision: str) -> float:
    """The largest keyed-sampler margin of ``sub``'s tokens under ``job``'s version at ``precision``."""
    prompts = [list(p.token_ids) for p in job.prompts for _ in range(job.group_size)]
    tokens = [list(c.token_ids) for c in sub.completions]
    stats = judge.recompute_stats(job.version, prompts, tokens, plain_segments(job.seed, [len(t) for t in tokens]),
                                  job.group_size, precision)
    assert stats.margins is not None
    return max(max(m, default=0.0) for m in stats.margins)


async def _shop(url: str, home: Path) -> tuple[list[Attempt], list[str], list[Attempt],
                                               list[tuple[Job, ResultSubmission]]]:
    adv = Adversary(url, home)

    async def ask(api: CoordinatorClient, request: LeaseRequest, what: str) -> Attempt:
        assert api.identity is not None
        return await adv.send(api, "/v1/lease", adv.envelope(api.identity, "/v1/lease", wire.encode(request)), what)

    try:
        torch_id = await adv.identity("torch", backend="torch")  # registers (and is pinned) as torch
        asks = [await ask(torch_id, LeaseRequest(backend="torch", held_version=-1, precision="q4_K_M"),
                          "torch asks for q4_K_M")]
        adv.claim = "llama"
        llama_id = await adv.identity("llama-q8")
        asks.append(await ask(llama_id, LeaseRequest(backend="llama", held_version=-1, precision="q8_0"),
                              "llama asks for q8_0"))
        shopper = await adv.identity("shopper")
        adv.precision = "f16"
        shops, ran = [], []
        for _ in range(6):
            job = await adv.lease(shopper)
            assert job.precision == "f16"
            sub = await adv.honest(shopper, job.model_copy(update={"precision": "q4_K_M"}))
            shops.append(await adv.cheat(shopper, job, sub, "ran q4_K_M, leased as f16"))
            ran.append((job, sub))
        return asks, adv.identities[:2], shops, ran
    finally:
        await adv.close()


def _manifest_of(sizes: dict[str, int]) -> Manifest:
    from shared.messages import ManifestFile

    files = [ManifestFile(path="config.json", size=10, sha256="0" * 64)] + [
        ManifestFile(path="model.gguf" if p == "f16" else f"model.{p}.gguf", size=n, sha256=f"{i + 1:064x}",
                     form="gguf", precision=p)  # type: ignore[arg-type]
        for i, (p, n) in enumerate(sizes.items())]
    return Manifest(protocol=6, run_id="r", version=0, created_at=0.0, format="hf-safetensors", files=files)


def test_auto_takes_the_best_offered_precision_that_fits() -> None:
    offered = offered_precisions(_manifest_of({"q4_K_M": 4_400, "f16": 14_000, "q8_0": 7_500}))
    assert list(offered) == ["f16", "q8_0", "q4_K_M"]  # best first, whatever the manifest's order
    assert choose_precision(offered, "auto", lambda size: size <= 16_000) == "f16"
    assert choose_precision(offered, "auto", lambda size: size <= 8_000) == "q8_0"
    assert choose_precision(offered, "auto", lambda size: size <= 5_000) == "q4_K_M"
    # nothing fits: the smallest, whose download pre-check then says in numbers why it does not
    assert choose_precision(offered, "auto", lambda size: False) == "q4_K_M"
    assert choose_precision(offered, "q8_0", lambda size: False) == "q8_0"  # asked: the volunteer's word
    with pytest.raises(ResourceRefusal, match="publishes GGUF at f16, q8_0, q4_K_M, not q6_K"):
        choose_precision(offered, "q6_K", lambda size: True)
    assert choose_precision({}, "auto", lambda size: True) is None  # a coordinator that states no precisions


def test_every_offered_precision_gets_its_own_patch(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Deltas for the further precisions as for model.gguf: a version whose weights moved a little lists a patch
    of each GGUF, each rebuilding the file of its own precision."""
    import torch

    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto

    learner = Learner(tiny_model_dir, ModelConfig(device="cpu"), LearnerConfig(threads=1), 1.0,
                      gguf=("f16", "q4_K_M"))
    store = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run", anchor_every=50)
    store.publish(0, learner.snapshot_files("float32"), now=1.0)
    with torch.no_grad():  # one tensor moves: a patch is a small share of each file
        weight = learner.model.model.layers[0].mlp.down_proj.weight
        weight.add_(0.05 * torch.randn_like(weight))
    store.publish(1, learner.snapshot_files("float32"), now=2.0)
    signed = store.signed_manifest(1)
    assert signed is not None
    files = {f.path: f for f in wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files}
    for name in ("model.gguf", "model.q4_K_M.gguf"):
        patch = files.get(name + ".delta")
        assert patch is not None, sorted(files)
        assert patch.result_sha256 == files[name].sha256 and patch.size < 0.5 * files[name].size
    assert files["model.q4_K_M.gguf"].precision == "q4_K_M" and files["model.gguf"].precision == "f16"
