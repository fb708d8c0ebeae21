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
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.core.advantages import group_advantages
from coordinator.core.leases import deadline_for, kept_versions
from coordinator.core.scheduling import select_batch, staleness_weight
from coordinator.core.trust import recompute_class
from coordinator.engine import fsdp
from coordinator.engine.learner import Learner, Sample
from coordinator.engine.tiny_model import ensure_tiny_model
from coordinator.publish.checkpoints import CheckpointState, CheckpointStore
from coordinator.publish.publisher import Publication, Published, Publisher
from coordinator.publish.snapshots import SnapshotFiles, SnapshotStore
from coordinator.run.names import LEARNER, LOCAL_CLIENT, VERIFIER_PREFIX
from coordinator.run.records import AcceptedResult, LearnerReport, VerifierTotals
from coordinator.run.workqueue import POLL_S, Bell
from coordinator.store.hops import EVALUATE, EvaluateRequest
from coordinator.store.job_rows import JobRow
from coordinator.store.store import Store
from coordinator.tasks.base import Task
from coordinator.tasks.text import PromptTokens, TextCodec
from shared import wire
from shared.hashing import prompt_hash, sha256_bytes
from shared.messages import ResultSubmission
from shared.policy import generate, import_backends

logger = logging.getLogger(__name__)

# (client id, submission, size, content sha) → the intake's verdict; the co-located baseline submits its own rollouts
LocalIntake = Callable[[str, Any, int, str], Awaitable[Any]]


def resolve_model_dir(config: CoordinatorConfig) -> Path:
    if config.model.path == "tiny":
        return ensure_tiny_model()
    path = Path(config.model.path).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model.path {path} is not a Hugging Face model folder (no config.json); point it at a local "
            f"folder holding config.json, *.safetensors and tokenizer files, or use 'tiny'")
    return path


@dataclass(frozen=True)
class Batch:
    samples: list[Any]  # coordinator.engine.learner.Sample
    rewards: list[float]
    staleness_histogram: dict[str, int]  # staleness (as a string) → results
    rows: list[Any]  # coordinator.store.results.ResultRow
    reward_means: dict[str, float]  # each reward's own mean, when the task combines several


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
        # the last hand-over's files: the next copy of the weights is taken only once the publisher has written them
        self._handed_over: SnapshotFiles | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._last_checkpoint_version = 0
        self._last_checkpoint_at = time.monotonic()
        self._verify_s_seen = self._eval_s_seen = 0.0

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
        if current is None:
            model_dir = self._model_dir or await self._run(resolve_model_dir, self.config)
            self._set_codec(TextCodec.from_folder(model_dir))
            self.learner = await self._run(self._make_learner, model_dir)
            files, checkpoint = await self._run(self._hand_over, True)
            published = await asyncio.wrap_future(self.publisher.submit(
                Publication(0, files, self.clock(), checkpoint)))
            self.store.versions.publish_initial(published.manifest_sha, self.clock())
            self.version = 0
            logger.info("published initial version 0 from %s", model_dir)
        else:
            self.version = current
            await self._resume_learner(current)
            logger.info("resumed at version %d", current)
        self._last_checkpoint_at = time.monotonic()
        newest = self.checkpoints.latest(self.version)
        self._last_checkpoint_version = self.version if newest is None else newest
        if not any(e.version == self.version for e in self.store.evals.all()):
            self._evaluate(self.version)
        self.finished = self.version >= self.config.learner.max_steps
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
        """Rebuild the learner at ``current``: the newest checkpoint's weights and optimizer state, then the steps
        recorded since it replayed from their ingested results in training order (coordinator.publish.checkpoints).
        Run directories without such a checkpoint resume from the published weights with a fresh optimizer
        (or the per-version optimizer state older releases wrote)."""
        ckpt = self.checkpoints.latest(current)
        # a LoRA checkpoint holds the adapter only: it goes on top of the base model (the run's shared base folder
        # of snapshots, else model.path), never on merged weights
        start_dir = self.snapshots.folder(current)
        if self.config.learner.lora_rank > 0 and ckpt is not None:
            base = self.snapshots.base_dir
            start_dir = base if (base / "config.json").exists() else (
                self._model_dir or await self._run(resolve_model_dir, self.config))
        self._set_codec(TextCodec.from_folder(start_dir if (start_dir / "tokenizer.json").exists()
                                              else self.snapshots.folder(current)))
        self.learner = await self._run(self._make_learner, start_dir)
        if ckpt is None:
            self.learner.model_version = current
            legacy = self.checkpoints.folder(current) / "optimizer.pt"
            if not await self._run(self.learner.load_optimizer, legacy) and current > 0:
                logger.warning("no checkpoint for version %d; continuing with a fresh optimizer", current)
            return
        info = self.checkpoints.info(ckpt)
        if info.get("format") == 2:  # sharded: every rank reads its own shards
            await self._run(self.learner.load_sharded_checkpoint, self.checkpoints.folder(ckpt), ckpt,
                            int(info["world_size"]), bool(info.get("optimizer")))
        else:
            weights, optimizer = await self._run(self.checkpoints.load, ckpt, self.learner.device)
            await self._run(self.learner.load_checkpoint, weights, optimizer, ckpt)
            del weights, optimizer
        by_step: dict[int, list[str]] = {}
        for r in self.store.results.summary():
            if r.ingested_step is not None and r.ingested_step > ckpt:
                by_step.setdefault(int(r.ingested_step), []).append(r.job_id)
        trained_from = {int(s.step): int(s.trained_version) for s in self.store.steps.all() if s.step > ckpt}
        t0 = time.monotonic()
        for step in range(ckpt + 1, current + 1):
            batch = self._batch_samples(trained_from[step], sorted(by_step[step]))
            await self._run(self.learner.train_step, batch.samples)
        assert self.learner.model_version == current, (self.learner.model_version, current)
        logger.info("restored the checkpoint of version %d and replayed %d steps in %.1fs", ckpt, current - ckpt,
                    time.monotonic() - t0)

    def _set_codec(self, codec: TextCodec) -> None:
        self.codec = codec
        self.prompt_tokens = PromptTokens(codec, self.task.train)  # the same encoding the API signs into jobs

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
        self.store.clients.register(LOCAL_CLIENT, b"", {"name": "co-located learner", "backend": "torch",
                                                        "device": self.learner.device}, self.clock())
        policy = self.config.sync_policy
        while not self.finished:
            if self._publishing is not None:
                # the version being published is the learner's model in memory: generate its rollouts while
                # the publisher writes it, and hand them in once it is recorded (results bind to published
                # versions), so publication is off this loop's critical path as it is off a client's
                rows = self._next_local_jobs(policy.jobs_per_step)
                rollouts = await self._rollouts(rows)
                generated_with = self.learner.model_version
                await self._await_publication()
                if self.finished:
                    break
                assert self.version == generated_with, (self.version, generated_with)
                await self._submit_local(rows, rollouts, generated_with)
                continue
            version = self.version
            waited_from = time.monotonic()
            pending = self.store.results.pending()
            batch, _ = select_batch(pending, version, policy)
            if not batch:
                rows = self._next_local_jobs(policy.jobs_per_step - len(pending))
                await self._submit_local(rows, await self._rollouts(rows), version)
                continue
            await self._train_step(version, [p.job_id for p in batch], waited_from)
        await self._await_publication()

    def _next_local_jobs(self, count: int) -> list[JobRow]:
        """The co-located learner's next ``count`` jobs (at least one): the oldest unfinished jobs (one it
        leased before a restart included; one whose reward failed for it is skipped), then new ones."""
        assert self._plan_job is not None
        count = max(1, count)
        active = self.store.jobs.active()
        refused = self.store.results.refused_jobs(LOCAL_CLIENT, [r.view.job_id for r in active])
        rows = [r for r in active if r.view.job_id not in refused][:count]
        while len(rows) < count:
            rows.append(self._plan_job())
        return rows

    async def _rollouts(self, rows: list[JobRow]) -> list[list[Any]]:
        """Generate the completions of ``rows`` with the learner's model as it is in memory, on the learner thread,
        each job in its own batch exactly as a volunteer's torch backend generates it (its prompts × group, padded
        to its own longest prompt, keyed as that job: shared.sampler).

        Why not one batch for the whole step: a row's logits depend in their last bits on the batch around it (the
        padding width, and the matrix kernels torch picks for the batch's size), and a keyed choice whose two best
        noised scores nearly tie follows those bits. Generated job by job, a client with the same device and thread
        count returns the very tokens of this loop, so sequential pull reproduces the co-located run seed by seed
        (bench/sync_modes.py); batched, the two parted after 30–88 identical steps."""

        out = []
        for row in rows:
            prompts = [self.prompt_tokens(i) for i in row.prompt_ids]
            out.append(await self._run(lambda prompts=prompts, row=row: generate(
                self.learner.model, prompts, group_size=row.group_size, temperature=self.config.sampling.temperature,
                max_tokens=self.config.sampling.max_tokens, stop_ids=self.codec.stop_ids, seed=row.seed,
                pad_id=self.codec.pad_id)))
        return out

    async def _submit_local(self, rows: list[JobRow], rollouts: list[list[Any]], version: int) -> None:
        """Lease each job to the co-located learner at ``version`` (published) and hand its rollouts to intake."""

        assert self._local_intake is not None
        for row, samples in zip(rows, rollouts, strict=True):
            prompts = [self.prompt_tokens(i) for i in row.prompt_ids]
            now = self.clock()
            lease_id = secrets.token_hex(8)
            deadline = deadline_for(now, 3600.0)
            if not self.store.jobs.lease(row.view.job_id, lease_id, LOCAL_CLIENT, deadline, version, now):
                # a lease left by a crash that has not expired yet: take it over (only this process leases here)
                self.store.jobs.release(row.view.job_id, row.view.lease_id or "", LOCAL_CLIENT)
                self.store.jobs.lease(row.view.job_id, lease_id, LOCAL_CLIENT, deadline, version, now)
            completions = [smp.to_completion() for smp in samples]
            sub = ResultSubmission(job_id=row.view.job_id, lease_id=lease_id, version=version,
                                   prompt_hash=prompt_hash(prompts), seed=row.seed, group_size=row.group_size,
                                   backend="torch", generation_s=0.0, completions=completions)
            await self._local_intake(LOCAL_CLIENT, sub, 0, sha256_bytes(wire.encode(sub)))

    def _batch_samples(self, version: int, job_ids: list[str]) -> Batch:
        """The training samples of a batch of accepted results, for a step that updates ``version`` (also used
        to replay recorded steps after a restart), with what the step's metrics report about them."""

        rows = self.store.results.rows(job_ids)
        samples: list[Sample] = []
        rewards_all: list[float] = []
        staleness_hist: dict[str, int] = {}
        reward_parts: dict[str, list[float]] = {}
        sources: dict[str, str] = {}
        for r in rows:
            job = self.store.jobs.get(r.job_id)
            assert job is not None
            result = AcceptedResult.decode(r.payload)
            if result.source is None and r.client_id not in sources:
                sources[r.client_id] = self._source(r.client_id)
            source = result.source or sources[r.client_id]
            for name, mean in result.reward_means.items():  # each reward's own mean (task.rewards)
                reward_parts.setdefault(name, []).append(mean)
            advs = group_advantages(r.rewards, job.group_size)
            stale = version - r.version
            assert 0 <= stale <= self.config.sync_policy.bound, f"staleness {stale} outside the bound"
            staleness_hist[str(stale)] = staleness_hist.get(str(stale), 0) + 1
            weight = staleness_weight(stale, self.config.learner.staleness_decay)
            prompts = [self.prompt_tokens(i) for i in job.prompt_ids for _ in range(job.group_size)]
            # episodes: observation tokens masked out
            masks: list[list[int] | None] = list(result.loss_mask) if result.loss_mask else [None] * len(prompts)
            for k, (p, c) in enumerate(zip(prompts, result.completions, strict=True)):
                samples.append(Sample(p, c, result.recomputed_logprobs[k], result.behaviour_logprobs[k], advs[k],
                                      stale, weight, masks[k], source))
            rewards_all.extend(r.rewards)
        return Batch(samples, rewards_all, staleness_hist, rows,
                     {k: sum(v) / len(v) for k, v in sorted(reward_parts.items())})

    def _source(self, client_id: str) -> str:
        """For a result accepted before the intake recorded its class (AcceptedResult.source): the class whose
        recompute was its π_b, "llama-<snapshots.gguf>" for an identity pinned as llama.cpp, "torch" otherwise."""
        client = self.store.clients.get(client_id)
        pinned = str(client["backend_class"] or "") if client is not None else ""
        return recompute_class(pinned, self.config.snapshots.gguf if self.config.snapshots.gguf != "off" else None)

    def _checkpoint_due(self, new_version: int) -> bool:
        cfg = self.config.learner
        return (new_version >= cfg.max_steps
                or (cfg.checkpoint_every_steps > 0
                    and new_version - self._last_checkpoint_version >= cfg.checkpoint_every_steps)
                or (cfg.checkpoint_every_s > 0
                    and time.monotonic() - self._last_checkpoint_at >= cfg.checkpoint_every_s))

    def _hand_over(self, checkpoint: bool) -> tuple[SnapshotFiles, CheckpointState | None]:
        """On the learner thread: what the publisher needs to write this version (and a checkpoint). Waits until
        the previous version's weights are written, which frees its copy: one copy of the weights in flight. (With
        live weights handed over, Learner.snapshot_files, the optimizer step before this already waited for it.)"""
        if self._handed_over is not None:
            self._handed_over.written.wait()
        files = self.learner.snapshot_files(self.config.snapshots.dtype)
        try:
            state = None
            if checkpoint:
                staging = self.checkpoints.staging(self.learner.model_version) if self._ranks is not None else None
                state = self.learner.checkpoint_state(staging)
        except BaseException:
            files.release()
            raise
        self._handed_over = files
        return files, state

    def _learn(self, samples: list[Any], checkpoint: bool
               ) -> tuple[dict[str, Any], SnapshotFiles, CheckpointState | None]:
        """On the learner thread: one optimizer step, then the hand-over to the publisher."""
        metrics: dict[str, Any] = self.learner.train_step(samples)
        t0 = time.monotonic()
        files, state = self._hand_over(checkpoint)
        # the weight copy in the publish dtype, and any wait for the previous version's files to be written
        metrics["handover_s"] = time.monotonic() - t0
        return metrics, files, state

    async def _train_step(self, version: int, job_ids: list[str], waited_from: float) -> None:
        """Train one batch and hand the new version to the publisher; returns as soon as the learner may take
        the next batch (after the previous version's publication was recorded, so versions commit in order)."""
        t0 = time.monotonic()
        job_ids = sorted(job_ids)  # the training order, which a replay after a restart reproduces
        batch = self._batch_samples(version, job_ids)
        new_version = version + 1
        checkpoint = self._checkpoint_due(new_version)
        self._unpublished[new_version] = frozenset(job_ids)
        self._report()  # before training: the API issues no job bound to a version this step supersedes
        state: CheckpointState | None = None
        files: SnapshotFiles | None = None
        try:
            metrics, files, state = await self._run(self._learn, batch.samples, checkpoint)
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
            self._last_checkpoint_version, self._last_checkpoint_at = new_version, time.monotonic()
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

    def _verifier_totals(self) -> tuple[float, float]:
        """Seconds the verifiers spent recomputing and evaluating so far, as they report them."""
        statuses = [VerifierTotals.model_validate(s) for name, s in self.store.role_status.all().items()
                    if name.startswith(VERIFIER_PREFIX)]
        return sum(s.recompute_s for s in statuses), sum(s.eval_s for s in statuses)

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
        verify_total, eval_total = self._verifier_totals()  # verification runs in the verifiers, off the learner
        metrics["verify_s"], self._verify_s_seen = max(0.0, verify_total - self._verify_s_seen), verify_total
        metrics["eval_s"], self._eval_s_seen = max(0.0, eval_total - self._eval_s_seen), eval_total
        mean_reward = metrics.pop("mean_reward")
        self.store.steps.commit(step=new_version, trained_version=version, job_ids=job_ids, new_version=new_version,
                                manifest_sha=published.manifest_sha, mean_reward=mean_reward, metrics=metrics,
                                now=self.clock())
        self._unpublished.pop(new_version, None)
        max_steps = self.config.learner.max_steps
        self.version = new_version
        self.finished = new_version >= max_steps
        self.busy_s += metrics["train_s"]
        self._report()
        self.bell.ring()
        # power-safe before the pruning below removes what an older recorded state would resume from
        await asyncio.get_running_loop().run_in_executor(None, self.store.sync)
        self._prune(new_version)
        logger.info("step %d: mean reward %.3f, loss %.4f, %d samples, staleness %s, train %.2fs, publish %.2fs "
                    "(background), %.2fs to leasable", new_version, mean_reward, metrics["loss"],
                    int(metrics["samples"]), metrics["staleness_histogram"], metrics["train_s"],
                    published.publish_s, metrics["step_s"])
        every = self.config.learner.eval_every
        if new_version >= max_steps or (every and new_version % every == 0):
            self._evaluate(new_version)
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

    def _prune(self, current: int) -> None:
        """Bound the run directory: keep_last versions (and those under a live lease or waiting for their held-out
        evaluation), the newest checkpoint, keep_exports exports."""
        keep = kept_versions(current, self.config.snapshots.keep_last, [j.view for j in self.store.jobs.active()],
                             self.clock(), self.store.work.versions(EVALUATE))
        self.snapshots.prune(keep)
        self.checkpoints.prune(current)
        exports = self.run_dir / "exports"
        if exports.exists():
            done = sorted(p for p in exports.iterdir() if p.is_dir() and not p.name.endswith(".partial"))
            for old in done[: max(0, len(done) - self.config.snapshots.keep_exports)]:
                logger.info("removing old export %s (snapshots.keep_exports)", old)
                shutil.rmtree(old, ignore_errors=True)

    def _evaluate(self, version: int) -> None:
        """Ask the verifiers for a held-out evaluation of a published version (off the learner); the first
        verifier records it when done."""
        self.store.work.submit(EVALUATE, version, EvaluateRequest(), time.time())
        self.bell.ring()
