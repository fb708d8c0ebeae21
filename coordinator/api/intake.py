"""Handling results: ``POST /v1/results`` and the co-located loop's own rollouts, through one sequence of checks.

A result, in order (:meth:`Intake._verify`): the sender signed in (coordinator.api.signin), not quarantined, sending
as its pinned class; a known job, within the job's size cap and terms (core.verify.verify_submission: the lease, the
version, the prompts); not a copy of another job's accepted result (core.duplicates); recomputed by the verifiers
(coordinator.run.workqueue.RemoteVerifier) in the class and precision its lease named; its logprobs, choices and
sampling statistics within the class's tolerances (core.verify); its lease still its own; then scored and accepted.
The plain and the multi-turn episode results differ only in what their rollouts answer to those checks
(:mod:`coordinator.api.rollouts`). Every refusal is recorded in the audit log, and counted against the sender where
it is evidence (core.trust.is_invalidating).

A job with a replica (coordinator.core.leases.Replica: issue 37) has two holders. The first result accepted is
trained; the other holder's, within its lease, is never refused for coming second: it goes through every check above
(the same tokens or not: its logprobs are its own) and is credited if it passes — never trained
(:meth:`Intake._credit_replica`; docs/protocol.md §5).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace

from coordinator.api.phase import Phase
from coordinator.api.rollouts import Outcome, rollout_of
from coordinator.api.verdicts import Verdicts
from coordinator.core.duplicates import check_copy, surprisal
from coordinator.core.leases import JobState, LeaseCheck, LeaseView, check_lease, holds_lease, kept_versions
from coordinator.core.trust import class_backend, is_invalidating, recompute_class
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
from coordinator.run.records import AcceptedResult
from coordinator.run.workqueue import (
    Bell,
    Engine,
    RemoteVerifier,
    VerificationError,
    VerifierUnavailable,
    engine_of,
)
from coordinator.store.db import Row
from coordinator.store.job_rows import JobRow
from coordinator.tasks.episodes import EnvTask
from coordinator.tasks.rewards import RewardFailed
from shared import wire
from shared.endpoints import RESULTS
from shared.errors import ProtocolError, Reason
from shared.hashing import prompt_hash, sha256_bytes, tokens_sha256
from shared.messages import ResultSubmission, SubmitResponse
from shared.sampler import Segment

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Intake(Phase):
    """The result intake of one API process, over the phases' collaborators (coordinator.api.phase) and the
    verifiers' queue; ``recomputes`` and ``margins`` are its figures for /metrics."""

    bell: Bell
    verifier: RemoteVerifier
    verdicts: Verdicts  # results in verification, by sender, job and body hash: a resend joins one
    recomputes: int = field(default=0, init=False)  # recomputes asked of the verifiers for results
    # passing results' worst keyed margin ÷ tolerance, per class
    margins: MarginTally = field(default_factory=MarginTally, init=False)

    async def submit(self, raw: bytes) -> SubmitResponse:
        req = self.signin.authenticate(raw, RESULTS.path)
        content_sha = sha256_bytes(req.body)
        job_id: str | None = None
        version: int | None = None
        bclass = self.guard.pinned_class(req.client_id)
        try:
            sub = wire.decode(req.body, ResultSubmission)
            job_id, version = sub.job_id, sub.version
            self.guard.check_quarantine(req.client_id, self.clock())
            if sub.backend != class_backend(bclass):
                raise ProtocolError(Reason.BINDING_MISMATCH,
                                    f"this result says backend {sub.backend!r}, but this identity registered as "
                                    f"{bclass}; results are verified as the registered class. Send results from "
                                    f"the backend it registered with (or use a new identity for another backend)")
            earlier = self._earlier(req.client_id, sub.job_id)
        except ProtocolError as exc:
            self._refused(req.client_id, job_id, version, content_sha, exc)
            raise
        if earlier is not None and earlier["content_sha256"] == content_sha:
            # the same client resending the same result (its first reply was lost): answer as before
            return self._credited(req.client_id, sub.job_id, float(earlier["mean_reward"]), float(earlier["n_tokens"]))
        # a resend while the first copy is still being verified joins that verification (coordinator.api.verdicts)
        return await self.verdicts.once((req.client_id, sub.job_id, content_sha), functools.partial(
            self._verdict, req.client_id, sub, len(req.body), content_sha))

    def _earlier(self, client_id: str, job_id: str) -> Row | None:
        """This client's result of the job that was accepted, or credited as its other holder's (its content hash,
        mean reward and tokens); None if neither."""
        first = self.files.store.results.get(job_id)
        if first is not None and first["client_id"] == client_id:
            return first
        return self.files.store.results.credited_replica(job_id, client_id)

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
            return await self._verify(client_id, sub, size, content_sha, own=True)
        except RewardFailed as exc:
            self.files.store.results.record_rejection(client_id, sub.job_id, exc.reason.value, exc.message, content_sha,
                                                self.clock(), sub.version)
            self.files.store.jobs.release(sub.job_id, sub.lease_id, client_id)
            logger.warning("co-located result for %s refused: %s", sub.job_id, exc.message)
            return SubmitResponse(accepted=False, job_id=sub.job_id, mean_reward=0.0, credit=0.0, total_credit=0.0)

    async def recompute_stats(self, prompts: list[list[int]], completions: list[list[int]], version: int,
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

    async def _verdict(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str) -> SubmitResponse:
        """Verify a client's result and record the outcome, once for every copy of it that joins."""
        try:
            return await self._verify(client_id, sub, size, content_sha)
        except ProtocolError as exc:
            self._refused(client_id, sub.job_id, sub.version, content_sha, exc)
            raise

    def _refused(self, client_id: str, job_id: str | None, version: int | None, content_sha: str,
                 exc: ProtocolError) -> None:
        if exc.reason is Reason.UNAVAILABLE:
            return  # the coordinator's own shortfall: nothing is recorded against the client
        self.files.store.results.record_rejection(client_id, job_id, exc.reason.value, exc.message, content_sha,
                                            self.clock(), version)
        if is_invalidating(exc.reason):
            self.guard.record_invalid(client_id, self.clock())
        logger.info("rejected result from %s for %s: %s", client_id[:8], job_id, exc)

    async def _verify(self, client_id: str, sub: ResultSubmission, size: int, content_sha: str, *,
                      own: bool = False) -> SubmitResponse:
        """The sequence of checks (the module's docstring); ``own``: the co-located loop's rollouts, recomputed
        by torch and neither credited nor counted as evidence."""
        with self.verifying.held(sub.job_id):  # never reissued meanwhile (coordinator.api.leasing)
            row, first = self._job_within_terms(client_id, sub, size)
            # a job's other holder is checked in full too, even with the trained result's very tokens: its reported
            # logprobs are its own (a made-up set beside honest tokens was credited unchecked)
            tokens_sha = self._refuse_copy(sub)  # before any forward pass is spent on a copy (core.duplicates)
            rollout = rollout_of(sub, row, self.files.task, self.prompt_tokens, self.config.sampling.max_tokens)
            # recomputed as the lease said (core.trust.recompute_class): a llama.cpp client's result by llama.cpp on
            # the very GGUF file its lease named; the co-located loop's own (torch) rollouts and torch clients' from
            # the safetensors. The lease is this client's (verify_submission), so its precision is the one granted
            pinned = self.guard.pinned_class(client_id)  # a store read: once per result
            rclass = "torch" if own else recompute_class(pinned, row.precision)
            stats = await self.recompute_stats(rollout.prompts, rollout.completions, sub.version, rollout.segments,
                                               engine_of(rclass), rollout.group, row.precision)
            mean_abs = self._check_tokens(rollout.reported, rollout.checked(stats), rclass, pinned)
            outcome = rollout.outcome(stats)
            # the job's other holder may have been accepted while this one was verified
            first = first or self._trained_first_now(client_id, sub)
            if first is None:
                lease = self._lease_kept(client_id, sub)
                accepted = self._accept(client_id, sub, content_sha, tokens_sha, outcome, mean_abs, rclass, lease,
                                        own)
                if accepted is not None:
                    return accepted
                first = self._trained_first_now(client_id, sub)
                if first is None:
                    raise ProtocolError(Reason.NOT_LEASE_HOLDER,
                                        f"the lease on job {sub.job_id} changed while it was verified")
            if not own:  # every token was checked against the keyed sampler: conclusive evidence
                self.guard.record_valid(client_id)
            return self._credit_replica(client_id, sub, row.view, content_sha, tokens_sha,
                                        sum(outcome.rewards) / len(outcome.rewards), outcome.n_tokens)

    def _job_within_terms(self, client_id: str, sub: ResultSubmission, size: int) -> tuple[JobRow, Row | None]:
        """The job as the sender's lease sees it (its replica's, if it holds that), and the job's accepted result
        when that came from its other holder (None: the sender's result may close the job)."""
        found = self.files.store.jobs.get(sub.job_id)
        if found is None:
            raise ProtocolError(Reason.UNKNOWN_JOB, f"there is no job {sub.job_id}")
        row = found.held_by(client_id, sub.lease_id)
        cap = self.config.result_cap(len(row.prompt_ids) * row.group_size)
        if size > cap:
            raise ProtocolError(Reason.BODY_TOO_LARGE, f"result is {size} bytes; this job allows at most {cap}")
        first = self._trained_first(row, client_id, sub.lease_id)
        # the other holder's result closed the job: this lease is judged as it stands (live, its own version)
        view = row.view if first is None else replace(row.view, state=JobState.LEASED)
        # the learner keeps the version of every live lease (core.leases.kept_versions), so a lease holder's result
        # is verifiable however far the policy moved; verify_submission checks the lease before the version
        oldest = min(kept_versions(self.state.version, self.config.snapshots.keep_last, [view], self.clock()))
        verify_submission(sub, view, self._terms(row), client_id, self.clock(), oldest)
        return row, first

    def _trained_first(self, row: JobRow, client_id: str, lease_id: str) -> Row | None:
        """The accepted result of a done job that the sender also held a lease on (its first lease or its replica),
        when that result came from the job's other lease; None otherwise."""
        if row.view.state is not JobState.DONE or not holds_lease(row.view, client_id, lease_id):
            return None
        first = self.files.store.results.get(row.view.job_id)
        return first if first is not None and first["lease_id"] != lease_id else None

    def _trained_first_now(self, client_id: str, sub: ResultSubmission) -> Row | None:
        """:meth:`_trained_first` as the store says now."""
        fresh = self.files.store.jobs.get(sub.job_id)
        return None if fresh is None else self._trained_first(fresh.held_by(client_id, sub.lease_id), client_id,
                                                              sub.lease_id)

    def _credit_replica(self, client_id: str, sub: ResultSubmission, lease: LeaseView, content_sha: str,
                        tokens_sha: str, mean_reward: float, n_tokens: int) -> SubmitResponse:
        """Credit the result of a job's other holder (Results.credit_replica): accepted and credited, never trained.
        Its lease-to-result time measures its pace as an accepted result's does. A second, different result of the
        same holder is refused ``job_completed``, as any other result of a done job."""
        now = self.clock()
        if not self.files.store.results.credit_replica(
                job_id=sub.job_id, lease_id=sub.lease_id, client_id=client_id, version=sub.version,
                content_sha256=content_sha, completions_sha256=tokens_sha, mean_reward=mean_reward,
                n_tokens=n_tokens, credit=float(n_tokens), now=now):
            raise ProtocolError(Reason.JOB_COMPLETED, f"job {sub.job_id} already has an accepted result")
        self.issuer.observe(client_id, lease, now)
        logger.info("credited %s's result for %s: its other holder's was trained", client_id[:8], sub.job_id)
        return self._credited(client_id, sub.job_id, mean_reward, float(n_tokens))

    def _credited(self, client_id: str, job_id: str, mean_reward: float, credit: float) -> SubmitResponse:
        client = self.files.store.clients.get(client_id)
        return SubmitResponse(accepted=True, job_id=job_id, mean_reward=mean_reward, credit=credit,
                              total_credit=float(client["credit"]) if client is not None else 0.0)

    def _terms(self, row: JobRow) -> JobTerms:
        codec = self.prompt_tokens.codec
        return JobTerms(version=-1 if row.view.version is None else row.view.version,
                        prompt_hash=prompt_hash([self.prompt_tokens(i) for i in row.prompt_ids]), seed=row.seed,
                        group_size=row.group_size, n_prompts=len(row.prompt_ids),
                        max_tokens=self.config.sampling.max_tokens, stop_token_ids=frozenset(codec.stop_ids),
                        vocab_size=codec.vocab_size, episodes=isinstance(self.files.task, EnvTask))

    def _refuse_copy(self, sub: ResultSubmission) -> str:
        """The content hash of the result's tokens (an episode's: its actions and observations, turn by turn);
        refused with duplicate_result if another job's accepted result has the same tokens and the result holds
        enough choice for that to be no coincidence (coordinator.core.duplicates)."""
        tokens = [list(c.token_ids) if c.turns is None else
                  [t for turn in c.turns for t in (*turn.token_ids, *turn.observation_ids)] for c in sub.completions]
        logprobs = [list(c.logprobs) if c.turns is None else [x for turn in c.turns for x in turn.logprobs]
                    for c in sub.completions]
        sha = tokens_sha256(tokens)
        check_copy(self.files.store.results.with_tokens(sha, sub.job_id), sub.job_id, surprisal(logprobs))
        return sha

    def _check_tokens(self, reported: list[list[float]], checked: TokenStats, rclass: str, pinned: str) -> float:
        """The model's tokens against the recompute (core.verify): logprobs, then every token's choice, then how
        surprising the tokens are. Returns the logprobs' mean absolute difference."""
        vcfg = self.config.verification
        stats = logprob_stats(reported, checked.logprobs)
        check_logprobs(stats, *vcfg.tolerances(rclass))
        if vcfg.choice_check and checked.margins is not None:  # every token's choice
            choices = choice_stats(checked.margins)
            # margins are in tempered units: the tolerance too
            choice_tol = vcfg.choice_tolerance(rclass) / self.config.sampling.temperature
            check_choices(choices, choice_tol)
            self.margins.add(pinned, choices.worst, choice_tol)  # by hardware: a GPU client's margins apart
        if vcfg.sampling_check:  # are the tokens as surprising as sampling makes them?
            check_sampling(sampling_stats(checked, vcfg.sampling_var_floor), z_low=vcfg.sampling_z_low,
                           z_high=vcfg.sampling_z_high, top_z=vcfg.sampling_top_z, min_tokens=vcfg.sampling_min_tokens,
                           temperature=self.config.sampling.temperature)
        return stats.mean_abs

    def _lease_kept(self, client_id: str, sub: ResultSubmission) -> LeaseView:
        """The result arrived within its lease (verify_submission); if the lease ran out while the learner kept the
        verification waiting, that delay was the coordinator's, and the job was not reissued meanwhile."""
        fresh = self.files.store.jobs.get(sub.job_id)
        view = None if fresh is None else fresh.held_by(client_id, sub.lease_id).view
        if view is None or check_lease(view, client_id, sub.lease_id, self.clock()) not in (
                LeaseCheck.OK, LeaseCheck.EXPIRED):
            raise ProtocolError(Reason.LEASE_EXPIRED, f"the lease on job {sub.job_id} changed while it was verified")
        return view

    def _accept(self, client_id: str, sub: ResultSubmission, content_sha: str, tokens_sha: str, outcome: Outcome,
                mean_abs: float, rclass: str, lease: LeaseView, own: bool) -> SubmitResponse | None:
        """Accept and credit the result, closing the job; None if its lease changed meanwhile."""
        payload = AcceptedResult(
            completions=outcome.completions, behaviour_logprobs=outcome.behaviour,
            recomputed_logprobs=outcome.recomputed, finish_reasons=[c.finish_reason for c in sub.completions],
            logprob_mean_abs_diff=mean_abs, reward_means=outcome.reward_means, loss_mask=outcome.loss_mask,
            source=rclass).encode()
        credit = float(outcome.n_tokens)
        if not self.files.store.results.accept(job_id=sub.job_id, lease_id=sub.lease_id, client_id=client_id,
                                         version=sub.version, content_sha256=content_sha, payload=payload,
                                         rewards=outcome.rewards, n_tokens=outcome.n_tokens, credit=credit,
                                         now=self.clock(), completions_sha256=tokens_sha):
            return None
        if not own:  # every token was checked against the keyed sampler: the result is conclusive evidence
            self.guard.record_valid(client_id)
            self.guard.check_reporting(client_id, self.clock())  # …of its tokens, not of which results it returns
        self.issuer.observe(client_id, lease, self.clock())
        self.bell.ring()  # the learner may have a batch now
        client = self.files.store.clients.get(client_id)
        rewards = outcome.rewards
        return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=sum(rewards) / len(rewards),
                              credit=credit, total_credit=float(client["credit"]) if client else credit)
