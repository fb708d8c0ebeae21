"""Sending work: ``POST /v1/lease`` (admission, the long poll, the signed job) and ``POST /v1/release``.

A lease request, in order: the sender signed in (coordinator.api.signin), not quarantined, granted a precision
its pinned class may be recomputed in; then, until a job or the long poll's end, the admission rules of
:mod:`coordinator.core.scheduling` through the speed-aware :class:`coordinator.api.issuer.Issuer`: reissue the
oldest expired or released job, else plan a new one, while the queue (live leases + untrained results) is below
B·(S+1); else, to a measured client, a replica of a job an unproven client holds (core.scheduling.choose_replica:
the same job, key and version, a second lease); the job is bound to a version the learner keeps and signed with the
run's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.api.phase import Phase
from coordinator.core.jobs import plan_job, plan_key
from coordinator.core.leases import deadline_for
from coordinator.core.trust import lease_precision
from coordinator.run.names import LEARNER
from coordinator.run.records import LearnerProgress
from coordinator.store.job_rows import JobRow
from coordinator.tasks.episodes import EnvTask
from shared import PROTOCOL_VERSION, wire
from shared.endpoints import LEASE, RELEASE
from shared.hashing import prompt_hash
from shared.messages import (
    Job,
    JobPrompt,
    LeaseRequest,
    LeaseResponse,
    ReleaseRequest,
    ReleaseResponse,
    SamplingParams,
)
from shared.records import sign_job

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Leasing(Phase):
    """Leases and releases, over the phases' collaborators (coordinator.api.phase). ``catch_up`` makes the
    learner's newest committed version current before a job is bound (the watch, coordinator.api.service)."""

    catch_up: Callable[[], None]
    _jobs_event: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

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
        coordinator does not expect to work on a version do not download it ahead of a job.

        Of a large waiting swarm only the head of rule 1's order can be served (``Issuer.waiters.candidates``): the
        others wait without re-checking — a wake-up costs them a binary search, not a read of the queue and a
        decision — until they move into that head at a wake-up, or their poll ends."""
        req = self.signin.authenticate(raw, LEASE.path)
        body = wire.decode(req.body, LeaseRequest)
        self.guard.check_quarantine(req.client_id, self.clock())  # per identity, whatever backend it claims
        # what the result will be recomputed in: a precision this run publishes for the identity's pinned class
        precision = lease_precision(self.guard.pinned_class(req.client_id), body.precision,
                                    self.config.snapshots.offered())
        give_up = time.monotonic() + self.config.jobs.long_poll_s
        announced = max(self.state.version, body.held_version)  # what the client knows of once this request began
        with self.issuer.waiting(req.client_id):
            while True:
                event = self._jobs_event
                if not self.issuer.waiters.in_window(req.client_id) and not self.state.finished \
                        and give_up > time.monotonic():
                    # rule 1: enough faster clients wait that a re-check would give this one nothing, nor is it next in
                    # line for a new version (api.waiting): no store read, no decision, no tick — it waits for the next
                    # wake-up or its poll's end (then it re-checks, and its reply is what a decision says)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(give_up - time.monotonic()):
                            await event.wait()
                    continue
                resp = self._try_lease(req.client_id, body.held_version, precision)
                remaining = give_up - time.monotonic()
                if resp.job is not None or resp.finished or remaining <= 0:
                    return resp
                if resp.current_version > announced and self.issuer.next_in_line(req.client_id, self.state.version):
                    # push: pull the new version now, then ask again holding it
                    return resp.model_copy(update={"prefetch": True})
                # expired or overdue leases free slots without an event: re-check at least every second (timeout,
                # not wait_for: on shutdown a cancellation racing a wake-up must end the poll, see Bell.wait)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, 1.0)):
                        await event.wait()

    def release(self, raw: bytes) -> ReleaseResponse:
        req = self.signin.authenticate(raw, RELEASE.path)
        body = wire.decode(req.body, ReleaseRequest)
        released = self.files.store.jobs.release(body.job_id, body.lease_id, req.client_id)
        if released:
            logger.info("client %s released job %s", req.client_id[:8], body.job_id)
            self.notify_jobs()
        return ReleaseResponse(released=released)

    def new_job(self) -> JobRow:
        """The next job of the run's plan (core.jobs.plan_job); the co-located learner plans its own this way."""
        key, n, per_job = self._plan_key(), len(self.files.task.train), self.config.jobs.prompts_per_job
        # the next number is drawn under the store's job-stream lock: API processes sharing one database
        return self.files.store.jobs.create_next(lambda seq: plan_job(key, seq, n, per_job),
                                                 self.config.learner.group_size, self.clock())

    def _plan_key(self) -> int | str:
        """core.jobs.plan_key: the run seed, with the run's secret (created once, kept in the store) unless
        jobs.secret_plans is off."""
        secret: str | None = None
        if self.config.jobs.secret_plans:
            secret = self.files.store.get_meta("plan_secret")
            if secret is None:
                secret = secrets.token_hex(16)
                self.files.store.set_meta("plan_secret", secret)
        return plan_key(self.config.learner.seed, secret)

    def _no_job(self) -> LeaseResponse | None:
        """Why no client gets a job now, as the reply that says so; None while issuing."""
        state, retry = self.state, self.config.jobs.retry_after_s
        if state.finished or self.config.sync_mode == "colocated" or state.issuing_paused:
            return LeaseResponse(job=None, retry_after_s=retry, current_version=state.version, finished=state.finished,
                                 paused=state.issuing_paused and not state.finished)
        if self.config.sync_mode == "sequential-pull" and LearnerProgress.model_validate(
                self.files.store.role_status.get(LEARNER) or {}).target > state.version:
            # a step is training past the current version (or being published): a job bound to the current
            # version now would be stale (bound 0) before it returns — wasted client work
            return self._retry()
        return None

    def _retry(self) -> LeaseResponse:
        return LeaseResponse(job=None, retry_after_s=self.config.jobs.retry_after_s,
                             current_version=self.state.version, finished=False)

    def _try_lease(self, client_id: str, held_version: int, precision: str | None = None) -> LeaseResponse:
        """Admission (core.scheduling): reissue the oldest expired or released job, else plan a new one, while
        the queue (live leases + untrained results) is below B·(S+1); bind the version it is generated with."""
        # the watch may not have seen the learner's newest version yet (a busy loop): binding a lease to the version
        # this API last saw could name one the learner prunes next (keep_last behind), under the client's lease
        self.catch_up()
        refusal = self._no_job()
        if refusal is not None:
            return refusal
        if self.guard.leases_held(client_id, self.clock()) >= self.config.limits.max_leases_per_client:
            return self._retry()
        now = self.clock()
        active = {j.view.job_id: j for j in self.files.store.jobs.active()}
        views = [j.view for j in active.values()]
        queued = len(self.files.store.results.pending())
        # the jobs it had a result refused for: none is reissued to it, nor replicated for it
        withheld = self.files.store.results.refused_jobs(client_id, [v.job_id for v in views])
        decision = self.issuer.decide(client_id, views, queued, now, self.state.version, held_version,
                                      frozenset(withheld), frozenset(self.verifying.jobs()))
        if decision is None:
            return self._retry()
        row = active[decision.job_id] if decision.job_id is not None else self.new_job()
        lease_id = secrets.token_hex(8)
        deadline = deadline_for(now, self.config.jobs.lease_timeout_s)
        if decision.replica:  # the job's version, which the learner keeps while its first lease is live
            version = self.files.store.jobs.lease_replica(row.view.job_id, lease_id, client_id, deadline, now,
                                                          precision)
            if version is not None:
                logger.info("replica of job %s (held by unproven %s) to %s", row.view.job_id,
                            (row.view.lease_client or "")[:8], client_id[:8])
        else:
            version = self._leased(row, client_id, lease_id, deadline, decision.version, now, precision)
            if version is not None and not self.issuer.proven(client_id) and self.issuer.proven_waiting():
                self.notify_jobs()  # a measured waiter may replicate it now, not at its poll's next re-check
        if version is None:
            return self._retry()
        job = self._job_message(row, version, lease_id, client_id, now, deadline, precision)
        return LeaseResponse(job=sign_job(self.files.key, job), retry_after_s=self.config.jobs.retry_after_s,
                             current_version=self.state.version, finished=False)

    def _leased(self, row: JobRow, client_id: str, lease_id: str, deadline: float, version: int, now: float,
                precision: str | None) -> int | None:
        """Lease a new or reissued job (Jobs.lease) bound to ``version``, or the current one if ``version``'s
        files are gone; the version, or None if the job changed meanwhile."""
        if (self.files.store.versions.manifest_sha(version) is None
                or self.files.snapshots.signed_manifest(version) is None):
            version = self.state.version
        if not self.files.store.jobs.lease(row.view.job_id, lease_id, client_id, deadline, version, now, precision):
            return None
        if row.issue_count > 0:
            logger.info("reissued job %s to %s (issue %d)", row.view.job_id, client_id[:8], row.issue_count + 1)
        return version

    def _job_message(self, row: JobRow, version: int, lease_id: str, client_id: str, now: float, deadline: float,
                     precision: str | None = None) -> Job:
        task = self.files.task
        prompts = [JobPrompt(prompt_id=i, token_ids=self.prompt_tokens(i), text=task.train[i].prompt)
                   for i in row.prompt_ids]
        n = len(prompts) * row.group_size
        manifest_sha = self.files.store.versions.manifest_sha(version)
        assert manifest_sha is not None
        return Job(
            protocol=PROTOCOL_VERSION, run_id=self.files.run_id, job_id=row.view.job_id, lease_id=lease_id,
            client_id=client_id, version=version, manifest_sha256=manifest_sha, prompts=prompts,
            prompt_hash=prompt_hash([p.token_ids for p in prompts]), group_size=row.group_size,
            sampling=SamplingParams(temperature=self.config.sampling.temperature,
                                    max_tokens=self.config.sampling.max_tokens,
                                    stop_token_ids=self.prompt_tokens.codec.stop_ids),
            seed=row.seed, issued_at=now, deadline=deadline, max_result_bytes=self.config.result_cap(n),
            environment=task.spec(row.prompt_ids) if isinstance(task, EnvTask) else None,
            precision=precision,  # type: ignore[arg-type]  # core.trust.lease_precision: a Precision or None
        )
