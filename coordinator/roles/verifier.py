"""The verifier role: claims recompute and evaluation requests from the store and answers them.

One or more run beside the learner, each in its own process (``echo-swarm coordinator --role verifier``) with its
own model replicas on its own device (``verification.device``), or inside the one process of the in-process
layout. Concurrent requests of one version are batched into one forward pass by :class:`coordinator.engine.verifier.
Verifier`. Only the first worker (``verifier-0``) runs held-out evaluations, one at a time, on its own thread.

With ``verification.placement = "fsdp"`` a worker is a group of ``verification.world_size`` ranks
(coordinator.engine.fsdp): this process is rank 0, claims and answers as above, and leads the others, which only compute
(:func:`follower_verifier`). A rank that exits takes the group down with it (:func:`coordinator.engine.fsdp.broken`), so
the supervisor's restart of the worker restarts every rank.

A worker that dies leaves its claims behind; they run out after ``verification.claim_s`` and another worker takes
them, or the restarted worker hands them back at once (``Store.work.unclaim``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.config import CoordinatorConfig
from coordinator.core.verify import TokenStats
from coordinator.engine import fsdp
from coordinator.engine.evaluation import Evaluator
from coordinator.engine.llama_verifier import LlamaRecompute
from coordinator.engine.lora import VersionLoader
from coordinator.engine.torch_replay import TorchReplay
from coordinator.engine.verifier import Verifier
from coordinator.errors import VersionGone
from coordinator.holds import hold_async
from coordinator.publish.snapshots import SnapshotStore
from coordinator.run.follower import SnapshotFollower
from coordinator.run.names import verifier_name
from coordinator.run.records import VerifierReport
from coordinator.run.runfiles import wait_for_first_version
from coordinator.run.workqueue import POLL_S, Bell
from coordinator.store.hops import (
    EVALUATE,
    RECOMPUTE,
    RecomputeAnswer,
    RecomputedStats,
    RecomputeRequest,
    WorkKind,
    work_kind,
)
from coordinator.store.store import Store
from coordinator.tasks.base import Task
from coordinator.tasks.text import TextCodec
from shared.policy import import_backends, pick_device

if TYPE_CHECKING:
    from coordinator.engine.fsdp import Ranks

logger = logging.getLogger(__name__)

#: Requests one worker holds at once: enough to fill a batched forward pass, few enough that a dead worker
#: strands little.
CLAIM_BATCH = 16
#: Seconds between this worker's reports in the store (role status, claim renewals).
REPORT_EVERY_S = 2.0
#: Skipped held-out evaluations a verifier's role status lists (the newest)
SKIPPED_SHOWN = 20
#: Longest the evaluator waits, before each of its batches, for the verifier to have nothing to answer: under a
#: steady stream of results an evaluation still advances a batch at least this often.
EVAL_YIELD_MAX_S = 5.0


class VerifierWorker:
    def __init__(self, config: CoordinatorConfig, store: Store, bell: Bell, snapshots: SnapshotStore, task: Task,
                 *, index: int = 0, ranks: Ranks | None = None) -> None:
        self.config = config
        self.ranks = ranks
        self.store = store
        self.bell = bell
        self.snapshots = snapshots
        self.follower = SnapshotFollower(snapshots, store.versions)
        self.task = task
        self.name = verifier_name(index)
        self.kinds: tuple[WorkKind[Any, Any], ...] = (RECOMPUTE,) + ((EVALUATE,) if index == 0 else ())
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._preloaded = -1  # the newest version this worker loaded ahead of its results
        self._preload: asyncio.Task[bool] | None = None
        self.evaluations = 0
        self.eval_s = 0.0
        self.evaluations_skipped: list[int] = []  # versions whose held-out evaluation could not be done (newest last)

    async def start(self) -> None:
        import_backends()  # on this thread, before the verifier's and evaluator's threads load models

        current = await wait_for_first_version(self.store, self.bell, self.name)
        self.follower.refresh()
        lora = self.config.learner.lora_rank > 0
        folder = self.snapshots.base_dir if lora else self.snapshots.folder(current)
        codec = TextCodec.from_folder(folder if (folder / "tokenizer.json").exists()
                                      else self.snapshots.folder(current))
        vcfg = self.config.verification
        _set_threads(self.config)
        device = self.ranks.device if self.ranks is not None else pick_device(
            self.config.model.device if vcfg.device == "auto" else vcfg.device)
        self.verifier = _make_verifier(self.config, self.snapshots, self.store, device, codec, self.ranks)
        # llama.cpp clients' results: recomputed by llama.cpp on the GGUF file they ran (engine.llama_verifier)
        self.llama: LlamaRecompute | None = None
        if self.config.snapshots.gguf != "off":
            snapshots = self.snapshots
            self.llama = LlamaRecompute(
                lambda v: snapshots.folder(v) if snapshots.signed_manifest(v) is not None else None,
                temperature=self.config.sampling.temperature,
                threads=vcfg.threads or self.config.learner.threads, cached_versions=vcfg.cached_versions,
                base_dir=self.snapshots.base_dir if lora else None)
        self.torch_bf16: TorchReplay | None = None  # bf16 torch clients' results (engine.torch_replay), on demand
        self.evaluator: Any = None
        if EVALUATE in self.kinds:
            versions = VersionLoader(self.snapshots.base_dir) if lora else None
            verifier = self.verifier
            # the evaluation borrows the verifier's replica (no second model in this process), except on FSDP
            # ranks, whose sharded replica only computes in step with the other ranks
            borrow = verifier.lend if self.ranks is None else None
            self.evaluator = Evaluator(self.task, self.task.heldout[: self.config.learner.eval_size],
                                       self.config.sampling.max_tokens, device=device,
                                       load=versions.load_eval if versions is not None else None, borrow=borrow,
                                       tokenizer_of=versions.load_tokenizer if versions is not None else None,
                                       yield_to=lambda: verifier.wait_quiet(EVAL_YIELD_MAX_S))
        handed_back = self.store.work.unclaim(self.name)
        if handed_back:
            logger.info("%s: took back %d requests its previous run had claimed", self.name, handed_back)
        self._report()
        logger.info("%s ready on %s", self.name, device)

    def _report(self) -> None:
        engines = {**(self.llama.describe() if self.llama is not None else {}),
                   **(self.torch_bf16.describe() if self.torch_bf16 is not None else {})}
        self.store.role_status.set(self.name, VerifierReport(
            in_flight=len(self._inflight), evaluations=self.evaluations, eval_s=self.eval_s,
            evaluations_skipped=self.evaluations_skipped[-SKIPPED_SHOWN:], engines=engines,
            **self.verifier.describe()))

    async def run(self) -> None:
        """Claim, answer, report — until cancelled."""
        next_report = time.monotonic() + REPORT_EVERY_S
        try:
            while True:
                try:
                    next_report = self._look(next_report)
                except Exception:  # a busy database must not end the worker; the next look retries
                    logger.exception("%s: looking for work failed", self.name)
                if not fsdp_followers_alive(self.ranks):
                    assert self.ranks is not None
                    fsdp.broken(self.ranks, f"{self.name}: a rank of its group exited")
                await self.bell.wait(POLL_S)
        finally:
            for task in list(self._inflight.values()):
                task.cancel()
            if self._preload is not None:
                self._preload.cancel()

    def _look(self, next_report: float) -> float:
        """Claim what there is room for, renew claims and report when due, load a new version ahead; the time of
        the next report."""
        free = CLAIM_BATCH - len(self._inflight)
        if free > 0:
            now = time.time()
            for row in self.store.work.claim(self.name, self.kinds, free, now + self.config.verification.claim_s,
                                             now):
                task = asyncio.create_task(self._answer(row), name=f"{self.name}-{row['id']}")
                self._inflight[int(row["id"])] = task
                task.add_done_callback(self._forget)
        if time.monotonic() >= next_report:
            next_report = time.monotonic() + REPORT_EVERY_S
            if self._inflight:
                self.store.work.renew(self.name, list(self._inflight), time.time() + self.config.verification.claim_s)
            self.follower.refresh()
            self._report()
        self._preload_newest()
        return next_report

    def _preload_newest(self) -> None:
        """Load a newly published version at once, so its first result does not wait for the load. Only where
        that evicts nothing still needed: in sequential pull (results of an older version are not trained on
        any more) or with room for more than one version (async push-pull keeps verifying the previous ones)."""
        if self._preload is not None and not self._preload.done():
            return
        if self.config.sync_mode != "sequential-pull" and self.config.verification.cached_versions < 2:
            return
        current = self.store.versions.current()
        if current is None or current <= self._preloaded:
            return
        self._preloaded = current
        self.follower.ensure(current)
        self._preload = asyncio.create_task(self.verifier.preload(current), name=f"{self.name}-preload")

    def _forget(self, task: asyncio.Task[None]) -> None:
        for item, t in list(self._inflight.items()):
            if t is task:
                del self._inflight[item]

    async def _answer(self, row: Any) -> None:
        item, kind, version = int(row["id"]), work_kind(row["kind"]), int(row["version"])
        try:
            request = kind.request.decode(row["request"])
            self.follower.ensure(version)  # published since the last look?
            if not isinstance(request, RecomputeRequest):  # an EvaluateRequest (coordinator.store.hops.WORK_KINDS)
                await self._evaluate(item, version)
                return
            await hold_async(f"recompute-v{version}")  # a fault test's busy verifier (coordinator.holds)
            stats = await self._recompute(request, version)
            self.store.work.finish(item, self.name, RecomputeAnswer(stats=RecomputedStats.of(stats)))
        except VersionGone:
            self.store.work.finish(item, self.name, RecomputeAnswer(gone=True))
        except FileNotFoundError as exc:
            if self._pruned(version):  # the learner pruned the version while it was read: the result is too old
                self.store.work.finish(item, self.name, RecomputeAnswer(gone=True))
            else:  # a file missing here is this verifier's fault, never a refusal of an honest result
                self._failed(item, kind.name, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(item, kind.name, exc)
        self.bell.ring()

    def _pruned(self, version: int) -> bool:
        """Whether ``version`` is no longer kept, as the store and the snapshot folder say now."""
        self.follower.refresh()
        return self.snapshots.signed_manifest(version) is None

    def _failed(self, item: int, kind: str, exc: Exception) -> None:
        """The request failed here: the API answers the client 5xx and the client resends (nothing is refused)."""
        logger.exception("%s: %s request %d failed", self.name, kind, item)
        self.store.work.finish(item, self.name, None, error=f"{type(exc).__name__}: {exc}")

    async def _recompute(self, request: RecomputeRequest, version: int) -> TokenStats:
        """The stats of ``request``'s result at ``version``, by the engine the API named."""
        segments = request.segments  # the keyed draws, for the margins
        if request.engine == "llama":
            if self.llama is None:
                raise VersionGone("this run publishes no GGUF: a llama.cpp result cannot be recomputed")
            # on the verifier's thread, in turn with torch recomputes: the two never share the cores
            stats: TokenStats = await self.verifier.run(self.llama.recompute_stats, version, request.prompts,
                                                        request.completions, segments, request.group or 1,
                                                        request.precision)
            return stats
        if request.engine == "torch-bf16":  # a bf16 client's generations replayed in bf16 (engine.torch_replay)
            stats = await self.verifier.run(self._replay().recompute_stats, version, request.prompts,
                                            request.completions, segments)
            return stats
        stats = await self.verifier.recompute_stats(request.prompts, request.completions, version, segments)
        return stats

    def _replay(self) -> TorchReplay:
        """The bf16 replay of torch clients' results, made on the first one (a bf16 replica per kept version)."""
        if self.torch_bf16 is None:
            snapshots, lora = self.snapshots, self.config.learner.lora_rank > 0
            versions = VersionLoader(snapshots.base_dir) if lora else None
            self.torch_bf16 = TorchReplay(
                lambda v: snapshots.folder(v) if snapshots.signed_manifest(v) is not None else None,
                dtype="bfloat16", device=self.verifier.device, temperature=self.config.sampling.temperature,
                pad_id=self.verifier.pad_id, cached_versions=self.config.verification.cached_versions,
                load_first=versions.load_first if versions is not None else None,
                load_into=versions.load_into if versions is not None else None)
        return self.torch_bf16

    async def _evaluate(self, item: int, version: int) -> None:
        """A held-out evaluation of a published version, recorded in the store; nobody waits for the answer."""
        assert self.evaluator is not None
        await hold_async(f"evaluate-v{version}")  # a fault test's slow evaluation (coordinator.holds)
        try:
            out = await asyncio.wrap_future(self.evaluator.submit(version, self.snapshots.folder(version)))
        except (OSError, VersionGone) as exc:  # the learner keeps the version until this row is gone: a bug, a disk
            logger.warning("held-out evaluation of version %d skipped: %s", version, exc)
            self.evaluations_skipped.append(version)
            self._report()  # at once: whoever waits for this evaluation (echo-swarm demo) learns it will not come
        else:
            self.store.evals.record(out.version, out.accuracy, out.n, time.time())
            self.evaluations += 1
            self.eval_s += out.seconds
            logger.info("version %d: held-out greedy accuracy %.3f on %d prompts (%.1fs, off the learner)", version,
                        out.accuracy, out.n, out.seconds)
        self.store.work.delete([item])

    def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        with contextlib.suppress(AttributeError):
            self.verifier.close()
        for other in (getattr(self, "llama", None), getattr(self, "torch_bf16", None)):
            if other is not None:
                other.close()
        evaluator = getattr(self, "evaluator", None)
        if evaluator is not None:
            evaluator.close()


def fsdp_followers_alive(ranks: Ranks | None) -> bool:
    if ranks is None:
        return True

    return fsdp.followers_alive(ranks)


def _set_threads(config: CoordinatorConfig) -> None:
    threads = config.verification.threads or config.learner.threads
    if threads:
        import torch

        torch.set_num_threads(threads)  # process-wide: this role's own pool, not the learner's


def _make_verifier(config: CoordinatorConfig, snapshots: SnapshotStore, store: Store, device: str,
                   codec: TextCodec, ranks: Ranks | None = None) -> Any:
    """A :class:`coordinator.engine.verifier.Verifier` reading this run's published folders (a LoRA version is the shared
    base plus its adapter, coordinator.engine.lora). On ranks it leads the others' :func:`follower_verifier`."""
    def folder_of(version: int) -> Path | None:
        return snapshots.folder(version) if snapshots.signed_manifest(version) is not None else None

    base = str(snapshots.base_dir) if config.learner.lora_rank > 0 else None
    fsdp.lead(ranks, "init", codec.pad_id, list(codec.stop_ids), base)
    return _verifier(config, folder_of, device, codec.pad_id, codec.stop_ids, base, ranks)


def _verifier(config: CoordinatorConfig, folder_of: Any, device: str, pad_id: int, stop_ids: list[int],
              lora_base: str | None, ranks: Ranks | None) -> Any:
    lora = VersionLoader(Path(lora_base)) if lora_base is not None else None  # LoRA: base + each version's adapter
    return Verifier(folder_of, device=device, dtype=config.model.dtype, temperature=config.sampling.temperature,
                    pad_id=pad_id, stop_ids=stop_ids, cached_versions=config.verification.cached_versions,
                    ranks=ranks, mixed_precision=config.verification.mixed_precision,
                    load_state=None if lora is None else lora.load_state,
                    load_first=None if lora is None else lora.load_first,
                    load_into=None if lora is None else lora.load_into)


def follower_verifier(ranks: Ranks, config: CoordinatorConfig, pad_id: int, stop_ids: list[int],
                      lora_base: str | None) -> Any:
    """Ranks 1…N-1 of a verifier group: the Verifier rank 0 leads (it names the folders; this one only loads them
    and computes its share)."""
    import_backends()
    _set_threads(config)
    return _verifier(config, lambda _v: None, ranks.device, pad_id, stop_ids, lora_base, ranks)
