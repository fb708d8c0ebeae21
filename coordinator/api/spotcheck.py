"""Seeded spot-checks: the coordinator's side of replaying a job and judging the original by it.

After a result is accepted, :func:`after_accept` draws, with the probability the client's trust allows
(:func:`coordinator.core.trust.should_replicate`), whether to check it, and who can judge it *conclusively*:

- **the coordinator itself** (``judge='arbiter'``), when the result's class is the verifier's own (torch on
  the verifier's device): its seeded replay of the job decides alone (:func:`coordinator.core.replicas.
  judge_original`). No replica leaves the coordinator, so no client can recognise, confirm, spoil or sit on it.
- **an independent peer** (``judge='peer'``) of the same class otherwise: the replica is leased, before
  regular work, only to an identity of the same pinned class with verified work behind it, no registration
  address in common with the original's and not registered in the same burst (core.replicas.independent),
  under a fresh id from the job stream (``j<seq>``, like any new job). Agreement validates the original; a
  disagreement without an arbiter of the class settles nothing and the replica goes to another peer.

Either way the original is *held* out of training until the judgement, like BOINC's quorum. ``inconclusive``
never validates: a held original with no conclusive judgement by ``trust.hold_s`` (≥ a replica's lease and
one reissue) is dropped uncredited and its job done again. A result of a class that nobody can judge right
now (no arbiter of the class, no independent peer active) is not held; it rests on the per-result checks —
the logprob recompute and the sampling test — which is the residual risk docs/security.md states.

Only conclusive judgements move trust: agreement raises the original's, a lost check lowers it (and the
replayer who helped decide is credited and trusted for the replay).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from typing import TYPE_CHECKING

from coordinator.api.guard import ReplicaRow
from coordinator.core.leases import deadline_for
from coordinator.core.replicas import Verdict, agreement, judge, judge_original, needs_arbiter
from coordinator.core.trust import backend_class, should_replicate
from coordinator.core.verify import check_logprobs, logprob_stats, verify_submission
from coordinator.limits import result_size_cap
from shared import wire
from shared.errors import ProtocolError, Reason
from shared.messages import LeaseResponse, ResultSubmission, SubmitResponse
from shared.records import sign_job

if TYPE_CHECKING:
    from coordinator.api.service import Coordinator

logger = logging.getLogger(__name__)

_TASKS: set[asyncio.Task[None]] = set()  # arbiter replays under way (strong references until they finish)


def _secret(coord: Coordinator) -> bytes:
    value = coord.store.get_meta("spot_check_secret")
    if value is None:
        value = secrets.token_hex(16)
        coord.store.set_meta("spot_check_secret", value)
    return bytes.fromhex(value)


def arbiter_class(coord: Coordinator) -> str:
    """The one class the coordinator's own replay can judge: torch on the verifier's device."""
    return backend_class("torch", str(coord.verifier.device))


@dataclasses.dataclass(frozen=True)
class Hold:
    """A spot-check decided for a result about to be accepted: its replica, already written and holding the result."""

    replica_id: str
    judge: str  # "arbiter" (the coordinator's own replay) or "peer"


def hold_before_accept(coord: Coordinator, client_id: str, sub: ResultSubmission, bclass: str) -> Hold | None:
    """Decide whether an about-to-be-accepted result is spot-checked and, if so, write its held replica now —
    before the result is committed. Why before: a learner in another process is woken by the result's commit and
    may read the pending results at once; a hold written after that commit could come too late, and a result
    meant to wait for its judgement would be trained on first. Call :func:`after_accept` once the result is
    committed, or :func:`drop_hold` if it was not."""
    if not coord.config.trust.spot_checks:
        return None
    if sub.completions[0].turns is not None:  # episodes: verified by replay (coordinator.tasks.episodes), not by replica
        return None
    state = coord.guard.trust(client_id)
    if not should_replicate(state, coord.guard.policy, sub.job_id, _secret(coord)):
        return None
    now = coord.clock()
    hold_until = now + coord.config.trust.hold_for(coord.config.jobs.lease_timeout_s)
    if bclass == arbiter_class(coord):
        return Hold(coord.guard.add_replica(sub.job_id, sub.version, client_id, bclass, now, hold_until, "arbiter"),
                    "arbiter")
    if coord.guard.peer_available(client_id, bclass, now, coord.config.trust.active_window_s):
        return Hold(coord.guard.add_replica(sub.job_id, sub.version, client_id, bclass, now, hold_until, "peer"),
                    "peer")
    logger.debug("no conclusive spot-check possible for %s (%s): none of its class is independent and active",
                 sub.job_id, bclass)
    return None


def after_accept(coord: Coordinator, hold: Hold | None) -> None:
    """The result is committed: start its judgement."""
    if hold is None:
        return
    if hold.judge == "arbiter":
        _start_arbiter(coord, hold.replica_id)
    else:
        coord.notify_jobs()  # a replica is waiting: a long-polling independent peer may take it now


def drop_hold(coord: Coordinator, hold: Hold | None) -> None:
    """The result was not accepted after all: its replica goes, unjudged."""
    if hold is not None:
        coord.guard.drop_replica(hold.replica_id)


def _start_arbiter(coord: Coordinator, replica_id: str) -> None:
    if replica_id in coord.guard.arbitrating:
        return
    coord.guard.arbitrating.add(replica_id)
    task = asyncio.get_running_loop().create_task(_arbitrate(coord, replica_id))
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _arbitrate(coord: Coordinator, replica_id: str) -> None:
    """The coordinator's own seeded replay judges a held original of its class: agree, or invalid."""
    try:
        rep = coord.guard.get_replica(replica_id)
        row = coord.store.get_job(rep.job_id) if rep is not None else None
        original = coord.store.result_rows([rep.job_id]) if rep is not None and coord.store.accepted_result(
            rep.job_id) else []
        if rep is None or row is None or not original:
            return  # closed meanwhile, or the original is gone: expire_replicas tidies it
        prompts = [coord.prompt_tokens(i) for i in row.prompt_ids]
        try:
            arbiter = await coord.verifier.replay(prompts, group_size=row.group_size, seed=row.seed,
                                                  max_tokens=coord.config.sampling.max_tokens, version=rep.version)
        except (LookupError, FileNotFoundError):  # the version was pruned: expire_replicas drops the original
            logger.info("spot-check of %s: version %d is gone, the held result will be dropped", rep.job_id,
                        rep.version)
            return
        theirs = wire.unpack(original[0].payload, max_bytes=len(original[0].payload))["completions"]
        verdict = judge_original(theirs, arbiter, coord.config.trust.replica_min_agreement)
        detail = (f"token agreement {agreement(theirs, arbiter):.3f} with the coordinator's own replay: "
                  f"{verdict.value}")
        now = coord.clock()
        invalid = verdict is Verdict.ORIGINAL_INVALID
        if not coord.guard.close_arbitrated(rep, invalid, now, detail, in_training=rep.job_id in coord.in_training):
            return
        logger.info("spot-check of %s from %s by the coordinator: %s", rep.job_id, rep.original_client[:8], detail)
        _judged(coord, rep, invalid, now)
    except Exception:  # a background task: log, never kill the loop; the hold then runs out and drops the result
        logger.exception("spot-check replay of %s failed", replica_id)
    finally:
        coord.guard.arbitrating.discard(replica_id)


def _judged(coord: Coordinator, rep: ReplicaRow, original_invalid: bool, now: float) -> None:
    """A conclusive judgement of ``rep``'s original: trust moves, the learner and waiting clients hear of it."""
    coord.bell.ring()  # a held original is released (or gone): the learner may have a batch now
    if original_invalid:
        coord.guard.record_invalid(rep.original_client, now)
        coord.notify_jobs()  # the job reopened
    else:
        coord.guard.record_valid(rep.original_client)


def _sweep(coord: Coordinator, now: float) -> None:
    """On every lease: drop held results that ran out of time, restart replays a restart interrupted."""
    if coord.guard.expire_replicas(_oldest(coord), now, frozenset(coord.guard.arbitrating)):
        coord.bell.ring()
        coord.notify_jobs()  # dropped results reopened their jobs
    for rep in coord.guard.awaiting_arbiter():
        _start_arbiter(coord, rep.replica_id)


def lease_replica(coord: Coordinator, client_id: str) -> LeaseResponse | None:
    """A peer replica for ``client_id`` (only one it may judge: coordinator.api.guard.Guard.may_judge), or None."""
    now = coord.clock()
    _sweep(coord, now)
    if not coord.config.trust.spot_checks:
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
    job = coord.job_message(shadow, rep.version, lease_id, client_id, now, deadline)
    logger.info("spot-check: replica %s of %s (version %d, from %s) leased to %s", rep.replica_id, rep.job_id,
                rep.version, rep.original_client[:8], client_id[:8])
    return LeaseResponse(job=sign_job(coord.key, job), retry_after_s=coord.config.jobs.retry_after_s,
                         current_version=coord.version, finished=False)


def _oldest(coord: Coordinator) -> int:
    return max(0, coord.version - coord.config.snapshots.keep_last + 1)


async def submit_replica(coord: Coordinator, client_id: str, sub: ResultSubmission, size: int, content_sha: str,
                         bclass: str) -> SubmitResponse:
    rep = coord.guard.get_replica(sub.job_id)
    row = coord.store.get_job(rep.job_id) if rep is not None else None
    if rep is None or row is None:
        raise ProtocolError(Reason.UNKNOWN_JOB, f"there is no job {sub.job_id}")
    cap = result_size_cap(len(row.prompt_ids) * row.group_size, coord.config.sampling.max_tokens)
    if size > cap:
        raise ProtocolError(Reason.BODY_TOO_LARGE, f"result is {size} bytes; this job allows at most {cap}")
    terms = dataclasses.replace(coord.terms(row), version=rep.version)
    verify_submission(sub, rep.view, terms, client_id, coord.clock(), _oldest(coord))
    prompts = [coord.prompt_tokens(i) for i in row.prompt_ids]
    expanded = [p for p in prompts for _ in range(row.group_size)]
    mine = [list(c.token_ids) for c in sub.completions]
    recomputed = await coord.recompute_at(expanded, mine, sub.version)
    check_logprobs(logprob_stats([c.logprobs for c in sub.completions], recomputed),
                   *coord.config.verification.tolerances(bclass, coord.config.snapshots.gguf))
    original = coord.store.result_rows([rep.job_id]) if coord.store.accepted_result(rep.job_id) else []
    min_agree = coord.config.trust.replica_min_agreement
    if not original:
        verdict = Verdict.INCONCLUSIVE  # the original was already taken back by another check
        agree = 0.0
    else:
        theirs = wire.unpack(original[0].payload, max_bytes=len(original[0].payload))["completions"]
        agree = agreement(theirs, mine)
        decided = needs_arbiter(theirs, mine, rep.original_class == bclass, min_agree)
        if decided is not None:
            verdict = decided
        elif arbiter_class(coord) != bclass:
            verdict = Verdict.INCONCLUSIVE  # the verifier is no arbiter for another hardware class
        else:
            arbiter = await coord.verifier.replay(prompts, group_size=row.group_size, seed=row.seed,
                                                  max_tokens=coord.config.sampling.max_tokens, version=rep.version)
            verdict = judge(theirs, mine, arbiter, min_agree)
    detail = f"token agreement {agree:.3f} with the original from {rep.original_client[:8]}: {verdict.value}"
    if verdict is Verdict.REPLICA_INVALID:
        raise ProtocolError(Reason.REPLICA_MISMATCH,
                            f"your replay of job {sub.job_id} (same seed and version) disagrees with the "
                            f"coordinator's own replay ({detail}). Is the client unmodified and its hardware healthy?")
    now = coord.clock()
    in_training = rep.job_id in coord.in_training
    if verdict is Verdict.INCONCLUSIVE and original:
        # settles nothing: the original stays held and the replica goes to another independent identity
        if not coord.guard.reopen_replica(rep, sub.lease_id, client_id, content_sha, now, detail):
            raise ProtocolError(Reason.NOT_LEASE_HOLDER, f"the lease on job {sub.job_id} changed while it was "
                                                         f"verified")
        logger.info("spot-check of %s by %s: %s; asking another client", rep.job_id, client_id[:8], detail)
        coord.notify_jobs()
        credit = 0.0
    else:
        credit = float(sum(len(c) for c in mine))
        if not coord.guard.close_replica(rep, sub.lease_id, client_id, verdict.value, content_sha, credit, now,
                                         verdict is Verdict.ORIGINAL_INVALID, detail, in_training=in_training):
            raise ProtocolError(Reason.NOT_LEASE_HOLDER, f"the lease on job {sub.job_id} changed while it was "
                                                         f"verified")
        logger.info("spot-check of %s by %s: %s", rep.job_id, client_id[:8], detail)
        if original:
            _judged(coord, rep, verdict is Verdict.ORIGINAL_INVALID, now)
            coord.guard.record_valid(client_id)  # the replay itself agreed with the judgement
    items = [coord.task.train[i] for i in row.prompt_ids for _ in range(row.group_size)]
    rewards = [coord.task.reward(it, coord.codec.decode(c)) for it, c in zip(items, mine, strict=True)]
    client = coord.store.get_client(client_id)
    return SubmitResponse(accepted=True, job_id=sub.job_id, mean_reward=sum(rewards) / len(rewards), credit=credit,
                          total_credit=float(client["credit"]) if client is not None else credit)
