"""The learner role: takes verified results from the store, trains, hands each version to publication.

It runs in its own process (``echo-swarm coordinator --role learner``) or inside the one process of the in-process
layout; either way it talks to the other roles only through the store: it reads accepted results
(``Store.results.pending``), records each step, its ingestion marks and the new version in one transaction once the
version is published, reports its progress (``learner`` role status: the version it is training towards and the
jobs in that step), and asks the verifiers for held-out evaluations (the ``work`` table). The torch work happens on
one executor thread; publication (coordinator.publish.publisher) overlaps the next step. On FSDP ranks (coordinator.engine.fsdp)
this role is rank 0: its learner leads the other ranks through every step, hand-over and checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.scheduling import select_batch
from coordinator.engine import fsdp
from coordinator.engine.learner import Learner
from coordinator.engine.tiny_model import ensure_tiny_model
from coordinator.publish.checkpoints import CheckpointState, CheckpointStore
from coordinator.publish.publisher import Publication, Published, Publisher
from coordinator.publish.snapshots import SnapshotFiles, SnapshotStore
from coordinator.roles.batches import Batches
from coordinator.roles.handover import HandOver
from coordinator.roles.local_client import LocalClient, LocalIntake
from coordinator.roles.resume import restore, start_folder
from coordinator.roles.upkeep import Upkeep
from coordinator.run import notices
from coordinator.run.names import LEARNER
from coordinator.run.records import LearnerReport
from coordinator.run.workqueue import POLL_S, Bell
from coordinator.store.job_rows import JobRow
from coordinator.store.store import Store
from coordinator.tasks.base import Task
from coordinator.tasks.text import PromptTokens, TextCodec
from shared.policy import import_backends

logger = logging.getLogger(__name__)


def resolve_model_dir(config: CoordinatorConfig) -> Path:
    if config.model.path == "tiny":
        return ensure_tiny_model()
    path = Path(config.model.path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path {path} is not a Hugging Face model folder (no config.json); point it at a local "
            f"folder holding config.json, *.safetensors and tokenizer files, or use 'tiny'")
    return path


class LearnerRole:
    def __init__(self, config: CoordinatorConfig, store: Store, bell: Bell, snapshots: SnapshotStore, task: Task, *,
                 clock: Callable[[], float] = time.time, model_dir: Path | None = None,
                 local_intake: LocalIntake | None = None, plan_job: Callable[[], JobRow] | None = None,
                 ranks: Any = None) -> None:
        self.config = config
        self.store = store
        self.bell = bell
        self.snapshots = snapshots
        self.task = task
        self.clock = clock
        self._model_dir = model_dir
        self._local_intake = local_intake
        self._plan_job = plan_job
        self._ranks = ranks  # coordinator.engine.fsdp.Ranks (rank 0) when the learner runs on FSDP ranks
        self.run_dir = Path(config.run_dir)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self.version = 0
        self.finished = False
        self.started_at = clock()
        self.busy_s = 0.0
        self.last_error: str | None = None
        # steps trained but not yet published → their job ids (kept out of the next batch)
        self._unpublished: dict[int, frozenset[str]] = {}
        self._publishing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Publish version 0 from the model folder, or resume the run at its current version."""

        import_backends()  # before the learner's and publisher's threads use them
        committed = [v.version for v in self.store.versions.all()]
        self.snapshots.reconcile(committed)
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints")
        current = self.store.versions.current()
        self.checkpoints.prune(-1 if current is None else current, startup=True)
        self.publisher = Publisher(self.snapshots, self.checkpoints)
        self.hand_over = HandOver(self.config.snapshots, self.checkpoints, sharded=self._ranks is not None)
        self.upkeep = Upkeep(self.config, self.store, self.bell, self.snapshots, self.checkpoints, self.clock)
        if current is None:
            model_dir = await self._model_folder()
            self._set_codec(TextCodec.from_folder(model_dir))
            self.learner = await self._run(self._make_learner, model_dir)
            files, checkpoint = await self._run(self.hand_over.files, self.learner, True)
            published = await asyncio.wrap_future(self.publisher.submit(
                Publication(0, files, self.clock(), checkpoint)))
            self.store.versions.publish_initial(published.manifest_sha, self.clock())
            self.version = 0
            logger.info("published initial version 0 from %s", model_dir)
        else:
            self.version = current
            await self._resume_learner(current)
            logger.info("resumed at version %d", current)
        newest = self.checkpoints.latest(self.version)
        self.upkeep.checkpointed(self.version if newest is None else newest)
        if not any(e.version == self.version for e in self.store.evals.all()):
            self.upkeep.evaluate(self.version)
        self.finished = self.version >= self.config.learner.max_steps
        if self.finished:  # restarted at or past the last step (a lowered --max-steps): told once all the same
            notices.announce_finished(self.store, self.clock(), self.version)
        self._report()
        self.bell.ring()

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if hasattr(self, "publisher"):
            self.publisher.close()
        self._executor.shutdown(wait=True)
        if self._ranks is not None:
            fsdp.stop(self._ranks)

    def _make_learner(self, model_dir: Path) -> Any:
        return Learner(model_dir, self.config.model, self.config.learner, self.config.sampling.temperature,
                       gguf=self.config.snapshots.offered(), ranks=self._ranks)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _resume_learner(self, current: int) -> None:
        """Rebuild the learner at ``current`` (coordinator.roles.resume: the newest checkpoint, then the steps
        recorded since it replayed)."""
        ckpt = self.checkpoints.latest(current)
        start_dir = await start_folder(self.config, self.snapshots, current, ckpt, lambda: self._model_folder())
        self._set_codec(TextCodec.from_folder(start_dir if (start_dir / "tokenizer.json").exists()
                                              else self.snapshots.folder(current)))
        self.learner = await self._run(self._make_learner, start_dir)
        await restore(self.learner, self.checkpoints, ckpt, current, self.batches, self._run)

    async def _model_folder(self) -> Path:
        return self._model_dir or await self._run(resolve_model_dir, self.config)

    def _set_codec(self, codec: TextCodec) -> None:
        self.codec = codec
        self.prompt_tokens = PromptTokens(codec, self.task.train)  # the same encoding the API signs into jobs
        self.batches = Batches(self.config, self.store, self.prompt_tokens)

    # -- what the other roles read ----------------------------------------------------------------------
    @property
    def in_training(self) -> frozenset[str]:
        """Job ids of the steps trained but not yet recorded."""
        return frozenset().union(*self._unpublished.values())

    def _report(self) -> None:
        """The learner's progress for the API (sequential-pull guard) and the status page."""
        target = max([self.learner.model_version, *self._unpublished]) if hasattr(self, "learner") else self.version
        learner = getattr(self, "learner", None)
        self.store.role_status.set(LEARNER, LearnerReport(
            target=target, version=self.version, in_training=sorted(self.in_training), busy_s=self.busy_s,
            last_error=self.last_error, publishing=sorted(self._unpublished),
            last_checkpoint=self.checkpoints.latest(self.version) if hasattr(self, "checkpoints") else None,
            snapshot_dtype=learner.publish_dtype(self.config.snapshots.dtype) if learner is not None else None,
            trained_version=learner.model_version if learner is not None else None,
            **(learner.describe() if learner is not None else {})))

    # -- the loop -----------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Train whenever B eligible results are buffered (core.scheduling.select_batch), oldest first.

        Each step is handed to the publisher (coordinator.publish.publisher) and the loop goes on at once: in async
        push-pull the next batch trains while the last version is written. The results of a step that is
        still being published are kept out of the next batch; the step, its ingestion marks and the new version
        are recorded in one transaction once the version is fully published."""
        try:
            if self.config.sync_mode == "colocated":
                await self._colocated_loop()
                return
            policy = self.config.sync_policy
            while not self.finished and self.learner.model_version < self.config.learner.max_steps:
                version = self.learner.model_version  # the version this batch updates (may be unpublished yet)
                waited_from = time.monotonic()
                while True:
                    self._check_publication()
                    in_flight = self.in_training
                    pending = [p for p in self.store.results.pending() if p.job_id not in in_flight]
                    batch, too_stale = select_batch(pending, version, policy)
                    if too_stale:
                        self.store.results.mark_stale([p.job_id for p in too_stale], version)
                        logger.info("set aside %d results older than the staleness bound", len(too_stale))
                    if batch:
                        break
                    await self.bell.wait(POLL_S)
                await self._train_step(version, [p.job_id for p in batch], waited_from)
            await self._await_publication()
        except Exception as exc:  # the loop must not die silently; the error is surfaced in status
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("learner step on version %d failed", self.learner.model_version)
            self._report()
            raise

    async def _colocated_loop(self) -> None:
        """Baseline: the same learner, generating its own rollouts in-process (no clients, no network).

        A result binds to a published version (intake checks it against that snapshot's manifest), so the
        rollouts of a version still being published are generated meanwhile and handed in once it is recorded.

        After a restart it first finishes what the interrupted step left: buffered results are trained on and
        jobs it had leased to itself are generated again, so nothing is planned twice or left behind."""
        if self._local_intake is None or self._plan_job is None:
            raise RuntimeError("the co-located baseline runs all roles in one process (layout one-process)")
        local = LocalClient(self.config, self.store, self.prompt_tokens, intake=self._local_intake,
                            plan_job=self._plan_job, run=self._run, clock=self.clock)
        local.register(self.learner.device)
        policy = self.config.sync_policy
        while not self.finished:
            if self._publishing is not None:
                # the version being published is the learner's model in memory: generate its rollouts while
                # the publisher writes it, and hand them in once it is recorded (results bind to published
                # versions), so publication is off this loop's critical path as it is off a client's
                rows = local.next_jobs(policy.jobs_per_step)
                rollouts = await local.rollouts(rows, self.learner.model)
                generated_with = self.learner.model_version
                await self._await_publication()
                if self.finished:
                    break
                assert self.version == generated_with, (self.version, generated_with)
                await local.submit(rows, rollouts, generated_with)
                continue
            version = self.version
            waited_from = time.monotonic()
            pending = self.store.results.pending()
            batch, _ = select_batch(pending, version, policy)
            if not batch:
                rows = local.next_jobs(policy.jobs_per_step - len(pending))
                await local.submit(rows, await local.rollouts(rows, self.learner.model), version)
                continue
            await self._train_step(version, [p.job_id for p in batch], waited_from)
        await self._await_publication()

    async def _train_step(self, version: int, job_ids: list[str], waited_from: float) -> None:
        """Train one batch and hand the new version to the publisher; returns as soon as the learner may take
        the next batch (after the previous version's publication was recorded, so versions commit in order)."""
        t0 = time.monotonic()
        job_ids = sorted(job_ids)  # the training order, which a replay after a restart reproduces
        batch = self.batches.of(version, job_ids)
        new_version = version + 1
        checkpoint = self.upkeep.checkpoint_due(new_version)
        self._unpublished[new_version] = frozenset(job_ids)
        self._report()  # before training: the API issues no job bound to a version this step supersedes
        state: CheckpointState | None = None
        files: SnapshotFiles | None = None
        try:
            metrics, files, state = await self._run(self.hand_over.learn, self.learner, batch.samples, checkpoint)
            t1 = time.monotonic()
            await self._await_publication()  # versions are recorded in order
            metrics["publish_wait_s"] = time.monotonic() - t1
        except BaseException:
            if state is not None:
                state.release()
            if files is not None:  # never submitted: nothing will write it
                files.release()
            self._unpublished.pop(new_version, None)
            raise
        if checkpoint:
            self.upkeep.checkpointed(new_version)
        metrics["wait_s"] = t0 - waited_from
        metrics["learner_s"] = time.monotonic() - waited_from  # this step's learner wall time, waiting included
        metrics["mean_reward"] = sum(batch.rewards) / max(1, len(batch.rewards))
        metrics["clients"] = float(len({r.client_id for r in batch.rows}))
        metrics["staleness_histogram"] = batch.staleness_histogram
        if len(batch.reward_means) > 1:  # several weighted rewards: each one's mean over the batch
            metrics["reward_means"] = batch.reward_means
        future = self.publisher.submit(Publication(new_version, files, self.clock(), state))
        task = asyncio.create_task(self._record_step(version, job_ids, future, metrics, t0),
                                   name=f"publish-v{new_version}")
        self._publishing = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_step(self, version: int, job_ids: list[str], future: Any, metrics: dict[str, Any],
                           t0: float) -> None:
        """When the publisher is done: record the step (ingestion marks, new version, metrics) in one
        transaction, make the version current and wake the roles waiting for it."""
        new_version = version + 1
        try:
            published: Published = await asyncio.wrap_future(future)
        finally:
            self.bell.ring()  # the loop re-checks (and surfaces a failed publication)
        metrics["publish_s"] = published.publish_s
        metrics["checkpoint_s"] = published.checkpoint_s
        metrics["snapshot_bytes"] = float(published.snapshot_bytes)
        metrics["step_s"] = time.monotonic() - t0  # train start → version leasable
        metrics["wall_s"] = self.clock() - self.started_at
        metrics["verify_s"], metrics["eval_s"] = self.upkeep.verifier_seconds()
        mean_reward = metrics.pop("mean_reward")
        self.store.steps.commit(step=new_version, trained_version=version, job_ids=job_ids, new_version=new_version,
                                manifest_sha=published.manifest_sha, mean_reward=mean_reward, metrics=metrics,
                                now=self.clock())
        self._unpublished.pop(new_version, None)
        max_steps = self.config.learner.max_steps
        self.version = new_version
        self.finished = new_version >= max_steps
        if self.finished:  # every volunteer is told, once (docs/protocol.md §4, GET /v1/notices)
            notices.announce_finished(self.store, self.clock(), new_version)
        self.busy_s += metrics["train_s"]
        self._report()
        self.bell.ring()
        # power-safe before the pruning below removes what an older recorded state would resume from
        await asyncio.get_running_loop().run_in_executor(None, self.store.sync)
        self.upkeep.prune(new_version, self.run_dir)
        logger.info("step %d: mean reward %.3f, loss %.4f, %d samples, staleness %s, train %.2fs, publish %.2fs "
                    "(background), %.2fs to leasable", new_version, mean_reward, metrics["loss"],
                    int(metrics["samples"]), metrics["staleness_histogram"], metrics["train_s"],
                    published.publish_s, metrics["step_s"])
        every = self.config.learner.eval_every
        if new_version >= max_steps or (every and new_version % every == 0):
            self.upkeep.evaluate(new_version)
        if self.finished:
            logger.info("run finished at version %d", new_version)

    def _check_publication(self) -> None:
        """Raise here, in the learner loop, if the background publication failed."""
        if self._publishing is not None and self._publishing.done():
            task, self._publishing = self._publishing, None
            task.result()

    async def _await_publication(self) -> None:
        if self._publishing is not None:
            task, self._publishing = self._publishing, None
            await task
