"""The API role's shell: issuance (leases, pacing, long-poll), the result intake and the run's public state.

Request handling here parses, calls the pure rules in :mod:`coordinator.core`, and writes the outcome;
:mod:`coordinator.api.app` only moves bytes between HTTP and these methods. This module never imports torch: the
learner (:mod:`coordinator.roles.learner`) and the verifiers (:mod:`coordinator.roles.verifier`) are other roles,
reached through the store — recomputes are asked of the verifiers (:class:`coordinator.run.workqueue.RemoteVerifier`),
new versions and the learner's progress are read from it (``_watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coordinator.api.egress import SnapshotEgress
from coordinator.api.guard import Guard
from coordinator.api.issuer import Issuer
from coordinator.api.replies import CoordinatorStatus
from coordinator.api.verdicts import Verdicts
from coordinator.config import CoordinatorConfig
from coordinator.core import pacing
from coordinator.core.auth import check_timestamp, nonce_expiry
from coordinator.core.duplicates import check_copy, surprisal
from coordinator.core.jobs import plan_job, plan_key
from coordinator.core.leases import LeaseCheck, check_lease, deadline_for, kept_versions, lease_live
from coordinator.core.trust import class_backend, is_invalidating, lease_precision, recompute_class
from coordinator.core.verify import (
    JobTerms,
    MarginTally,
    TokenStats,
    check_choices,
    check_logprobs,
    check_sampling,
    choice_stats,
    logprob_stats,
    sampling_stats,
    verify_submission,
)
from coordinator.errors import VersionGone
from coordinator.limits import MAX_REQUEST_BYTES
from coordinator.publish.snapshots import SnapshotStore
from coordinator.run.names import API, LEARNER
from coordinator.run.records import AcceptedResult, LearnerProgress
from coordinator.run.relay import relay_token
from coordinator.run.runfiles import RunFiles, wait_for_first_version
from coordinator.run.workqueue import (
    POLL_S,
    Bell,
    Engine,
    RemoteVerifier,
    VerificationError,
    VerifierUnavailable,
    engine_of,
)
from coordinator.store.hops import RECOMPUTE
from coordinator.store.job_rows import JobRow
from coordinator.store.records import AuditLine, as_json
from coordinator.store.store import Store
from coordinator.tasks.base import Task
from coordinator.tasks.episodes import REWARD_NAME as EPISODE_REWARD
from coordinator.tasks.episodes import EnvTask, episode_behaviour, select
from coordinator.tasks.rewards import RewardFailed
from coordinator.tasks.text import PromptTokens, TextCodec
from shared import PROTOCOL_VERSION, crypto, wire
from shared.endpoints import LEASE, REGISTER, RELEASE, RESULTS
from shared.envs.play import episode_segments
from shared.errors import ProtocolError, Reason
from shared.hashing import prompt_hash, sha256_bytes, tokens_sha256
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
from shared.sampler import Segment, plain_segments

logger = logging.getLogger(__name__)

__all__ = ["Coordinator"]


class Coordinator:
    """The API role. The run files (coordinator.run.runfiles, via ``attach``) and ``bell`` are shared with the other
    roles when they run in the same process; alone, it opens its own and polls the store."""

    def __init__(self, config: CoordinatorConfig, *, clock: Callable[[], float] = time.time,
                 bell: Bell | None = None, model_dir: Path | None = None) -> None:
        self.config = config
        self.clock = clock
        self.model_dir = model_dir  # one-process layout: the learner starts from this folder, not model.path
        self.run_dir = Path(config.run_dir)
        self._files: RunFiles | None = None
        self.bell = bell or Bell()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-io")  # file copies, never torch
        # fsyncs of the store (flush): one at a time, each covering every commit made before it began
        self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-sync")
        self._sync_lock = asyncio.Lock()
        self._synced = 0  # the store's commit count the last finished sync covered
        self._jobs_event = asyncio.Event()
        self.finished = False
        self.version = 0
        self.started_at = clock()
        # speed-aware issuance (coordinator.api.issuer): per-client pace, long-polling clients, how fast versions come
        self.issuer = Issuer(config.sync_policy, lease_timeout_s=config.jobs.lease_timeout_s,
                             speed_aware=config.jobs.speed_aware)
        # jobs whose result is being verified (job id → submissions in verification): never reissued meanwhile,
        # so a lease that runs out while the coordinator is busy verifying does not cost the honest holder
        self._verifying: dict[str, int] = {}
        self.verdicts = Verdicts()  # results in verification, by sender, job and body hash: a resend joins one
        self.recomputes = 0  # recomputes asked of the verifiers for results (/metrics)
        self.issuing_paused = False  # set by the operator (coordinator.api.admin): no new leases while True
        self._watcher: asyncio.Task[None] | None = None
        self._owns_files = False
        #: which API process this is ("api", "api-1", …: several may share one PostgreSQL store; launch.serve sets it)
        self.api_name = API
        self.egress = SnapshotEgress()  # snapshot bytes out over HTTP / libp2p (coordinator.api.egress)
        self.margins = MarginTally()  # passing results' worst keyed margin ÷ tolerance, per class (/metrics)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def attach(self, files: RunFiles) -> None:
        """Share the run files another role of this process opened (the one-process layout)."""
        self._files = files

    async def start(self) -> None:
        self._owns_files = self._files is None
        if self._files is None:  # a process of its own: the other roles' rings reach it through the doorbell
            self._files = RunFiles.open(self.config)
            self.bell.connect(self.run_dir, self.api_name)
        files = self._files
        self.store: Store = files.store
        self.key = files.key
        self.public_key = files.public_key
        self.run_id = files.run_id
        self.task: Task = files.task
        self.snapshots: SnapshotStore = files.snapshots
        self.issuing_paused = self.store.get_meta("issuing_paused") == "1"
        self._synced = self.store.commits
        self.guard = Guard(self.config, self.store)
        # asked by this API's previous run; nobody waits for them (other API processes' requests stay)
        dropped = self.store.work.drop((RECOMPUTE,), self.api_name)
        if dropped:
            logger.info("dropped %d verification requests of the previous API run (their clients resend)", dropped)
        self.version = await wait_for_first_version(self.store, self.bell, API)
        self.snapshots.observe(v.version for v in self.store.versions.all())
        folder = self.snapshots.folder(self.version)
        base = self.snapshots.base_dir
        self.codec = TextCodec.from_folder(folder if (folder / "tokenizer.json").exists() else base)
        self.vocab_size = self.codec.vocab_size
        self.prompt_tokens = PromptTokens(self.codec, self.task.train)
        vcfg = self.config.verification
        self.verifier = RemoteVerifier(self.store, self.bell, wait_s=vcfg.wait_s)
        self.verifier.requester = self.api_name
        self.finished = self.version >= self.config.learner.max_steps
        self.issuer.new_version(time.monotonic())
        self._watcher = asyncio.create_task(self._watch(), name="api-watch")

    async def _watch(self) -> None:
        """Follow the store: a version the learner committed becomes current here (clients are woken for it)."""
        while True:
            try:
                self._catch_up()
            except Exception:  # a busy database must not end the watch; the next look retries
                logger.exception("reading the run's current version failed")
            await self.bell.wait(POLL_S)

    def _catch_up(self) -> None:
        """Make the learner's newest committed version current here, if this API has not seen it yet."""
        current = self.store.versions.current()
        if current is not None and current > self.version:
            self._on_new_version(current)

    def _on_new_version(self, current: int) -> None:
        self.snapshots.observe(v.version for v in self.store.versions.all())
        self.version = current
        self.issuer.new_version(time.monotonic())
        self.finished = current >= self.config.learner.max_steps  # before waking: no work past the last step
        self.notify_jobs()

    def learner_status(self) -> dict[str, object]:
        """The learner's last report (coordinator.roles.learner), or {} before its first: served as it is, the
        role's own JSON (what the API itself reads of it: :class:`LearnerProgress`)."""
        return self.store.role_status.get(LEARNER) or {}

    async def flush(self, since: int = 0) -> None:
        """Make what this process committed so far power-safe before a reply tells a client about it
        (coordinator.api.app's durability middleware), if anything was committed after ``since`` (the watermark
        when the request began: a lease, committed through the light connection, does not wait for an fsync of
        what another role committed meanwhile). The fsync runs in a thread, holding no database lock, while the
        event loop serves other requests; requests that committed while one was running share the next."""
        store = getattr(self, "store", None)
        if store is None:  # not started
            return
        target = store.commits
        if self._synced >= target or target <= since:
            return
        async with self._sync_lock:
            if self._synced >= target:  # a sync that began after our commit finished meanwhile
                return
            upto = store.commits
            await asyncio.get_running_loop().run_in_executor(self._syncer, store.sync)
            self._synced = max(self._synced, upto)

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file work (exports) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

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

    def new_job(self) -> JobRow:
        key, n, per_job = self._plan_key(), len(self.task.train), self.config.jobs.prompts_per_job
        # the next number is drawn under the store's job-stream lock: API processes sharing one database
        return self.store.jobs.create_next(lambda seq: plan_job(key, seq, n, per_job), self.config.learner.group_size,
                                           self.clock())

    async def accept_local(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str
                           ) -> SubmitResponse:
        """The co-located baseline's own rollouts go through the same intake as any client's, recompute included:
        the learner trains on the verifier's recompute as π_b whoever generated the rollout, so the co-located run
        and sequential pull compute the same step from the same tokens, to the last bit (the sampling logprobs of a
        batched decode differ from a teacher-forced pass in their last bits, and the runs would part within a few
        dozen steps: bench/sync_modes.py). Nothing is credited to or held against the local identity.

        A reward that fails on them fails that result only, as for a client's: the refusal is recorded in the audit
        log (reason ``reward_failed``), the job's lease is released, and the learner goes on with other jobs."""
        try:
            return await self._verify_and_accept(client_id, sub, size, content_sha, own=True)
        except RewardFailed as exc:
            self.store.results.record_rejection(client_id, sub.job_id, exc.reason.value, exc.message, content_sha,
                                                self.clock(), sub.version)
            self.store.jobs.release(sub.job_id, sub.lease_id, client_id)
            logger.warning("co-located result for %s refused: %s", sub.job_id, exc.message)
            return SubmitResponse(accepted=False, job_id=sub.job_id, mean_reward=0.0, credit=0.0, total_credit=0.0)

    async def stop(self) -> None:
        await self.verdicts.close()
        if self._watcher is not None and not self._watcher.done():  # (done: its event loop already ended)
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        self._io.shutdown(wait=True)
        self._syncer.shutdown(wait=True)
        if self._owns_files and self._files is not None:
            self.bell.close()
            self._files.close()

    # -- authentication -----------------------------------------------------------------------------------
    def open_envelope(self, raw: bytes, path: str) -> SignedRequest:
        req = wire.decode(raw, SignedRequest, max_bytes=MAX_REQUEST_BYTES)
        if req.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"this coordinator speaks protocol {PROTOCOL_VERSION}, the "
                                                         f"request uses {req.protocol}; upgrade echo-swarm")
        if req.path != path:
            raise ProtocolError(Reason.BAD_SIGNATURE, f"request was signed for {req.path}, sent to {path}")
        return req

    def check_fresh(self, req: SignedRequest) -> None:
        now = self.clock()
        window = self.config.verification.request_window_s
        check_timestamp(req.timestamp, now, window)
        if not self.store.nonces.remember(req.nonce, nonce_expiry(max(req.timestamp, now), window)):
            raise ProtocolError(Reason.REPLAYED_NONCE, "this request was already received (replayed nonce)")

    def authenticate(self, raw: bytes, path: str) -> SignedRequest:
        """Envelope (protocol, path) → known client → signature → not banned → timestamp → nonce, in that order.

        The ban check follows the signature so that nobody learns whether an id is banned without its key."""
        req = self.open_envelope(raw, path)
        client = self.store.clients.get(req.client_id)
        if client is None:
            raise ProtocolError(Reason.UNKNOWN_CLIENT, "this client is not registered; register first")
        crypto.verify_request(req, bytes(client["public_key"]))
        self.guard.check_identity(req.client_id, self.clock())  # charged from here on, whatever refuses it next
        if client["banned"]:
            raise ProtocolError(Reason.BANNED, "this client has been banned by the coordinator's operator")
        self.check_fresh(req)
        return req

    # -- endpoints ----------------------------------------------------------------------------------------
    def info(self) -> Info:
        return Info(protocol=PROTOCOL_VERSION, run_id=self.run_id, coordinator_public_key=self.public_key,
                    current_version=self.version, sync_mode=self.config.sync_mode, task=self.task.name,
                    finished=self.finished, server_time=self.clock())

    def register(self, raw: bytes, peer: str = "") -> RegisterResponse:
        req = self.open_envelope(raw, REGISTER.path)
        body = wire.decode(req.body, RegisterRequest)
        crypto.verify_request(req, body.public_key)
        self.guard.check_identity(req.client_id, self.clock())  # charged from here on, whatever refuses it next
        existing = self.store.clients.get(req.client_id)
        if existing is not None and existing["banned"]:
            raise ProtocolError(Reason.BANNED, "this client has been banned by the coordinator's operator")
        self.guard.check_registration(peer, body.invite, self.clock(), is_new=existing is None)
        # the class is the coordinator's to establish: one of a fixed set, pinned at the first registration
        bclass = self.guard.class_for_registration(req.client_id, body.profile.backend, body.profile.device,
                                                   is_new=existing is None)
        self.check_fresh(req)
        new = self.store.clients.register(req.client_id, body.public_key, body.profile.model_dump(), self.clock(),
                                          backend_class=bclass, address=peer or None)
        # a declared self-benchmark seeds the pace until a result is seen
        per_job = self.config.jobs.prompts_per_job * self.config.learner.group_size * self.config.sampling.max_tokens
        self.issuer.declare(req.client_id, pacing.declared_pace(body.profile.benchmark_tokens_per_s, per_job))
        if new:
            logger.info("registered client %s (%s, %s)", req.client_id[:8], body.profile.backend, body.profile.device)
            # bounded sign-up (issue 24): the longest-idle never-accepted identities beyond the cap are removed
            self.issuer.forget(self.store.clients.expire_idle(self.config.registration.max_idle_identities,
                                                              self.clock(), spare=req.client_id))
        return RegisterResponse(client_id=req.client_id, new=new, run_id=self.run_id)

    def notify_jobs(self) -> None:
        """Wake every long-polling lease request: a new version's jobs exist, or a lease was released."""
        self._jobs_event.set()
        self._jobs_event = asyncio.Event()

    async def lease(self, raw: bytes) -> LeaseResponse:
        """Lease the oldest available job, long-polling up to ``jobs.long_poll_s`` for one to appear, so an
        idle client learns of a new policy version as soon as it is published (push), then fetches it (pull).

        A version published while the client waits ends the wait at once, with or without a job, if the
        client is next in line for work (``Issuer.next_in_line``): it should spend the idle time pulling the
        newest weights, not sit on old ones and later be handed a job bound to them (async push-pull lets a job
        keep the client's version while within S). That reply says ``prefetch``; no other does, so clients the
        coordinator does not expect to work on a version do not download it ahead of a job."""
        req = self.authenticate(raw, LEASE.path)
        body = wire.decode(req.body, LeaseRequest)
        self.guard.check_quarantine(req.client_id, self.clock())  # per identity, whatever backend it claims
        # what the result will be recomputed in: a precision this run publishes for the identity's pinned class
        precision = lease_precision(self.backend_class(req.client_id), body.precision, self.config.snapshots.offered())
        give_up = time.monotonic() + self.config.jobs.long_poll_s
        announced = max(self.version, body.held_version)  # what the client knows of once this request began
        with self.issuer.waiting(req.client_id):
            while True:
                event = self._jobs_event
                resp = self._try_lease(req.client_id, body.held_version, precision)
                remaining = give_up - time.monotonic()
                if resp.job is not None or resp.finished or remaining <= 0:
                    return resp
                if resp.current_version > announced and self.issuer.next_in_line(req.client_id, self.version):
                    # push: pull the new version now, then ask again holding it
                    return resp.model_copy(update={"prefetch": True})
                # expired or overdue leases free slots without an event: re-check at least every second (timeout,
                # not wait_for: on shutdown a cancellation racing a wake-up must end the poll, see Bell.wait)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 1.0)):
                        await event.wait()

    def _try_lease(self, client_id: str, held_version: int, precision: str | None = None) -> LeaseResponse:
        """Admission (core.scheduling): reissue the oldest expired or released job, else plan a new one, while
        the queue (live leases + untrained results) is below B·(S+1); bind the version it is generated with."""
        retry = self.config.jobs.retry_after_s
        # the watch may not have seen the learner's newest version yet (a busy loop): binding a lease to the version
        # this API last saw could name one the learner prunes next (keep_last behind), under the client's lease
        self._catch_up()
        if self.finished or self.config.sync_mode == "colocated" or self.issuing_paused:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=self.finished,
                                 paused=self.issuing_paused and not self.finished)
        if self.config.sync_mode == "sequential-pull" and LearnerProgress.model_validate(self.learner_status()).target > self.version:
            # a step is training past the current version (or being published): a job bound to the current
            # version now would be stale (bound 0) before it returns — wasted client work
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        if self.guard.leases_held(client_id, self.clock()) >= self.config.limits.max_leases_per_client:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        now = self.clock()
        active = {j.view.job_id: j for j in self.store.jobs.active()}
        views = [j.view for j in active.values()]
        queued = len(self.store.results.pending())
        reissuable = [v.job_id for v in views if not lease_live(v, now)]
        withheld = self.store.results.refused_jobs(client_id, reissuable) | self._verifying.keys()
        decision = self.issuer.decide(client_id, views, queued, now, self.version, held_version, frozenset(withheld))
        if decision is None:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        row = active[decision.job_id] if decision.job_id is not None else self.new_job()
        version = decision.version
        if self.store.versions.manifest_sha(version) is None or self.snapshots.signed_manifest(version) is None:
            version = self.version
        lease_id = secrets.token_hex(8)
        deadline = deadline_for(now, self.config.jobs.lease_timeout_s)
        if not self.store.jobs.lease(row.view.job_id, lease_id, client_id, deadline, version, now, precision):
            return LeaseResponse(job=None, retry_after_s=retry, current_version=self.version, finished=False)
        if row.issue_count > 0:
            logger.info("reissued job %s to %s (issue %d)", row.view.job_id, client_id[:8], row.issue_count + 1)
        job = self.job_message(row, version, lease_id, client_id, now, deadline, precision)
        return LeaseResponse(job=sign_job(self.key, job), retry_after_s=retry, current_version=self.version,
                             finished=False)

    def job_message(self, row: JobRow, version: int, lease_id: str, client_id: str, now: float, deadline: float,
                    precision: str | None = None) -> Job:
        prompts = [JobPrompt(prompt_id=i, token_ids=self.prompt_tokens(i), text=self.task.train[i].prompt)
                   for i in row.prompt_ids]
        n = len(prompts) * row.group_size
        manifest_sha = self.store.versions.manifest_sha(version)
        assert manifest_sha is not None
        return Job(
            protocol=PROTOCOL_VERSION, run_id=self.run_id, job_id=row.view.job_id, lease_id=lease_id,
            client_id=client_id, version=version, manifest_sha256=manifest_sha, prompts=prompts,
            prompt_hash=prompt_hash([p.token_ids for p in prompts]), group_size=row.group_size,
            sampling=SamplingParams(temperature=self.config.sampling.temperature,
                                    max_tokens=self.config.sampling.max_tokens,
                                    stop_token_ids=self.codec.stop_ids),
            seed=row.seed, issued_at=now, deadline=deadline, max_result_bytes=self._result_cap(n),
            environment=self.task.spec(row.prompt_ids) if isinstance(self.task, EnvTask) else None,
            precision=precision,  # type: ignore[arg-type]  # core.trust.lease_precision: a Precision or None
        )

    def _result_cap(self, n_completions: int) -> int:
        return self.config.result_cap(n_completions)

    def release(self, raw: bytes) -> ReleaseResponse:
        req = self.authenticate(raw, RELEASE.path)
        body = wire.decode(req.body, ReleaseRequest)
        released = self.store.jobs.release(body.job_id, body.lease_id, req.client_id)
        if released:
            logger.info("client %s released job %s", req.client_id[:8], body.job_id)
            self.notify_jobs()
        return ReleaseResponse(released=released)

    async def submit(self, raw: bytes) -> SubmitResponse:
        req = self.authenticate(raw, RESULTS.path)
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
            earlier = self.store.results.get(sub.job_id)
        except ProtocolError as exc:
            self._refused(req.client_id, job_id, version, content_sha, exc)
            raise
        if earlier is not None and earlier["client_id"] == req.client_id and earlier["content_sha256"] == content_sha:
            # the same client resending the same result (its first reply was lost): answer as before
            client = self.store.clients.get(req.client_id)
            return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=float(earlier["mean_reward"]),
                                  credit=float(earlier["n_tokens"]),
                                  total_credit=float(client["credit"]) if client is not None else 0.0)
        # a resend while the first copy is still being verified joins that verification (coordinator.api.verdicts)
        return await self.verdicts.once((req.client_id, sub.job_id, content_sha), functools.partial(
            self._verdict, req.client_id, sub, len(req.body), content_sha))

    async def _verdict(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str) -> SubmitResponse:
        """Verify a client's result and record the outcome, once for every copy of it that joins."""
        try:
            return await self._verify_and_accept(client_id, sub, size, content_sha)
        except ProtocolError as exc:
            self._refused(client_id, sub.job_id, sub.version, content_sha, exc)
            raise

    def _refused(self, client_id: str, job_id: str | None, version: int | None, content_sha: str,
                 exc: ProtocolError) -> None:
        if exc.reason is Reason.UNAVAILABLE:
            return  # the coordinator's own shortfall: nothing is recorded against the client
        self.store.results.record_rejection(client_id, job_id, exc.reason.value, exc.message, content_sha,
                                            self.clock(), version)
        if is_invalidating(exc.reason):
            self.guard.record_invalid(client_id, self.clock())
        logger.info("rejected result from %s for %s: %s", client_id[:8], job_id, exc)

    # -- trust boundary (logic in coordinator.api.guard) ----------------------------------------------------------
    def backend_class(self, client_id: str) -> str:
        """The class the coordinator pinned to this identity (never what a request claims)."""
        return self.guard.pinned_class(client_id)

    def body_cap(self, path: str) -> int:
        return self.config.body_cap(path)

    @functools.cached_property
    def relay_token(self) -> str:
        """The token the p2p role's relayed calls carry (coordinator.roles.p2p_relay); known once started."""
        return relay_token(self.key, self.run_id)

    def audit(self, *, client_id: str | None = None, job_id: str | None = None, outcome: str | None = None,
              reason: str | None = None, since: float | None = None, limit: int = 100) -> list[AuditLine]:
        """The audit log: every result's outcome (accepted, rejected…) with
        client, job, version, reason and content hash, newest first. For the admin API and CLI."""
        return self.store.audit.lines(client_id=client_id, job_id=job_id, outcome=outcome, reason=reason, since=since,
                                      limit=limit)

    def terms(self, row: JobRow) -> JobTerms:
        return JobTerms(version=-1 if row.view.version is None else row.view.version, prompt_hash=prompt_hash([self.prompt_tokens(i) for i in row.prompt_ids]),
                        seed=row.seed, group_size=row.group_size, n_prompts=len(row.prompt_ids),
                        max_tokens=self.config.sampling.max_tokens, stop_token_ids=frozenset(self.codec.stop_ids),
                        vocab_size=self.vocab_size, episodes=isinstance(self.task, EnvTask))

    async def _verify_and_accept(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str, *,
                                 own: bool = False) -> SubmitResponse:
        self._verifying[sub.job_id] = self._verifying.get(sub.job_id, 0) + 1
        try:
            return await self._verify_and_accept_held(client_id, sub, size, content_sha, own)
        finally:
            left = self._verifying.pop(sub.job_id) - 1
            if left > 0:
                self._verifying[sub.job_id] = left

    async def _verify_and_accept_held(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str,
                                      own: bool) -> SubmitResponse:
        row = self.store.jobs.get(sub.job_id)
        if row is None:
            raise ProtocolError(Reason.UNKNOWN_JOB, f"there is no job {sub.job_id}")
        cap = self._result_cap(len(row.prompt_ids) * row.group_size)
        if size > cap:
            raise ProtocolError(Reason.BODY_TOO_LARGE, f"result is {size} bytes; this job allows at most {cap}")
        # the learner keeps the version of every live lease (core.leases.kept_versions), so a lease holder's result
        # is verifiable however far the policy moved; verify_submission checks the lease before the version
        oldest = min(kept_versions(self.version, self.config.snapshots.keep_last, [row.view], self.clock()))
        verify_submission(sub, row.view, self.terms(row), client_id, self.clock(), oldest)
        tokens_sha = self._refuse_copy(sub)  # before any forward pass is spent on a copy (core.duplicates)
        prompts = [self.prompt_tokens(i) for i in row.prompt_ids for _ in range(row.group_size)]
        completions = [list(c.token_ids) for c in sub.completions]
        reported: list[list[float]] = [list(c.logprobs) for c in sub.completions]
        replayed = None
        if isinstance(self.task, EnvTask):  # episodes: replayed here, before any forward pass is spent on them
            replayed = self.task.replay(
                sub.completions, [self.task.train[i].seed for i in row.prompt_ids for _ in range(row.group_size)],
                tokenizer=self.codec.tokenizer, max_tokens=self.config.sampling.max_tokens,
                stop_ids=frozenset(self.codec.stop_ids), vocab_size=self.vocab_size)
            completions, reported = replayed.sequences, replayed.reported
        # every sampled token's keyed draw (shared.sampler): the job's seed, or each episode turn's (shared.envs.play)
        if replayed is None:
            segments = plain_segments(row.seed, [len(c) for c in completions])
        else:
            segments = episode_segments(row.seed, [[(len(t.token_ids), len(t.observation_ids)) for t in c.turns or []]
                                                   for c in sub.completions])
        # recomputed as the lease said (core.trust.recompute_class): a llama.cpp client's result by llama.cpp on the
        # very GGUF file its lease named; the co-located loop's own (torch) rollouts and torch clients' from the
        # safetensors. The lease is this client's (verify_submission), so its precision is the one it was granted
        pinned = self.backend_class(client_id)  # a store read: once per result
        rclass = "torch" if own else recompute_class(pinned, row.precision)
        engine = engine_of(rclass)
        # the llama.cpp recompute replays the client's evaluations: a group's rollouts share the prompt's cache, an
        # episode's every turn starts afresh (shared.llama_files.prefill)
        token_stats = await self._recompute_stats_at(prompts, completions, sub.version, segments, engine,
                                                     1 if replayed is not None else row.group_size, row.precision)
        if replayed is not None:  # the model's tokens only, never the observations'
            full_recomputed = token_stats.logprobs
            m = replayed.masks
            token_stats = TokenStats(
                select(token_stats.logprobs, m), select(token_stats.entropy, m), select(token_stats.variance, m),
                select(token_stats.top, m), None if token_stats.margins is None else select(token_stats.margins, m))
        recomputed = token_stats.logprobs
        stats = logprob_stats(reported, recomputed)
        check_logprobs(stats, *self.config.verification.tolerances(rclass))
        vcfg = self.config.verification
        if vcfg.choice_check and token_stats.margins is not None:  # every token's choice
            choices = choice_stats(token_stats.margins)
            # margins are in tempered units: the tolerance too
            choice_tol = vcfg.choice_tolerance(rclass) / self.config.sampling.temperature
            check_choices(choices, choice_tol)
            self.margins.add(pinned, choices.worst, choice_tol)  # by hardware: a GPU client's margins apart
        if vcfg.sampling_check:  # are the tokens as surprising as sampling makes them?
            check_sampling(sampling_stats(token_stats, vcfg.sampling_var_floor), z_low=vcfg.sampling_z_low,
                           z_high=vcfg.sampling_z_high, top_z=vcfg.sampling_top_z, min_tokens=vcfg.sampling_min_tokens,
                           temperature=self.config.sampling.temperature)
        # the result arrived within its lease (verify_submission); if the lease ran out while the learner kept the
        # verification waiting, that delay was the coordinator's, and the job was not reissued meanwhile
        fresh = self.store.jobs.get(sub.job_id)
        if fresh is None or check_lease(fresh.view, client_id, sub.lease_id, self.clock()) not in (
                LeaseCheck.OK, LeaseCheck.EXPIRED):
            raise ProtocolError(Reason.LEASE_EXPIRED, f"the lease on job {sub.job_id} changed while it was verified")
        behaviour, loss_mask = reported, None
        if replayed is not None:  # rewards from the replay; the learner trains on the model's tokens only
            rewards = replayed.rewards
            reward_means = {EPISODE_REWARD: sum(rewards) / len(rewards)}
            behaviour, loss_mask = episode_behaviour(replayed, full_recomputed), replayed.masks
            recomputed = [list(r) for r in full_recomputed]
            n_tokens = sum(len(r) for r in replayed.reported)
        else:
            items = [self.task.train[i] for i in row.prompt_ids for _ in range(row.group_size)]
            scored = self.task.score(items, [self.codec.decode(c) for c in completions])  # RewardFailed: a refusal
            rewards, reward_means = scored.rewards, scored.per_reward_means
            n_tokens = sum(len(c) for c in completions)
        payload = AcceptedResult(
            completions=completions, behaviour_logprobs=behaviour, recomputed_logprobs=recomputed,
            finish_reasons=[c.finish_reason for c in sub.completions], logprob_mean_abs_diff=stats.mean_abs,
            reward_means=reward_means, loss_mask=loss_mask, source=rclass).encode()
        credit = float(n_tokens)
        if not self.store.results.accept(job_id=sub.job_id, lease_id=sub.lease_id, client_id=client_id,
                                         version=sub.version, content_sha256=content_sha, payload=payload,
                                         rewards=rewards, n_tokens=n_tokens, credit=credit, now=self.clock(),
                                         completions_sha256=tokens_sha):
            raise ProtocolError(Reason.NOT_LEASE_HOLDER, f"the lease on job {sub.job_id} changed while it was verified")
        if not own:  # every token was checked against the keyed sampler: the result is conclusive evidence
            self.guard.record_valid(client_id)
            self.guard.check_reporting(client_id, self.clock())  # …of its tokens, not of which results it returns
        self.issuer.observe(client_id, fresh.view, self.clock())
        self.bell.ring()  # the learner may have a batch now
        client = self.store.clients.get(client_id)
        return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=sum(rewards) / len(rewards),
                              credit=credit, total_credit=float(client["credit"]) if client else credit)

    def _refuse_copy(self, sub: ResultSubmission) -> str:
        """The content hash of the result's tokens (an episode's: its actions and observations, turn by turn);
        refused with duplicate_result if another job's accepted result has the same tokens and the result holds
        enough choice for that to be no coincidence (coordinator.core.duplicates)."""
        tokens = [list(c.token_ids) if c.turns is None else
                  [t for turn in c.turns for t in (*turn.token_ids, *turn.observation_ids)] for c in sub.completions]
        logprobs = [list(c.logprobs) if c.turns is None else [x for turn in c.turns for x in turn.logprobs]
                    for c in sub.completions]
        sha = tokens_sha256(tokens)
        check_copy(self.store.results.with_tokens(sha, sub.job_id), sub.job_id, surprisal(logprobs))
        return sha

    async def recompute_at(self, prompts: list[list[int]], completions: list[list[int]], version: int
                            ) -> list[list[float]]:
        """Logprobs under the version that generated the rollout, by the verifier."""
        return (await self._recompute_stats_at(prompts, completions, version)).logprobs

    async def _recompute_stats_at(self, prompts: list[list[int]], completions: list[list[int]], version: int,
                                  segments: list[list[Segment]] | None = None, engine: Engine = "torch",
                                  group: int = 1, precision: str | None = None) -> TokenStats:
        """Logprobs, entropy and surprisal variance under the version that generated the rollout (one pass, by
        ``engine`` in ``precision``), and with the completions' keyed draws (``segments``) each token's
        keyed-sampler margin."""
        self.recomputes += 1
        try:
            return await self.verifier.recompute_stats(prompts, completions, version, segments, engine=engine,
                                                       group=group, precision=precision)
        except VersionGone:
            raise ProtocolError(Reason.VERSION_RETIRED,
                                f"policy version {version} is no longer kept for verification") from None
        except VerifierUnavailable as exc:
            raise ProtocolError(Reason.UNAVAILABLE, f"the coordinator could not verify this result now ({exc}); "
                                                    f"resend it later within its lease") from None
        except VerificationError as exc:
            raise RuntimeError(f"verification failed: {exc}") from None

    # -- status -------------------------------------------------------------------------------------------
    def status(self) -> CoordinatorStatus:
        now = self.clock()
        jobs = self.store.jobs.active()
        steps = self.store.steps.all()
        return {
            "run_id": self.run_id,
            "version": self.version,
            "max_steps": self.config.learner.max_steps,
            "finished": self.finished,
            "sync_mode": self.config.sync_mode,
            "max_staleness": self.config.sync_policy.bound,
            "task": self.task.name,
            "uptime_s": now - self.started_at,
            "learner": self.learner_status(),  # its own report: trained_version runs ahead while publishing
            "roles": self.store.role_status.all(),
            "jobs": {
                "open": sum(1 for j in jobs if not lease_live(j.view, now)),
                "leased": sum(1 for j in jobs if lease_live(j.view, now)),
                "buffered": len(self.store.results.pending()),
                "in_flight": [
                    {"job_id": j.view.job_id, "client_id": j.view.lease_client, "deadline": j.view.lease_deadline,
                     "version": j.view.version, "issue_count": j.issue_count}
                    for j in jobs if lease_live(j.view, now)
                ],
            },
            "totals": self.store.totals(),
            "reward_curve": [s.mean_reward for s in steps],
            "steps": [as_json(s) for s in steps[-200:]],
            "evals": [as_json(e) for e in self.store.evals.all()],
            "clients": [as_json(c) for c in self.store.clients.all()],
            "trust": {"standings": [as_json(t) for t in self.guard.standings()]},
        }
