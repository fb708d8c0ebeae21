"""Verification rules for a returned result, in a fixed order; each failure names its reason code.

Order: lease ownership and deadline → job binding (version, prompt hash, seed, group size) → shapes →
token validity → finish-reason consistency. The behaviour-logprob plausibility check runs after the
learner has recomputed the logprobs (:func:`check_logprobs`). Rewards are never read from a client.
Authentication (signature, nonce, timestamp) happens before any of this, in :mod:`coordinator.core.auth`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.core.leases import LeaseCheck, LeaseView, check_lease
from shared.errors import ProtocolError, Reason
from shared.messages import ResultSubmission


@dataclass(frozen=True)
class JobTerms:
    """The signed terms a result must match."""

    version: int
    prompt_hash: str
    seed: int
    group_size: int
    n_prompts: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    vocab_size: int


def verify_submission(
    sub: ResultSubmission, lease: LeaseView, terms: JobTerms, client_id: str, now: float, oldest_version: int
) -> None:
    """Raise ProtocolError with the first failing rule's reason; return None if all structural rules pass."""
    verdict = check_lease(lease, client_id, sub.lease_id, now)
    if verdict is LeaseCheck.DONE:
        raise ProtocolError(Reason.JOB_COMPLETED, f"job {sub.job_id} already has an accepted result")
    if verdict is LeaseCheck.NOT_HOLDER:
        raise ProtocolError(Reason.NOT_LEASE_HOLDER,
                            f"you do not hold the current lease on job {sub.job_id} (it may have been reissued)")
    if verdict is LeaseCheck.EXPIRED:
        raise ProtocolError(Reason.LEASE_EXPIRED,
                            f"the lease on job {sub.job_id} expired before the result arrived; the job was reissued")

    if sub.version != terms.version:
        raise ProtocolError(Reason.WRONG_VERSION,
                            f"job {sub.job_id} is for policy version {terms.version}, result claims {sub.version}")
    if sub.version < oldest_version:
        raise ProtocolError(Reason.WRONG_VERSION,
                            f"policy version {sub.version} is too old to be verified (oldest kept: {oldest_version})")
    if sub.prompt_hash != terms.prompt_hash:
        raise ProtocolError(Reason.BINDING_MISMATCH, "prompt_hash does not match the signed job's prompts")
    if sub.seed != terms.seed:
        raise ProtocolError(Reason.BINDING_MISMATCH, "seed does not match the signed job's seed")
    if sub.group_size != terms.group_size:
        raise ProtocolError(Reason.BINDING_MISMATCH, "group_size does not match the signed job's group size")

    expected = terms.n_prompts * terms.group_size
    if len(sub.completions) != expected:
        raise ProtocolError(Reason.SHAPE_MISMATCH,
                            f"expected {expected} completions ({terms.n_prompts} prompts × {terms.group_size}), "
                            f"got {len(sub.completions)}")
    for i, comp in enumerate(sub.completions):
        n = len(comp.token_ids)
        if n != len(comp.logprobs):
            raise ProtocolError(Reason.SHAPE_MISMATCH,
                                f"completion {i}: {n} tokens but {len(comp.logprobs)} logprobs")
        if n == 0 or n > terms.max_tokens:
            raise ProtocolError(Reason.TOKEN_OUT_OF_RANGE,
                                f"completion {i}: {n} tokens; must be between 1 and max_tokens={terms.max_tokens}")
        bad = next((t for t in comp.token_ids if t >= terms.vocab_size), None)
        if bad is not None:
            raise ProtocolError(Reason.TOKEN_OUT_OF_RANGE,
                                f"completion {i}: token id {bad} is outside the vocabulary (size {terms.vocab_size})")
        stops = [k for k, t in enumerate(comp.token_ids) if t in terms.stop_token_ids]
        if comp.finish_reason == "stop":
            if stops != [n - 1]:
                raise ProtocolError(Reason.FINISH_REASON,
                                    f"completion {i}: finish_reason 'stop' requires exactly one stop token, at the end")
        elif stops or n != terms.max_tokens:
            raise ProtocolError(Reason.FINISH_REASON,
                                f"completion {i}: finish_reason 'length' requires max_tokens tokens and no stop token")


@dataclass(frozen=True)
class LogprobStats:
    mean_abs: float
    max_abs: float
    n_tokens: int


def logprob_stats(reported: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]]) -> LogprobStats:
    total, worst, count = 0.0, 0.0, 0
    for rep, rec in zip(reported, recomputed, strict=True):
        for a, b in zip(rep, rec, strict=True):
            d = abs(a - b)
            total += d
            worst = max(worst, d)
            count += 1
    return LogprobStats(total / max(1, count), worst, count)


def check_logprobs(stats: LogprobStats, mean_tol: float, max_tol: float) -> None:
    """Refuse behaviour logprobs that an honest sampler of this version could not have produced."""
    if stats.mean_abs > mean_tol or stats.max_abs > max_tol:
        raise ProtocolError(
            Reason.LOGPROB_MISMATCH,
            f"reported logprobs differ from the policy's by {stats.mean_abs:.4f} nats/token on average "
            f"(max {stats.max_abs:.4f}); tolerances are {mean_tol} and {max_tol}. Is the client running the "
            f"job's snapshot version unmodified?",
        )
