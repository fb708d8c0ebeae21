"""The verifier role (coordinator.engine.verifier) on the real tiny model: it recomputes from published snapshot folders
exactly what the policy computes from the same weights, batches queued requests of one version into one pass,
keeps a bounded number of replicas, and says so when a version is gone."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from coordinator.engine.verifier import Verifier
from coordinator.errors import VersionGone
from tests.integration.helpers import perturbed_copy

PROMPTS = [[5, 17, 33, 4], [9, 2, 41]]
COMPLETIONS = [[12, 40, 7, 1], [3, 3, 90]]


@pytest.fixture(scope="module")
def versions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("versions")
    v0 = root / "v0"
    shutil.copytree(tiny_model_dir, v0)
    perturbed_copy(tiny_model_dir, root / "v1", 0.05)
    return {0: v0, 1: root / "v1"}


def _reference(folder: Path, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    import torch

    from shared.policy import completion_logprobs, load_model

    model = load_model(folder).eval()
    with torch.no_grad():
        lp, _ = completion_logprobs(model, prompts, completions, temperature=1.0, pad_id=0)
    return [row[: len(c)] for row, c in zip(lp.tolist(), completions, strict=True)]


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def _verifier(versions: dict[int, Path], **kw: Any) -> Verifier:
    return Verifier(lambda v: versions.get(v), device="cpu", dtype="float32", temperature=1.0, pad_id=0,
                    stop_ids=[1], **kw)


def test_recompute_matches_the_policy_at_each_version(versions: dict[int, Path]) -> None:
    async def main() -> tuple[list[list[float]], list[list[float]]]:
        ver = _verifier(versions, cached_versions=1)
        try:
            a = await ver.recompute(PROMPTS, COMPLETIONS, 0)
            b = await ver.recompute(PROMPTS, COMPLETIONS, 1)
            assert ver.stats.loads == 2  # one replica, reloaded in place for version 1
            return a, b
        finally:
            ver.close()

    a, b = asyncio.run(main())
    assert a == _reference(versions[0], PROMPTS, COMPLETIONS)
    assert _flat(b) == pytest.approx(_flat(_reference(versions[1], PROMPTS, COMPLETIONS)), abs=1e-6)
    assert a != b  # the versions differ, so the second load really replaced the weights


def test_queued_requests_of_one_version_share_a_forward_pass(versions: dict[int, Path]) -> None:
    async def main() -> tuple[list[list[list[float]]], int]:
        ver = _verifier(versions)
        try:
            await ver.recompute(PROMPTS[:1], COMPLETIONS[:1], 0)  # load the replica first
            before = ver.stats.batches
            outs = await asyncio.gather(*(ver.recompute([p], [c], 0) for p, c in zip(PROMPTS, COMPLETIONS,
                                                                                     strict=True)))
            return list(outs), ver.stats.batches - before
        finally:
            ver.close()

    outs, batches = asyncio.run(main())
    assert batches == 1
    ref = _reference(versions[0], PROMPTS, COMPLETIONS)
    for out, want in zip(outs, ref, strict=True):
        assert out[0] == pytest.approx(want, abs=1e-5)


def test_two_cached_versions_are_not_reloaded(versions: dict[int, Path]) -> None:
    async def main() -> int:
        ver = _verifier(versions, cached_versions=2)
        try:
            for v in (0, 1, 0, 1):
                await ver.recompute(PROMPTS, COMPLETIONS, v)
            return ver.stats.loads
        finally:
            ver.close()

    assert asyncio.run(main()) == 2


def test_a_version_that_is_not_kept_is_refused_and_the_verifier_keeps_serving(versions: dict[int, Path]) -> None:
    async def main() -> list[list[float]]:
        ver = _verifier(versions)
        try:
            with pytest.raises(VersionGone, match="version 5"):
                await ver.recompute(PROMPTS, COMPLETIONS, 5)
            return await ver.recompute(PROMPTS, COMPLETIONS, 0)
        finally:
            ver.close()

    assert asyncio.run(main()) == _reference(versions[0], PROMPTS, COMPLETIONS)


def test_the_verifier_is_quiet_only_when_nothing_waits_for_it(versions: dict[int, Path]) -> None:
    """What the held-out evaluation waits for between its batches: a queued recompute and a load ahead of
    results each make the verifier busy until answered; then it is quiet again."""
    import threading

    async def main() -> None:
        ver = _verifier(versions, cached_versions=2)
        gate = threading.Event()
        try:
            assert ver.wait_quiet(0)
            blocked = asyncio.ensure_future(ver.run(gate.wait))  # the verifier's thread is held up
            asked = asyncio.ensure_future(ver.recompute(PROMPTS, COMPLETIONS, 0))
            loaded = asyncio.ensure_future(ver.preload(1))
            await asyncio.sleep(0)  # each has registered (and queued behind the held-up thread)
            assert not ver.wait_quiet(0)
            gate.set()
            await asyncio.gather(blocked, asked)
            assert await loaded is True
            assert ver.wait_quiet(0)
            assert ver.stats.per_version_loads == {0: 1, 1: 1}  # version 1 was loaded ahead, once
        finally:
            gate.set()
            ver.close()

    asyncio.run(main())


def test_the_held_out_evaluation_borrows_the_replica_and_scores_as_its_own_copy_did(versions: dict[int, Path]) -> None:
    """Issue 23: the verifier role's evaluation runs each batch on the verifier's replica (on the verifier's thread,
    loaded in place with the evaluated version), never on a model of its own — and scores exactly what an
    evaluator with its own copy of the same snapshot scores, batch for batch. A version that is gone is refused;
    lending on the verifier's own thread is refused rather than deadlocking."""
    import threading

    from coordinator.config import ArithmeticTaskConfig
    from coordinator.engine.evaluation import Evaluator
    from coordinator.tasks.builtin import ArithmeticTask

    task = ArithmeticTask(ArithmeticTaskConfig())
    items = task.heldout[:130]

    async def main() -> tuple[Any, Any, list[tuple[int, Any, str]], int, bool]:
        ver = _verifier(versions)
        lent: list[tuple[int, Any, str]] = []

        def lend(version: int, fn: Any) -> Any:
            def traced(model: Any) -> Any:
                lent.append((version, model, threading.current_thread().name))
                return fn(model)

            return ver.lend(version, traced)

        borrowed = Evaluator(task, items, 8, yield_to=lambda: ver.wait_quiet(5.0), borrow=lend,
                             load=lambda folder: pytest.fail("the evaluator loaded a model of its own"))
        own = Evaluator(task, items, 8, yield_to=lambda: None)  # the same batches (128 + 2), its own model
        try:
            await ver.recompute(PROMPTS, COMPLETIONS, 1)  # the replica holds version 1
            out = await asyncio.wrap_future(borrowed.submit(0, versions[0]))
            ref = await asyncio.wrap_future(own.submit(0, versions[0]))
            replica_is_v0 = lent[-1][1] is ver._models[0]
            with pytest.raises(VersionGone):
                await asyncio.wrap_future(borrowed.submit(7, versions[0]))
            with pytest.raises(RuntimeError, match="own thread"):
                await ver.run(ver.lend, 0, id)
            return out, ref, lent, ver.stats.loads, replica_is_v0
        finally:
            ver.close()
            borrowed.close()
            own.close()

    out, ref, lent, loads, replica_is_v0 = asyncio.run(main())
    assert out.n == ref.n == 130 and out.accuracy == ref.accuracy > 0.1
    assert [v for v, _, _ in lent] == [0, 0, 0]  # the load, batches of 128 and 2 (version 7: refused before)
    assert len({id(m) for _, m, _ in lent}) == 1 and replica_is_v0  # one model: the replica, holding version 0
    assert all(name.startswith("verifier") for _, _, name in lent)
    assert loads == 2  # version 1, then version 0 read into the same replica: no second model
