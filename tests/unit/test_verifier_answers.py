"""A verifier answers "version gone" (the API refuses the result as `version_retired`) only for a version the learner
no longer keeps. Any other missing file is the verifier's own failure: the request fails, the API answers 5xx and
the client resends — an honest result is never refused for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.core.verify import TokenStats
from coordinator.roles.verifier import VerifierWorker
from coordinator.run.runfiles import RunFiles
from coordinator.run.workqueue import Bell
from coordinator.store.hops import RECOMPUTE, RecomputeAnswer, RecomputeRequest
from coordinator.store.work_rows import WorkState


def _publish(files: RunFiles, version: int) -> None:
    def write(folder: Path) -> None:
        (folder / "config.json").write_bytes(b"{}")
        (folder / "model.safetensors").write_bytes(b"v%d" % version)

    files.snapshots.publish(version, write, now=1.0)
    if version == 0:
        files.store.versions.publish_initial("sha", 1.0)
    else:
        files.store.steps.commit(step=version - 1, trained_version=version - 1, job_ids=[], new_version=version,
                                 manifest_sha="sha", mean_reward=0.0, metrics={}, now=1.0)


def _missing(path: Path) -> Callable[[RecomputeRequest, int], Awaitable[TokenStats]]:
    """A recompute whose engine meets a missing ``path`` (the engine is not what is under test)."""

    async def recompute(request: RecomputeRequest, version: int) -> TokenStats:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    return recompute


def _answer(worker: VerifierWorker, files: RunFiles, version: int) -> tuple[str, object]:
    """Queue one recompute of ``version`` and let the worker answer it; the row's state and answer."""
    item = files.store.work.submit(RECOMPUTE, version, RecomputeRequest(prompts=[[1]], completions=[[2]]),
                                   time.time())
    [row] = files.store.work.claim(worker.name, (RECOMPUTE,), 1, time.time() + 60, time.time())
    asyncio.run(worker._answer(row))
    done = files.store.work.item(item)
    assert done is not None
    answer = RecomputeAnswer.decode(done["answer"]) if done["state"] == WorkState.DONE else done["error"]
    return str(done["state"]), answer


def test_a_missing_file_of_a_kept_version_fails_the_request_and_a_pruned_version_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(None, {"run_dir": str(tmp_path / "run")})
    files = RunFiles.open(config)
    try:
        for v in (0, 1):
            _publish(files, v)
        worker = VerifierWorker(config, files.store, Bell(), files.snapshots, files.task)
        worker.follower.refresh()

        monkeypatch.setattr(worker, "_recompute", _missing(tmp_path / "some-cache" / "x.bin"))
        state, answer = _answer(worker, files, 1)
        assert state == WorkState.FAILED and "FileNotFoundError" in str(answer)  # not a refusal: the client resends

        files.snapshots.prune({1})  # the learner no longer keeps v0
        monkeypatch.setattr(worker, "_recompute", _missing(files.snapshots.folder(0) / "model.safetensors"))
        state, answer = _answer(worker, files, 0)
        assert state == WorkState.DONE and isinstance(answer, RecomputeAnswer) and answer.gone
    finally:
        files.close()
