"""Seeded spot-check replication: the coordinator's side of re-issuing a job and judging the two outcomes.

After a result is accepted, :func:`after_accept` raises the client's trust and, with the probability its
trust allows (:func:`coordinator.core.trust.should_replicate`), queues a replica: the same prompts, seed and
policy version, leased before regular work to a *different* client under the job id ``<job>-r``. Like
BOINC's quorum, the original is *held* out of training until the replay is judged, so a lazy or
cherry-picked result never reaches the learner; to stay live, nothing is held while no other client is
active, and a hold lapses after ``trust.hold_s`` (the result is then trained on unverified, and the replay
still judges it later). The replay is verified like any result (binding, tokens,
logprob plausibility), then compared with the original (:mod:`coordinator.core.replicas`); on a same-class
disagreement the learner replays the job itself and the outlier is invalid:

- the original was the outlier: its result leaves the training buffer if not yet trained on (the job
  reopens and is done again), its credit is revoked, its client's trust resets;
- the replay was the outlier: it is refused with ``replica_mismatch`` and the replica is reissued later.

A replica whose version is pruned before anyone replays it is closed as ``unverified``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import TYPE_CHECKING

from coordinator.core.leases import deadline_for
from coordinator.core.replicas import Verdict, agreement, judge, needs_arbiter
from coordinator.core.trust import backend_class, should_replicate
from coordinator.core.verify import check_logprobs, logprob_stats, verify_submission
from shared import wire
from shared.errors import ProtocolError, Reason
from shared.messages import LeaseResponse, ResultSubmission, SubmitResponse
from shared.records import sign_job

if TYPE_CHECKING:
    from coordinator.service import Coordinator
    from coordinator.store import JobRow

logger = logging.getLogger(__name__)


def _secret(coord: Coordinator) -> bytes:
    value = coord.store.get_meta("spot_check_secret")
    if value is None:
        value = secrets.token_hex(16)
        coord.store.set_meta("spot_check_secret", value)
    return bytes.fromhex(value)


def after_accept(coord: Coordinator, client_id: str, sub: ResultSubmission, bclass: str) -> None:
    """Credit trust for an accepted result and maybe queue its replica."""
    state = coord.guard.record_valid(client_id, bclass)
    if coord.config.trust.spot_checks and should_replicate(state, coord.guard.policy, sub.job_id, _secret(coord)):
        now = coord.clock()
        hold = coord.guard.others_active(client_id, now, coord.config.trust.active_window_s)
        coord.guard.add_replica(sub.job_id, sub.version, client_id, bclass, now, hold)


def lease_replica(coord: Coordinator, client_id: str) -> LeaseResponse | None:
    """A replica job for ``client_id`` (never its own result's), or None."""
    now = coord.clock()
    if coord.guard.expire_replicas(_oldest(coord), now, coord.config.trust.hold_s):
        coord._wake.set()  # held results were released (or closed): the learner may have a batch now
    if not coord.config.trust.spot_checks:
        return None
    # replays go only to clients with valid work behind them: a brand-new identity (a sybil, a lease hoarder)
    # could otherwise take the replay of its own accomplice's result, or sit on it until the hold expires
    if not coord.guard.has_valid_work(client_id):
        return None
    lease_id = secrets.token_hex(8)
    deadline = deadline_for(now, coord.config.jobs.lease_timeout_s)
    rep = coord.guard.lease_replica(client_id, lease_id, deadline, now)
    if rep is None:
        return None
    row = coord.store.get_job(rep.job_id)
    if row is None or coord.store.manifest_sha(rep.version) is None:
        coord.guard.release_replica(rep.replica_id, lease_id, client_id)
        return None
    shadow = dataclasses.replace(row, view=dataclasses.replace(row.view, job_id=rep.replica_id))
    job = coord._job_message(shadow, rep.version, lease_id, client_id, now, deadline)
    logger.info("spot-check: replica of %s (version %d, from %s) leased to %s", rep.job_id, rep.version,
                rep.original_client[:8], client_id[:8])
    return LeaseResponse(job=sign_job(coord.key, job), retry_after_s=coord.config.jobs.retry_after_s,
                         current_version=coord.version, finished=False)


def _oldest(coord: Coordinator) -> int:
    return max(0, coord.version - coord.config.snapshots.keep_last + 1)


def _replay(coord: Coordinator, row: JobRow, prompts: list[list[int]], version: int) -> list[list[int]]:
    """On the learner thread: the learner's own seeded replay of the job at ``version`` (the arbiter)."""
    from shared.policy import generate

    learner = coord.learner
    model = learner._model_at(version, coord.snapshots.folder(version))
    samples = generate(model, prompts, group_size=row.group_size, temperature=coord.config.sampling.temperature,
                       max_tokens=coord.config.sampling.max_tokens, stop_ids=learner.stop_ids, seed=row.seed,
                       pad_id=learner.pad_id)
    return [list(s.token_ids) for s in samples]


async def submit_replica(coord: Coordinator, client_id: str, sub: ResultSubmission, size: int, content_sha: str,
                         bclass: str) -> SubmitResponse:
    from coordinator.service import result_size_cap

    rep = coord.guard.get_replica(sub.job_id)
    row = coord.store.get_job(rep.job_id) if rep is not None else None
    if rep is None or row is None:
        raise ProtocolError(Reason.UNKNOWN_JOB, f"there is no job {sub.job_id}")
    cap = result_size_cap(len(row.prompt_ids) * row.group_size, coord.config.sampling.max_tokens)
    if size > cap:
        raise ProtocolError(Reason.BODY_TOO_LARGE, f"result is {size} bytes; this job allows at most {cap}")
    terms = dataclasses.replace(coord._terms(row), version=rep.version)
    verify_submission(sub, rep.view, terms, client_id, coord.clock(), _oldest(coord))
    prompts = [coord._prompt_tokens(i) for i in row.prompt_ids]
    expanded = [p for p in prompts for _ in range(row.group_size)]
    mine = [list(c.token_ids) for c in sub.completions]
    recomputed: list[list[float]] = await coord._run(coord._recompute_at, expanded, mine, sub.version)
    check_logprobs(logprob_stats([c.logprobs for c in sub.completions], recomputed),
                   *coord.config.verification.tolerances(sub.backend, coord.config.snapshots.gguf))
    original = coord.store.result_rows([rep.job_id]) if coord.store.accepted_result(rep.job_id) else []
    min_agree = coord.config.trust.replica_min_agreement
    if not original:
        verdict = Verdict.INCONCLUSIVE  # the original was already invalidated by another check
        agree = 0.0
    else:
        theirs = wire.unpack(original[0].payload, max_bytes=len(original[0].payload))["completions"]
        agree = agreement(theirs, mine)
        decided = needs_arbiter(theirs, mine, rep.original_class == bclass, min_agree)
        if decided is not None:
            verdict = decided
        elif backend_class("torch", str(coord.learner.device)) != bclass:
            verdict = Verdict.INCONCLUSIVE  # the learner is no arbiter for another hardware class
        else:
            arbiter = await coord._run(_replay, coord, row, prompts, rep.version)
            verdict = judge(theirs, mine, arbiter, min_agree)
    detail = f"token agreement {agree:.3f} with the original from {rep.original_client[:8]}: {verdict.value}"
    if verdict is Verdict.REPLICA_INVALID:
        raise ProtocolError(Reason.REPLICA_MISMATCH,
                            f"your replay of job {rep.job_id} (same seed and version) disagrees with the "
                            f"coordinator's own replay ({detail}). Is the client unmodified and its hardware healthy?")
    n_tokens = float(sum(len(c) for c in mine))
    now = coord.clock()
    if not coord.guard.close_replica(rep, sub.lease_id, client_id, verdict.value, content_sha, n_tokens, now,
                                     verdict is Verdict.ORIGINAL_INVALID, detail,
                                     in_training=rep.job_id in coord.in_training):
        raise ProtocolError(Reason.NOT_LEASE_HOLDER, f"the lease on job {sub.job_id} changed while it was verified")
    logger.info("spot-check of %s by %s: %s", rep.job_id, client_id[:8], detail)
    coord._wake.set()  # a held original is released (or gone): the learner may have a batch now
    if verdict is Verdict.ORIGINAL_INVALID:
        coord.guard.record_invalid(rep.original_client, rep.original_class, now)
        coord._notify_jobs()  # the job reopened
    if verdict in (Verdict.AGREE, Verdict.ORIGINAL_INVALID):
        coord.guard.record_valid(client_id, bclass)
    items = [coord.task.train[i] for i in row.prompt_ids for _ in range(row.group_size)]
    rewards = [coord.task.reward(it, coord.learner.decode(c)) for it, c in zip(items, mine, strict=True)]
    client = coord.store.get_client(client_id)
    return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=sum(rewards) / len(rewards), credit=n_tokens,
                          total_credit=float(client["credit"]) if client is not None else n_tokens)
