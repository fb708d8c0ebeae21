"""A coordinator killed (SIGKILL) while a version is being published, then restarted: the unpublished version is
gone, the learner is rebuilt from its checkpoint by replaying the recorded steps — bit for bit the learner that
was killed — and the run completes with every accepted result trained on exactly once (issue 12)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.roles.learner import LearnerRole
from coordinator.run.runfiles import RunFiles
from coordinator.run.workqueue import Bell
from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    start_client,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow


def _publishing(run_dir: Path) -> bool:
    snapshots = run_dir / "snapshots"
    try:
        return any(p.name.startswith(".tmp-v") for p in snapshots.iterdir())
    except FileNotFoundError:
        return False


def _resumed_learner_matches_snapshot(cfg: Path, tiny_model_dir: Path) -> tuple[int, int]:
    """Start a Coordinator in-process on the killed run directory and compare its learner with the last published
    version (float32 snapshots: the learner's exact weights). Returns (version, optimizer steps)."""
    import torch
    from safetensors.torch import load_file

    async def go() -> tuple[int, int]:
        config = load_config(cfg)
        files = RunFiles.open(config)
        role = LearnerRole(config, files.store, Bell(), files.snapshots, files.task, model_dir=tiny_model_dir)
        await role.start()  # the learner role alone, as `--role learner` runs it
        try:
            version = role.version
            published = load_file(str(files.snapshots.folder(version) / "model.safetensors"))
            live = role.learner.model.state_dict()
            assert published and all(torch.equal(published[k], live[k]) for k in published), "replay diverged"
            opt = role.learner.optimizer.state_dict()["state"]
            return version, int(next(iter(opt.values()))["step"]) if opt else 0
        finally:
            await role.stop()
            files.close()

    return asyncio.run(go())


def test_kill_mid_publication_resumes_by_replay_and_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 8
    learner = {"max_steps": max_steps, "checkpoint_every_steps": 100}  # checkpoints at v0 (and the last) only
    snapshots = {"dtype": "float32", "gguf": "f32"}
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, learner=learner, snapshots=snapshots)
    coord, url = start_coordinator(cfg, tmp_path / "coord1.log")
    port = int(url.rsplit(":", 1)[1])
    client = start_client(url, tmp_path / "c", tmp_path / "c.log", "--exit-when-finished")
    coord2: Proc | None = None
    try:
        wait_until(lambda: (s := get_status(url)) and s["version"] >= 3, 180, "a few versions")
        wait_until(lambda: _publishing(run_dir), 120, "a version being published", interval=0.002)
        coord.kill9()
        (version,), = db_rows(run_dir, "SELECT MAX(version) FROM versions")
        accepted = set(db_rows(run_dir, "SELECT job_id, client_id, content_sha256 FROM results"))
        assert 3 <= version < max_steps
        write_config(cfg, run_dir, tiny_model_dir, port=port, learner=learner, snapshots=snapshots)
        resumed, optimizer_steps = _resumed_learner_matches_snapshot(cfg, tiny_model_dir)
        assert resumed == version and optimizer_steps == version  # replayed 1..version from the v0 checkpoint
        assert sorted(p.name for p in (run_dir / "snapshots").iterdir() if p.name.startswith("v"))[-1] == \
            f"v{version:06d}"  # the version being published when killed is gone
        coord2, url2 = start_coordinator(cfg, tmp_path / "coord2.log")
        assert url2 == url
        final = wait_until(lambda: (s := get_status(url)) and s["finished"] and s, 300, "the resumed run to finish")
        assert client.proc.wait(60) == 0, client.output()[-2000:]
    finally:
        stop_all(*(p for p in (client, coord2, coord) if p is not None))
    assert final and final["version"] == max_steps
    assert accepted <= set(db_rows(run_dir, "SELECT job_id, client_id, content_sha256 FROM results"))
    ingested = db_rows(run_dir, "SELECT ingested_step, COUNT(*) FROM results GROUP BY ingested_step ORDER BY 1")
    assert ingested == [(step, 2) for step in range(1, max_steps + 1)]  # each exactly once
    assert "replayed" in (tmp_path / "coord2.log").read_text()
