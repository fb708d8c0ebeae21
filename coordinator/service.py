"""The coordinator's I/O shell: owns the store, the snapshot folder, the learner thread and the learner loop.

Request handling here parses, calls the pure rules in :mod:`coordinator.core`, and writes the outcome;
:mod:`coordinator.app` only moves bytes between HTTP and these methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator import spotcheck
from coordinator.checkpoints import CheckpointState, CheckpointStore
from coordinator.config import CoordinatorConfig
from coordinator.core import pacing
from coordinator.core.advantages import group_advantages
from coordinator.core.auth import check_timestamp, nonce_expiry
from coordinator.core.jobs import plan_job, plan_key
from coordinator.core.leases import LeaseCheck, LeaseView, check_lease, deadline_for, lease_live
from coordinator.core.scheduling import decide_lease, select_batch, staleness_weight
from coordinator.core.trust import class_backend, is_invalidating
from coordinator.core.verify import (
    JobTerms,
    TokenStats,
    check_logprobs,
    check_sampling,
    logprob_stats,
    sampling_stats,
    verify_submission,
)
from coordinator.evaluation import EvalOutcome, Evaluator
from coordinator.guard import Guard
from coordinator.learner import Learner, Sample
from coordinator.lora import VersionLoader
from coordinator.publisher import Publication, Published, Publisher
from coordinator.snapshots import SnapshotFiles, SnapshotStore
from coordinator.store import JobRow, Store
from coordinator.tasks import Task, make_task
from coordinator.verifier import Verifier, VersionGone
from shared import PROTOCOL_VERSION, crypto, wire
from shared.errors import ProtocolError, Reason
from shared.hashing import prompt_hash, sha256_bytes
from shared.messages import (
    Info,
    Job,
    JobPrompt,
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
    SamplingParams,
    SignedRequest,
    SubmitResponse,
)
from shared.records import sign_job

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 16 * 1024 * 1024
SMALL_REQUEST_BYTES = 64 * 1024  # register, lease, release
ENVELOPE_BYTES = 1024  # signed-request frame around a body: ids, nonce, signature, msgpack headers
LOCAL_CLIENT = "0" * 32  # the co-located baseline's own generator, registered like any client


def result_size_cap(n_completions: int, max_tokens: int) -> int:
    """Upper bound on an honest result's encoded size: ≤ 5 bytes per token id, 9 per float64, slack.
    (coordinator.config refuses settings whose cap would exceed the 8 MiB message limit.)"""
    return 4096 + n_completions * (64 + max_tokens * 14)


class Coordinator:
    def __init__(self, config: CoordinatorConfig, *, clock: Callable[[], float] = time.time,
                 model_dir: Path | None = None) -> None:
        self.config = config
        self.clock = clock
        self.run_dir = Path(config.run_dir)
        self._model_dir = model_dir
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self._wake = asyncio.Event()
        self._jobs_event = asyncio.Event()
        self._prompt_cache: dict[int, list[int]] = {}
        self.finished = False
        self.version = 0
        self.started_at = clock()
        self.learner_busy_s = 0.0
        self.last_error: str | None = None
        # speed-aware issuance (core.pacing): per-client pace, long-polling clients, how fast versions come
        self._pace: dict[str, float] = {}
        self._pace_observed: set[str] = set()  # clients whose pace comes from results, not a declaration
        self._waiting: dict[str, int] = {}
        self._woken: set[str] = set()  # clients a new version woke to pull it (_next_in_line), for that version
        self._woken_version = -1
        # jobs whose result is being verified (job id → submissions in verification): never reissued meanwhile,
        # so a lease that runs out while the coordinator is busy verifying does not cost the honest holder
        self._verifying: dict[str, int] = {}
        self._version_interval: float | None = None
        self._version_at = self.started_at
        self.issuing_paused = False  # set by the operator (coordinator.admin_api): no new leases while True
        self.in_training: frozenset[str] = frozenset()  # job ids of the steps trained, not yet recorded (spot-checks)
        # learner critical path (coordinator.publisher): steps trained but not yet published → their job ids
        self._unpublished: dict[int, frozenset[str]] = {}
        self._publishing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # publications and evaluations in flight
        self._last_checkpoint_version = 0
        self._last_checkpoint_at = time.monotonic()
        self._verify_s_seen = self._eval_s_seen = 0.0

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(self.run_dir / "coordinator.sqlite")
        self.key, created = crypto.load_or_create_key(self.run_dir / "coordinator.key")
        if created:
            logger.info("created coordinator key %s", self.run_dir / "coordinator.key")
        self.public_key = crypto.public_bytes(self.key)
        run_id = self.store.get_meta("run_id")
        if run_id is None:
            run_id = secrets.token_hex(6)
            self.store.set_meta("run_id", run_id)
        self.run_id = run_id
        self.issuing_paused = self.store.get_meta("issuing_paused") == "1"
        self.guard = Guard(self.config, self.store)
        self.task: Task = make_task(self.config.task)
        self.snapshots = SnapshotStore(self.run_dir / "snapshots", self.key, run_id)
        committed = [v["version"] for v in self.store.versions()]
        self.snapshots.reconcile(committed)
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints")
        current = self.store.current_version()
        self.checkpoints.prune(-1 if current is None else current, startup=True)
        self.publisher = Publisher(self.snapshots, self.checkpoints)
        if current is None:
            model_dir = await self._run(self._resolve_model_dir)
            self.learner = await self._run(self._make_learner, model_dir)
            files, checkpoint = await self._run(self._hand_over, True)
            published = await asyncio.wrap_future(self.publisher.submit(
                Publication(0, files, self.clock(), checkpoint)))
            self.store.publish_initial(published.manifest_sha, self.clock())
            self.version = 0
            logger.info("run %s: published initial version 0 from %s", run_id, model_dir)
        else:
            self.version = current
            await self._resume_learner(current)
            logger.info("run %s: resumed at version %d", run_id, current)
        self._last_checkpoint_at = time.monotonic()
        newest = self.checkpoints.latest(self.version)
        self._last_checkpoint_version = self.version if newest is None else newest
        self.vocab_size = self.learner.vocab_size
        self.verifier = self._make_verifier()
        lora_eval = VersionLoader(self.snapshots.base_dir).load_eval if self.config.learner.lora_rank > 0 else None
        self.evaluator = Evaluator(self.task, self.task.heldout[: self.config.learner.eval_size],
                                   self.config.sampling.max_tokens, load=lora_eval)
        if not any(e["version"] == self.version for e in self.store.evals()):
            self._evaluate(self.version)
        self.finished = self.version >= self.config.learner.max_steps
        if self.config.sync_mode == "colocated":
            self.store.register_client(LOCAL_CLIENT, b"", {"name": "co-located learner", "backend": "torch",
                                                           "device": self.learner.device}, self.clock())

    def _plan_key(self) -> int | str:
        """core.jobs.plan_key: the run seed, with the run's secret (created once, kept in the store) unless
        jobs.secret_plans is off."""
        secret: str | None = None
        if self.config.jobs.secret_plans:
            secret = self.store.get_meta("plan_secret")
            if secret is None:
                secret = secrets.token_hex(16)
                self.store.set_meta("plan_secret", secret)
        return plan_key(self.config.learner.seed, secret)

    def _new_job(self) -> JobRow:
        plan = plan_job(self._plan_key(), self.store.next_seq(), len(self.task.train),
                        self.config.jobs.prompts_per_job)
        return self.store.create_job(plan, self.config.learner.group_size, self.clock())

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if hasattr(self, "evaluator"):
            self.evaluator.close()
        if hasattr(self, "verifier"):
            self.verifier.close()
        if hasattr(self, "publisher"):
            self.publisher.close()
        self._executor.shutdown(wait=True)
        self.store.close()

    def _resolve_model_dir(self) -> Path:
        if self._model_dir is not None:
            return self._model_dir
        if self.config.model.path == "tiny":
            from coordinator.tiny_model import ensure_tiny_model

            return ensure_tiny_model()
        path = Path(self.config.model.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model.path {path} is not a Hugging Face model folder (no config.json); point it at a local "
                f"folder holding config.json, *.safetensors and tokenizer files, or use 'tiny'")
        return path

    def _make_learner(self, model_dir: Path) -> Learner:
        return Learner(model_dir, self.config.model, self.config.learner, self.config.sampling.temperature,
                       gguf=self.config.snapshots.gguf)

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _resume_learner(self, current: int) -> None:
        """Rebuild the learner at ``current``: the newest checkpoint's weights and optimizer state, then the steps
        recorded since it replayed from their ingested results in training order (coordinator.checkpoints).
        Run directories without such a checkpoint resume from the published weights with a fresh optimizer
        (or the per-version optimizer state older releases wrote)."""
        ckpt = self.checkpoints.latest(current)
        # a LoRA checkpoint holds the adapter only: it goes on top of the base model (the run's shared base folder
        # of snapshots, else model.path), never on merged weights
        start_dir = self.snapshots.folder(current)
        if self.config.learner.lora_rank > 0 and ckpt is not None:
            base = self.snapshots.base_dir
            start_dir = base if (base / "config.json").exists() else await self._run(self._resolve_model_dir)
        self.learner = await self._run(self._make_learner, start_dir)
        if ckpt is None:
            self.learner.model_version = current
            legacy = self.checkpoints.folder(current) / "optimizer.pt"
            if not await self._run(self.learner.load_optimizer, legacy) and current > 0:
                logger.warning("no checkpoint for version %d; continuing with a fresh optimizer", current)
            return
        weights, optimizer = await self._run(self.checkpoints.load, ckpt, self.learner.device)
        await self._run(self.learner.load_checkpoint, weights, optimizer, ckpt)
        del weights, optimizer
        by_step: dict[int, list[str]] = {}
        for r in self.store.results_summary():
            if r["ingested_step"] is not None and r["ingested_step"] > ckpt:
                by_step.setdefault(int(r["ingested_step"]), []).append(r["job_id"])
        trained_from = {int(s["step"]): int(s["trained_version"]) for s in self.store.steps() if s["step"] > ckpt}
        t0 = time.monotonic()
        for step in range(ckpt + 1, current + 1):
            samples, _, _, _ = self._batch_samples(trained_from[step], sorted(by_step[step]))
            await self._run(self.learner.train_step, samples)
        assert self.learner.model_version == current, (self.learner.model_version, current)
        logger.info("restored the checkpoint of version %d and replayed %d steps in %.1fs", ckpt, current - ckpt,
                    time.monotonic() - t0)

    # -- authentication -----------------------------------------------------------------------------------
    def _open_envelope(self, raw: bytes, path: str) -> SignedRequest:
        req = wire.decode(raw, SignedRequest, max_bytes=MAX_REQUEST_BYTES)
        if req.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"this coordinator speaks protocol {PROTOCOL_VERSION}, the "
                                                         f"request uses {req.protocol}; upgrade echo-swarm")
        if req.path != path:
            raise ProtocolError(Reason.BAD_SIGNATURE, f"request was signed for {req.path}, sent to {path}")
        return req

    def _check_fresh(self, req: SignedRequest) -> None:
        now = self.clock()
        window = self.config.verification.request_window_s
        check_timestamp(req.timestamp, now, window)
        if not self.store.remember_nonce(req.nonce, nonce_expiry(max(req.timestamp, now), window)):
            raise ProtocolError(Reason.REPLAYED_NONCE, "this request was already received (replayed nonce)")

    def authenticate(self, raw: bytes, path: str) -> SignedRequest:
        """Envelope (protocol, path) → known client → signature → not banned → timestamp → nonce, in that order.

        The ban check follows the signature so that nobody learns whether an id is banned without its key."""
        req = self._open_envelope(raw, path)
        client = self.store.get_client(req.client_id)
        if client is None:
            raise ProtocolError(Reason.UNKNOWN_CLIENT, "this client is not registered; register first")
        crypto.verify_request(req, bytes(client["public_key"]))
        if client["banned"]:
            raise ProtocolError(Reason.BANNED, "this client has been banned by the coordinator's operator")
        self.guard.check_identity(req.client_id, self.clock())
        self.guard.seen(req.client_id, self.clock())
        self._check_fresh(req)
        return req

    # -- endpoints ----------------------------------------------------------------------------------------
    def info(self) -> Info:
        return Info(protocol=PROTOCOL_VERSION, run_id=self.run_id, coordinator_public_key=self.public_key,
                    current_version=self.version, sync_mode=self.config.sync_mode, task=self.task.name,
                    finished=self.finished, server_time=self.clock())

    def register(self, raw: bytes, peer: str = "") -> RegisterResponse:
        req = self._open_envelope(raw, "/v1/register")
        body = wire.decode(req.body, RegisterRequest)
        crypto.verify_request(req, body.public_key)
        existing = self.store.get_client(req.client_id)
        if existing is not None and existing["banned"]:
            raise ProtocolError(Reason.BANNED, "this client has been banned by the coordinator's operator")
        self.guard.check_registration(peer, body.invite, self.clock(), is_new=existing is None)
        # the class is the coordinator's to establish: one of a fixed set, pinned at the first registration
        bclass = self.guard.class_for_registration(req.client_id, body.profile.backend, body.profile.device,
                                                   is_new=existing is None)
        self._check_fresh(req)
        new = self.store.register_client(req.client_id, body.public_key, body.profile.model_dump(), self.clock(),
                                         backend_class=bclass, address=peer or None)
        if req.client_id not in self._pace:  # a declared self-benchmark seeds the pace until a result is seen
            per_job = self.config.jobs.prompts_per_job * self.config.learner.group_size * self.config.sampling.max_tokens
            prior = pacing.declared_pace(body.profile.benchmark_tokens_per_s, per_job)
            if prior is not None:
                self._pace[req.client_id] = prior
        if new:
            logger.info("registered client %s (%s, %s)", req.client_id[:8], body.profile.backend, body.profile.device)
        return RegisterResponse(client_id=req.client_id, new=new, run_id=self.run_id)

    def _notify_jobs(self) -> None:
        """Wake every long-polling lease request: a new version's jobs exist, or a lease was released."""
        self._jobs_event.set()
        self._jobs_event = asyncio.Event()

    async def lease(self, raw: bytes) -> LeaseResponse:
        """Lease the oldest available job, long-polling up to ``jobs.long_poll_s`` for one to appear, so an
        idle client learns of a new policy version as soon as it is published (push), then fetches it (pull).

        A version published while the client waits ends the wait at once, with or without a job, if the
        client is next in line for work (``_next_in_line``): it should spend the idle time pulling the newest
        weights, not sit on old ones and later be handed a job bound to them (async push-pull lets a job keep
        the client's version while within S)."""
        req = self.authenticate(raw, "/v1/lease")
        body = wire.decode(req.body, LeaseRequest)
        self.guard.check_quarantine(req.client_id, self.clock())  # per identity, whatever backend it claims
        give_up = time.monotonic() + self.config.jobs.long_poll_s
        announced = max(self.version, body.held_version)  # what the client knows of once this request began
        self._waiting[req.client_id] = self._waiting.get(req.client_id, 0) + 1
        try:
            while True:
                event = self._jobs_event
                resp = self._try_lease(req.client_id, body.held_version)
                remaining = give_up - time.monotonic()
                if resp.job is not None or resp.finished or remaining <= 0:
                    return resp
                if resp.current_version > announced and self._next_in_line(req.client_id):
                    return resp  # push: pull the new version now, then ask again holding it
                # expired or overdue leases free slots without an event: re-check at least every second
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), timeout=min(remaining, 1.0))
        finally:
            left = self._waiting.pop(req.client_id, 1) - 1
            if left > 0:
                self._waiting[req.client_id] = left

    def _next_in_line(self, client_id: str) -> bool:
        """Is this client among the B fastest of those waiting for work when the current version appeared
        (unknown pace counts as slowest)? Only they are woken by a new version to pull it: in a large idle
        swarm the others would download every version for nothing while faster clients take the work, so
        pulls per version stay bounded by B. Clients already woken for this version still count as ahead, so
        the outcome does not depend on the order in which the waiting requests re-check."""
        if self._woken_version != self.version:
            self._woken_version, self._woken = self.version, set()
        b = self.config.sync_policy.jobs_per_step
        ahead = (self._pace.get(c) for c in self._waiting.keys() | self._woken if c != client_id)
        if len(self._woken - {client_id}) >= b or pacing.faster_count(self._pace.get(client_id), ahead) >= b:
            return False  # the B woken so far (ties, unknown paces) or B faster ones waiting are ahead of it
        self._woken.add(client_id)
        return True

    def _try_lease(self, client_id: str, held_version: int) -> LeaseResponse:
        """Admission (core.scheduling): reissue the oldest expired or released job, else plan a new one, while
        the queue (live leases + untrained results) is below B·(S+1); bind the version it is generated with."""
        retry = self.config.jobs.retry_after_s
        if self.finished or self.config.sync_mode == "colocated" or self.issuing_paused:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=self.finished,
                                 paused=self.issuing_paused and not self.finished)
        if self.config.sync_mode == "sequential-pull" and self.learner.model_version > self.version:
            # a step has trained past the current version and is being published: a job bound to the current
            # version now would be stale (bound 0) before it returns — wasted client work
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        if self.guard.leases_held(client_id, self.clock()) >= self.config.limits.max_leases_per_client:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        replica = self._lease_replica(client_id)  # spot-checks first: they release held results
        if replica is not None:
            return replica
        now = self.clock()
        active = {j.view.job_id: j for j in self.store.active_jobs()}
        views = [j.view for j in active.values()]
        speed = None
        if self.config.jobs.speed_aware:
            views = [self._with_due(v) for v in views]
            speed = self._speed_of(client_id, views, now)
        queued = len(self.store.pending()) + self.guard.held_count()
        reissuable = [v.job_id for v in views if not lease_live(v, now)]
        withheld = self.store.refused_jobs(client_id, reissuable) | self._verifying.keys()
        decision = decide_lease(views, queued, now, self.version, held_version, self.config.sync_policy, speed,
                                frozenset(withheld))
        if decision is None:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        row = active[decision.job_id] if decision.job_id is not None else self._new_job()
        version = decision.version
        if self.store.manifest_sha(version) is None or self.snapshots.signed_manifest(version) is None:
            version = self.version
        lease_id = secrets.token_hex(8)
        deadline = deadline_for(now, self.config.jobs.lease_timeout_s)
        if not self.store.lease_job(row.view.job_id, lease_id, client_id, deadline, version, now):
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        if row.issue_count > 0:
            logger.info("reissued job %s to %s (issue %d)", row.view.job_id, client_id[:8], row.issue_count + 1)
        job = self._job_message(row, version, lease_id, client_id, now, deadline)
        return LeaseResponse(job=sign_job(self.key, job), retry_after_s=retry, current_version=self.version,
                             finished=False)

    def _with_due(self, view: LeaseView) -> LeaseView:
        """The lease with the times its holder is expected back and overdue (core.pacing), if its pace is known."""
        if view.lease_client is None or view.lease_deadline is None:
            return view
        leased_at = view.lease_deadline - self.config.jobs.lease_timeout_s
        pace = self._pace.get(view.lease_client)
        return replace(view, due_at=pacing.due_at(leased_at, pace, self._version_interval),
                       expected_at=pacing.expected_back(leased_at, pace))

    def _speed_of(self, client_id: str, views: list[LeaseView], now: float) -> pacing.ClientSpeed:
        mine = self._pace.get(client_id)
        others = (self._pace.get(c) for c in self._waiting if c != client_id)
        exploring = sum(1 for v in views if lease_live(v, now) and v.lease_client not in self._pace
                        and v.lease_client != client_id)
        return pacing.ClientSpeed(pace_s=mine, faster_waiting=pacing.faster_count(mine, others),
                                  exploring=exploring, step_s=self._version_interval)

    def _observe_pace(self, client_id: str, view: LeaseView, now: float) -> None:
        """Lease-to-result seconds of an accepted result update the client's pace."""
        if view.lease_deadline is not None:
            leased_at = view.lease_deadline - self.config.jobs.lease_timeout_s
            # the first observation replaces a declared (untrusted, optimistic) self-benchmark outright
            previous = self._pace.get(client_id) if client_id in self._pace_observed else None
            self._pace[client_id] = pacing.update_pace(previous, now - leased_at)
            self._pace_observed.add(client_id)

    def _prompt_tokens(self, prompt_id: int) -> list[int]:
        if prompt_id not in self._prompt_cache:
            self._prompt_cache[prompt_id] = self.learner.encode(self.task.train[prompt_id].prompt)
        return self._prompt_cache[prompt_id]

    def _job_message(self, row: JobRow, version: int, lease_id: str, client_id: str, now: float, deadline: float
                     ) -> Job:
        prompts = [JobPrompt(prompt_id=i, token_ids=self._prompt_tokens(i), text=self.task.train[i].prompt)
                   for i in row.prompt_ids]
        n = len(prompts) * row.group_size
        manifest_sha = self.store.manifest_sha(version)
        assert manifest_sha is not None
        return Job(
            protocol=PROTOCOL_VERSION, run_id=self.run_id, job_id=row.view.job_id, lease_id=lease_id,
            client_id=client_id, version=version, manifest_sha256=manifest_sha, prompts=prompts,
            prompt_hash=prompt_hash([p.token_ids for p in prompts]), group_size=row.group_size,
            sampling=SamplingParams(temperature=self.config.sampling.temperature,
                                    max_tokens=self.config.sampling.max_tokens,
                                    stop_token_ids=self.learner.stop_ids),
            seed=row.seed, issued_at=now, deadline=deadline,
            max_result_bytes=result_size_cap(n, self.config.sampling.max_tokens),
        )

    def release(self, raw: bytes) -> ReleaseResponse:
        req = self.authenticate(raw, "/v1/release")
        body = wire.decode(req.body, ReleaseRequest)
        if self.guard.get_replica(body.job_id) is not None:
            return ReleaseResponse(released=self.guard.release_replica(body.job_id, body.lease_id, req.client_id))
        released = self.store.release_lease(body.job_id, body.lease_id, req.client_id)
        if released:
            logger.info("client %s released job %s", req.client_id[:8], body.job_id)
            self._notify_jobs()
        return ReleaseResponse(released=released)

    async def submit(self, raw: bytes) -> SubmitResponse:
        req = self.authenticate(raw, "/v1/results")
        content_sha = sha256_bytes(req.body)
        job_id: str | None = None
        version: int | None = None
        bclass = self.backend_class(req.client_id)
        try:
            sub = wire.decode(req.body, ResultSubmission)
            job_id, version = sub.job_id, sub.version
            self.guard.check_quarantine(req.client_id, self.clock())
            if sub.backend != class_backend(bclass):
                raise ProtocolError(Reason.BINDING_MISMATCH,
                                    f"this result says backend {sub.backend!r}, but this identity registered as "
                                    f"{bclass}; results are verified as the registered class. Send results from "
                                    f"the backend it registered with (or use a new identity for another backend)")
            if self.guard.get_replica(sub.job_id) is not None:
                return await self._submit_replica(req.client_id, sub, len(req.body), content_sha, bclass)
            earlier = self.store.accepted_result(sub.job_id)
            if earlier is not None and earlier["client_id"] == req.client_id and earlier["content_sha256"] == content_sha:
                # the same client resending the same result (its first reply was lost): answer as before
                client = self.store.get_client(req.client_id)
                return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=float(earlier["mean_reward"]),
                                      credit=float(earlier["n_tokens"]),
                                      total_credit=float(client["credit"]) if client is not None else 0.0)
            resp = await self._verify_and_accept(req.client_id, sub, len(req.body), content_sha)
            self._after_accept(req.client_id, sub, bclass)
            return resp
        except ProtocolError as exc:
            self.store.record_rejection(req.client_id, job_id, exc.reason.value, exc.message, content_sha, self.clock(),
                                        version)
            if is_invalidating(exc.reason):
                self.guard.record_invalid(req.client_id, self.clock())
            logger.info("rejected result from %s for %s: %s", req.client_id[:8], job_id, exc)
            raise

    # -- trust boundary (logic in coordinator.guard and coordinator.spotcheck) ------------------------------
    def backend_class(self, client_id: str) -> str:
        """The class the coordinator pinned to this identity (never what a request claims)."""
        return self.guard.pinned_class(client_id)

    def body_cap(self, path: str) -> int:
        """Largest request body accepted on ``path``: results are capped by the largest job this run signs
        (its max_result_bytes plus the signed envelope), every other request by SMALL_REQUEST_BYTES."""
        if path == "/v1/results":
            per_job = self.config.jobs.prompts_per_job * self.config.learner.group_size
            return ENVELOPE_BYTES + result_size_cap(per_job, self.config.sampling.max_tokens)
        return SMALL_REQUEST_BYTES

    def _lease_replica(self, client_id: str) -> LeaseResponse | None:
        return spotcheck.lease_replica(self, client_id)

    async def _submit_replica(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str,
                              bclass: str) -> SubmitResponse:
        return await spotcheck.submit_replica(self, client_id, sub, size, content_sha, bclass)

    def _after_accept(self, client_id: str, sub: ResultSubmission, bclass: str) -> None:
        spotcheck.after_accept(self, client_id, sub, bclass)

    def audit(self, *, client_id: str | None = None, job_id: str | None = None, outcome: str | None = None,
              reason: str | None = None, since: float | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The audit log: every result's outcome (accepted, rejected, replica_accepted, invalidated…) with
        client, job, version, reason and content hash, newest first. For the admin API and CLI."""
        return self.store.audit(client_id=client_id, job_id=job_id, outcome=outcome, reason=reason, since=since,
                                limit=limit)

    def _terms(self, row: JobRow) -> JobTerms:
        return JobTerms(version=-1 if row.view.version is None else row.view.version, prompt_hash=prompt_hash([self._prompt_tokens(i) for i in row.prompt_ids]),
                        seed=row.seed, group_size=row.group_size, n_prompts=len(row.prompt_ids),
                        max_tokens=self.config.sampling.max_tokens, stop_token_ids=frozenset(self.learner.stop_ids),
                        vocab_size=self.vocab_size)

    async def _verify_and_accept(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str) -> SubmitResponse:
        self._verifying[sub.job_id] = self._verifying.get(sub.job_id, 0) + 1
        try:
            return await self._verify_and_accept_held(client_id, sub, size, content_sha)
        finally:
            left = self._verifying.pop(sub.job_id) - 1
            if left > 0:
                self._verifying[sub.job_id] = left

    async def _verify_and_accept_held(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str
                                      ) -> SubmitResponse:
        row = self.store.get_job(sub.job_id)
        if row is None:
            raise ProtocolError(Reason.UNKNOWN_JOB, f"there is no job {sub.job_id}")
        cap = result_size_cap(len(row.prompt_ids) * row.group_size, self.config.sampling.max_tokens)
        if size > cap:
            raise ProtocolError(Reason.BODY_TOO_LARGE, f"result is {size} bytes; this job allows at most {cap}")
        oldest = max(0, self.version - self.config.snapshots.keep_last + 1)
        verify_submission(sub, row.view, self._terms(row), client_id, self.clock(), oldest)
        prompts = [self._prompt_tokens(i) for i in row.prompt_ids for _ in range(row.group_size)]
        completions = [list(c.token_ids) for c in sub.completions]
        token_stats = await self._recompute_stats_at(prompts, completions, sub.version)
        recomputed = token_stats.logprobs
        stats = logprob_stats([c.logprobs for c in sub.completions], recomputed)
        check_logprobs(stats, *self.config.verification.tolerances(self.backend_class(client_id),
                                                                   self.config.snapshots.gguf))
        vcfg = self.config.verification
        if vcfg.sampling_check:  # same recompute: are the tokens as surprising as sampling makes them?
            check_sampling(sampling_stats(token_stats, vcfg.sampling_var_floor), z_low=vcfg.sampling_z_low,
                           z_high=vcfg.sampling_z_high, top_z=vcfg.sampling_top_z, min_tokens=vcfg.sampling_min_tokens,
                           temperature=self.config.sampling.temperature)
        # the result arrived within its lease (verify_submission); if the lease ran out while the learner kept the
        # verification waiting, that delay was the coordinator's, and the job was not reissued meanwhile
        fresh = self.store.get_job(sub.job_id)
        if fresh is None or check_lease(fresh.view, client_id, sub.lease_id, self.clock()) not in (
                LeaseCheck.OK, LeaseCheck.EXPIRED):
            raise ProtocolError(Reason.LEASE_EXPIRED, f"the lease on job {sub.job_id} changed while it was verified")
        items = [self.task.train[i] for i in row.prompt_ids for _ in range(row.group_size)]
        rewards = [self.task.reward(it, self.learner.decode(c)) for it, c in zip(items, completions, strict=True)]
        n_tokens = sum(len(c) for c in completions)
        payload = wire.pack({
            "completions": completions,
            "behaviour_logprobs": [list(c.logprobs) for c in sub.completions],
            "recomputed_logprobs": recomputed,
            "finish_reasons": [c.finish_reason for c in sub.completions],
            "logprob_mean_abs_diff": stats.mean_abs,
        })
        credit = float(n_tokens)
        if not self.store.accept_result(job_id=sub.job_id, lease_id=sub.lease_id, client_id=client_id,
                                        version=sub.version, content_sha256=content_sha, payload=payload,
                                        rewards=rewards, n_tokens=n_tokens, credit=credit, now=self.clock()):
            raise ProtocolError(Reason.NOT_LEASE_HOLDER, f"the lease on job {sub.job_id} changed while it was verified")
        self._observe_pace(client_id, fresh.view, self.clock())
        self._wake.set()
        client = self.store.get_client(client_id)
        return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=sum(rewards) / len(rewards),
                              credit=credit, total_credit=float(client["credit"]) if client else credit)

    def _make_verifier(self) -> Verifier:
        """The verifier role (coordinator.verifier): recompute and replay from published snapshots, on its own
        thread and model replica, so verification never runs on the learner's thread or model."""
        vcfg = self.config.verification

        def folder_of(version: int) -> Path | None:
            return self.snapshots.folder(version) if self.snapshots.signed_manifest(version) is not None else None

        device = self.learner.device if vcfg.device == "auto" else vcfg.device
        loaders: dict[str, Any] = {}
        if self.config.learner.lora_rank > 0:  # a version is the shared base + its adapter (coordinator.lora)
            lora_versions = VersionLoader(self.snapshots.base_dir)
            loaders = {"load_first": lora_versions.load_first, "load_into": lora_versions.load_into,
                       "load_state": lora_versions.load_state}
        return Verifier(folder_of, device=device, dtype=self.config.model.dtype,
                        temperature=self.config.sampling.temperature, pad_id=self.learner.pad_id,
                        stop_ids=self.learner.stop_ids, cached_versions=vcfg.cached_versions, **loaders)

    async def _recompute_at(self, prompts: list[list[int]], completions: list[list[int]], version: int
                            ) -> list[list[float]]:
        """Logprobs under the version that generated the rollout, by the verifier."""
        return (await self._recompute_stats_at(prompts, completions, version)).logprobs

    async def _recompute_stats_at(self, prompts: list[list[int]], completions: list[list[int]], version: int
                                  ) -> TokenStats:
        """Logprobs, entropy and surprisal variance under the version that generated the rollout (one pass)."""
        try:
            return await self.verifier.recompute_stats(prompts, completions, version)
        except VersionGone:
            raise ProtocolError(Reason.WRONG_VERSION,
                                f"policy version {version} is no longer kept for verification") from None

    # -- learner loop -------------------------------------------------------------------------------------
    async def learner_loop(self) -> None:
        """Train whenever B eligible results are buffered (core.scheduling.select_batch), oldest first.

        Each step is handed to the publisher (coordinator.publisher) and the loop goes on at once: in async
        push-pull the next batch trains while the last version is written. The results of a step that is
        still being published are kept out of the next batch (``_unpublished``); the step, its ingestion marks
        and the new version are recorded in one transaction once the version is fully published."""
        if self.config.sync_mode == "colocated":
            await self._colocated_loop()
            return
        policy = self.config.sync_policy
        try:
            while not self.finished and self.learner.model_version < self.config.learner.max_steps:
                version = self.learner.model_version  # the version this batch updates (may be unpublished yet)
                waited_from = time.monotonic()
                while True:
                    self._wake.clear()
                    self._check_publication()
                    in_flight = self.in_training
                    pending = [p for p in self.store.pending() if p.job_id not in in_flight]
                    batch, too_stale = select_batch(pending, version, policy)
                    if too_stale:
                        self.store.mark_stale([p.job_id for p in too_stale], version)
                        logger.info("set aside %d results older than the staleness bound", len(too_stale))
                    if batch:
                        break
                    await self._wake.wait()
                await self._train_step(version, [p.job_id for p in batch], waited_from)
            await self._await_publication()
        except Exception as exc:  # the loop must not die silently; the error is surfaced in status
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("learner step on version %d failed", self.learner.model_version)
            raise

    async def _colocated_loop(self) -> None:
        """Baseline: the same learner, generating its own rollouts in-process (no clients, no network).

        Generation needs the learner's version published (its results are verified against that snapshot and
        bound to it), so here the loop waits for each publication before generating.

        After a restart it first finishes what the interrupted step left: buffered results are trained on and
        jobs it had leased to itself are generated again, so nothing is planned twice or left behind."""
        policy = self.config.sync_policy
        while not self.finished:
            await self._await_publication()
            if self.finished:
                break
            version = self.version
            waited_from = time.monotonic()
            batch, _ = select_batch(self.store.pending(), version, policy)
            if not batch:
                unfinished = self.store.active_jobs()
                row = unfinished[0] if unfinished else self._new_job()
                await self._generate_locally(row, version)
                continue
            await self._train_step(version, [p.job_id for p in batch], waited_from)
        await self._await_publication()

    async def _generate_locally(self, row: JobRow, version: int) -> None:
        from shared.policy import generate

        prompts = [self._prompt_tokens(i) for i in row.prompt_ids]
        samples = await self._run(lambda: generate(
            self.learner.model, prompts, group_size=row.group_size, temperature=self.config.sampling.temperature,
            max_tokens=self.config.sampling.max_tokens, stop_ids=self.learner.stop_ids, seed=row.seed,
            pad_id=self.learner.pad_id))
        now = self.clock()
        lease_id = secrets.token_hex(8)
        if not self.store.lease_job(row.view.job_id, lease_id, LOCAL_CLIENT, deadline_for(now, 3600.0), version, now):
            # a lease left by a crash that has not expired yet: take it over (only this process leases here)
            self.store.release_lease(row.view.job_id, row.view.lease_id or "", LOCAL_CLIENT)
            self.store.lease_job(row.view.job_id, lease_id, LOCAL_CLIENT, deadline_for(now, 3600.0), version, now)
        completions = [smp.to_completion() for smp in samples]
        sub = ResultSubmission(job_id=row.view.job_id, lease_id=lease_id, version=version,
                               prompt_hash=prompt_hash(prompts), seed=row.seed, group_size=row.group_size,
                               backend="torch", generation_s=0.0, completions=completions)
        await self._verify_and_accept(LOCAL_CLIENT, sub, 0, sha256_bytes(wire.encode(sub)))

    def _batch_samples(self, version: int, job_ids: list[str]
                       ) -> tuple[list[Sample], list[float], dict[str, int], list[Any]]:
        """The training samples of a batch of accepted results, for a step that updates ``version`` (also used
        to replay recorded steps after a restart): (samples, rewards, staleness histogram, result rows)."""
        rows = self.store.result_rows(job_ids)
        samples: list[Sample] = []
        rewards_all: list[float] = []
        staleness_hist: dict[str, int] = {}
        for r in rows:
            job = self.store.get_job(r.job_id)
            assert job is not None
            data = wire.unpack(r.payload, max_bytes=len(r.payload))
            advs = group_advantages(r.rewards, job.group_size)
            stale = version - r.version
            assert 0 <= stale <= self.config.sync_policy.bound, f"staleness {stale} outside the bound"
            staleness_hist[str(stale)] = staleness_hist.get(str(stale), 0) + 1
            weight = staleness_weight(stale, self.config.learner.staleness_decay)
            prompts = [self._prompt_tokens(i) for i in job.prompt_ids for _ in range(job.group_size)]
            for k, (p, c) in enumerate(zip(prompts, data["completions"], strict=True)):
                samples.append(Sample(p, c, data["recomputed_logprobs"][k], data["behaviour_logprobs"][k], advs[k],
                                      stale, weight))
            rewards_all.extend(r.rewards)
        return samples, rewards_all, staleness_hist, rows

    def _checkpoint_due(self, new_version: int) -> bool:
        cfg = self.config.learner
        return (new_version >= cfg.max_steps
                or (cfg.checkpoint_every_steps > 0
                    and new_version - self._last_checkpoint_version >= cfg.checkpoint_every_steps)
                or (cfg.checkpoint_every_s > 0
                    and time.monotonic() - self._last_checkpoint_at >= cfg.checkpoint_every_s))

    def _hand_over(self, checkpoint: bool) -> tuple[SnapshotFiles, CheckpointState | None]:
        """On the learner thread: what the publisher needs to write this version (and a checkpoint)."""
        files = self.learner.snapshot_files(self.config.snapshots.dtype)
        return files, self.learner.checkpoint_state() if checkpoint else None

    def _learn(self, samples: list[Sample], checkpoint: bool
               ) -> tuple[dict[str, Any], SnapshotFiles, CheckpointState | None]:
        """On the learner thread: one optimizer step, then the hand-over to the publisher."""
        metrics: dict[str, Any] = self.learner.train_step(samples)
        t0 = time.monotonic()
        files, state = self._hand_over(checkpoint)
        metrics["handover_s"] = time.monotonic() - t0  # the weight copy in the publish dtype
        return metrics, files, state

    async def _train_step(self, version: int, job_ids: list[str], waited_from: float) -> None:
        """Train one batch and hand the new version to the publisher; returns as soon as the learner may take
        the next batch (after the previous version's publication was recorded, so versions commit in order)."""
        t0 = time.monotonic()
        job_ids = sorted(job_ids)  # the training order, which a replay after a restart reproduces
        samples, rewards_all, staleness_hist, rows = self._batch_samples(version, job_ids)
        new_version = version + 1
        checkpoint = self._checkpoint_due(new_version)
        self._unpublished[new_version] = frozenset(job_ids)
        self.in_training = frozenset().union(*self._unpublished.values())
        state: CheckpointState | None = None
        try:
            metrics, files, state = await self._run(self._learn, samples, checkpoint)
            t1 = time.monotonic()
            await self._await_publication()  # versions are recorded in order
            metrics["publish_wait_s"] = time.monotonic() - t1
        except BaseException:
            if state is not None:
                state.release()
            self._unpublished.pop(new_version, None)
            self.in_training = frozenset().union(*self._unpublished.values())
            raise
        if checkpoint:
            self._last_checkpoint_version, self._last_checkpoint_at = new_version, time.monotonic()
        metrics["wait_s"] = t0 - waited_from
        metrics["learner_s"] = time.monotonic() - waited_from  # this step's learner wall time, waiting included
        metrics["mean_reward"] = sum(rewards_all) / max(1, len(rewards_all))
        metrics["clients"] = float(len({r.client_id for r in rows}))
        metrics["staleness_histogram"] = staleness_hist
        future = self.publisher.submit(Publication(new_version, files, self.clock(), state))
        task = asyncio.create_task(self._record_step(version, job_ids, future, metrics, t0),
                                   name=f"publish-v{new_version}")
        self._publishing = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_step(self, version: int, job_ids: list[str], future: Any, metrics: dict[str, Any],
                           t0: float) -> None:
        """When the publisher is done: record the step (ingestion marks, new version, metrics) in one
        transaction, make the version current and wake the clients waiting for it."""
        new_version = version + 1
        try:
            published: Published = await asyncio.wrap_future(future)
        finally:
            self._wake.set()  # the learner loop re-checks (and surfaces a failed publication)
        metrics["publish_s"] = published.publish_s
        metrics["checkpoint_s"] = published.checkpoint_s
        metrics["snapshot_bytes"] = float(published.snapshot_bytes)
        metrics["step_s"] = time.monotonic() - t0  # train start → version leasable
        metrics["wall_s"] = self.clock() - self.started_at
        verify_total = self.verifier.stats.recompute_s  # verification runs in the verifier, off the learner
        metrics["verify_s"], self._verify_s_seen = verify_total - self._verify_s_seen, verify_total
        eval_total = self.evaluator.eval_s_total  # held-out evaluations finished since the previous step
        metrics["eval_s"], self._eval_s_seen = eval_total - self._eval_s_seen, eval_total
        mean_reward = metrics.pop("mean_reward")
        self.store.commit_step(step=new_version, trained_version=version, job_ids=job_ids, new_version=new_version,
                               manifest_sha=published.manifest_sha, mean_reward=mean_reward, metrics=metrics,
                               now=self.clock())
        self._unpublished.pop(new_version, None)
        self.in_training = frozenset().union(*self._unpublished.values())
        max_steps = self.config.learner.max_steps
        self.version = new_version
        now = self.clock()
        self._version_interval = pacing.update_pace(self._version_interval, now - self._version_at)
        self._version_at = now
        self.finished = new_version >= max_steps  # before waking lease requests: no work past the last step
        self._notify_jobs()
        self.learner_busy_s += metrics["train_s"]
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
        """Bound the run directory: keep_last versions, the newest checkpoint, keep_exports exports."""
        keep = set(range(max(0, current - self.config.snapshots.keep_last + 1), current + 1))
        self.snapshots.prune(keep)
        self.checkpoints.prune(current)
        exports = self.run_dir / "exports"
        if exports.exists():
            done = sorted(p for p in exports.iterdir() if p.is_dir() and not p.name.endswith(".partial"))
            for old in done[: max(0, len(done) - self.config.snapshots.keep_exports)]:
                logger.info("removing old export %s (snapshots.keep_exports)", old)
                shutil.rmtree(old, ignore_errors=True)

    def _evaluate(self, version: int) -> None:
        """Queue a held-out evaluation of a published version (coordinator.evaluation.Evaluator, off the
        learner); its result is recorded when it is done."""
        future = self.evaluator.submit(version, self.snapshots.folder(version))
        task = asyncio.create_task(self._record_eval(version, future), name=f"eval-v{version}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_eval(self, version: int, future: Any) -> None:
        try:
            out: EvalOutcome = await asyncio.wrap_future(future)
        except OSError as exc:  # the version was pruned before the evaluator loaded it
            logger.warning("held-out evaluation of version %d skipped: %s", version, exc)
            return
        except Exception:
            logger.exception("held-out evaluation of version %d failed", version)
            return
        self.store.record_eval(out.version, out.accuracy, out.n, self.clock())
        logger.info("version %d: held-out greedy accuracy %.3f on %d prompts (%.1fs, off the learner)", version,
                    out.accuracy, out.n, out.seconds)

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = self.clock()
        jobs = self.store.active_jobs()
        steps = self.store.steps()
        return {
            "run_id": self.run_id,
            "version": self.version,
            "max_steps": self.config.learner.max_steps,
            "finished": self.finished,
            "sync_mode": self.config.sync_mode,
            "max_staleness": self.config.sync_policy.bound,
            "task": self.task.name,
            "uptime_s": now - self.started_at,
            "learner": self.learner.describe() | {
                "busy_s": self.learner_busy_s, "last_error": self.last_error,
                "trained_version": self.learner.model_version,  # ahead of "version" while it is being published
                "publishing": sorted(self._unpublished),
                "last_checkpoint": self.checkpoints.latest(self.version),
                "snapshot_dtype": self.learner.publish_dtype(self.config.snapshots.dtype),
            },
            "jobs": {
                "open": sum(1 for j in jobs if not lease_live(j.view, now)),
                "leased": sum(1 for j in jobs if lease_live(j.view, now)),
                "buffered": len(self.store.pending()),
                "in_flight": [
                    {"job_id": j.view.job_id, "client_id": j.view.lease_client, "deadline": j.view.lease_deadline,
                     "version": j.view.version, "issue_count": j.issue_count}
                    for j in jobs if lease_live(j.view, now)
                ],
            },
            "totals": self.store.totals(),
            "reward_curve": [s["mean_reward"] for s in steps],
            "steps": steps[-200:],
            "evals": self.store.evals(),
            "clients": self.store.clients(),
            "trust": {"standings": self.guard.standings(), "spot_checks": self.guard.replicas_summary()},
        }
