"""A coordinator killed (SIGKILL) while a version is being published, then restarted: the unpublished version is
gone, the learner is rebuilt from its checkpoint by replaying the recorded steps — bit for bit the learner that
was killed — and the run completes with every accepted result trained on exactly once (issue 12)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.holds import HOLD_ENV
from coordinator.roles.learner import LearnerRole
from coordinator.run.runfiles import RunFiles
from coordinator.run.workqueue import Bell
from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    process_alive,
    start_client,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow


HELD = 4  # the version the learner's publisher is held in the middle of writing, then killed


def _half_written(run_dir: Path, version: int) -> list[Path]:
    """Version ``version``'s temporary folder (files written, nothing renamed or signed), if it is there."""
    return [p for p in (run_dir / "snapshots").iterdir() if p.name.startswith(f".tmp-v{version}-")]


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
            live = role.learner.model.state_dict()  # bfloat16 with learner.precision = "bf16": exact in float32
            assert published and all(torch.equal(published[k].to(live[k].dtype), live[k]) for k in published), \
                "replay diverged"
            opt = role.learner.optimizer.state_dict()["state"]
            return version, int(next(iter(opt.values()))["step"]) if opt else 0
        finally:
            await role.stop()
            files.close()

    return asyncio.run(go())


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_kill_mid_publication_resumes_by_replay_and_loses_nothing(tmp_path: Path, tiny_model_dir: Path,
                                                                   precision: str) -> None:
    """Also with learner.precision = "bf16": its stochastic rounding follows from the seed and the step count, so
    the replay reproduces the bf16 weights bit for bit as well."""
    run_dir = tmp_path / "run"
    max_steps = 8
    learner = {"max_steps": max_steps, "checkpoint_every_steps": 100,  # checkpoints at v0 (and the last) only
               "precision": precision}
    snapshots = {"dtype": "float32", "gguf": "f32"}
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, learner=learner, snapshots=snapshots)
    held = tmp_path / "held"  # the publisher writes its pid here and waits (coordinator.holds) until killed
    coord, url = start_coordinator(cfg, tmp_path / "coord1.log", env={HOLD_ENV: f"publish-v{HELD}={held}"})
    port = int(url.rsplit(":", 1)[1])
    client = start_client(url, tmp_path / "c", tmp_path / "c.log", "--exit-when-finished")
    coord2: Proc | None = None
    try:
        wait_until(held.exists, 300, f"the publisher held mid-write of version {HELD}")
        publisher_pid = int(held.read_text())
        partial = _half_written(run_dir, HELD)
        assert len(partial) == 1 and any(partial[0].iterdir()), "held before its files were written"
        assert not (run_dir / "snapshots" / f"v{HELD:06d}").exists()
        coord.kill9()  # the learner role's process dies with it (PR_SET_PDEATHSIG), still held
        wait_until(lambda: not process_alive(publisher_pid), 60, "the held publisher's process to die")
        (version,), = db_rows(run_dir, "SELECT MAX(version) FROM versions")
        accepted = set(db_rows(run_dir, "SELECT job_id, client_id, content_sha256 FROM results"))
        assert version == HELD - 1  # killed mid-publication: the held version was never recorded
        write_config(cfg, run_dir, tiny_model_dir, port=port, learner=learner, snapshots=snapshots)
        resumed, optimizer_steps = _resumed_learner_matches_snapshot(cfg, tiny_model_dir)
        assert resumed == version and optimizer_steps == version  # replayed 1..version from the v0 checkpoint
        assert sorted(p.name for p in (run_dir / "snapshots").iterdir() if p.name.startswith("v"))[-1] == \
            f"v{version:06d}"  # the version being published when killed is gone
        assert not _half_written(run_dir, HELD)  # and so is its temporary folder
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
