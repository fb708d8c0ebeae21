"""Comparing two replays of one seeded job (spot-check replication), backend-aware.

Two honest clients of the same backend class (same sampler, same arithmetic) that replay a job with the
same seed and weights produce (almost) the same tokens: Token-DiFR measured > 98 % agreement, and the torch
backend on one hardware class is deterministic. Across classes (llama.cpp vs torch, GPU vs CPU) the samples
legitimately diverge, so a cross-class disagreement proves nothing and is reported as inconclusive.

When two same-class replays disagree, the coordinator's learner replays the job itself (the arbiter) and
whichever result does not agree with it is the outlier; if the arbiter is not of their class, or agrees with
neither, nobody is blamed.

Who may judge whom (so an attacker cannot steer a replica to an accomplice): a result of the arbiter's own
class is judged by the arbiter alone (:func:`judge_original`; no replica leaves the coordinator). Any other
class is replayed only by an identity of the same class that is :func:`independent` of the original's by
what the coordinator observes. An ``inconclusive`` judgement never validates anything: the original stays
held (coordinator.api.spotcheck).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    AGREE = "agree"
    ORIGINAL_INVALID = "original_invalid"
    REPLICA_INVALID = "replica_invalid"
    INCONCLUSIVE = "inconclusive"


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of token positions (over the longer of each pair) at which two sets of completions agree."""
    if len(a) != len(b):
        return 0.0
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        same += sum(1 for p, q in zip(x, y, strict=False) if p == q)
    return same / total if total else 1.0


def needs_arbiter(original: Sequence[Sequence[int]], replica: Sequence[Sequence[int]], same_class: bool,
                  min_agreement: float) -> Verdict | None:
    """AGREE or INCONCLUSIVE when that is already decided; None when the arbiter must replay the job."""
    if agreement(original, replica) >= min_agreement:
        return Verdict.AGREE
    if not same_class:
        return Verdict.INCONCLUSIVE
    return None


def judge(original: Sequence[Sequence[int]], replica: Sequence[Sequence[int]], arbiter: Sequence[Sequence[int]],
          min_agreement: float) -> Verdict:
    """Blame whichever disagrees with the arbiter's own replay; nobody if the arbiter agrees with neither."""
    orig_ok = agreement(original, arbiter) >= min_agreement
    rep_ok = agreement(replica, arbiter) >= min_agreement
    if orig_ok and rep_ok:
        return Verdict.AGREE
    if orig_ok:
        return Verdict.REPLICA_INVALID
    if rep_ok:
        return Verdict.ORIGINAL_INVALID
    return Verdict.INCONCLUSIVE


def judge_original(original: Sequence[Sequence[int]], arbiter: Sequence[Sequence[int]], min_agreement: float
                   ) -> Verdict:
    """The arbiter's own seeded replay of a job of its class decides alone: agree, or the original is invalid."""
    return Verdict.AGREE if agreement(original, arbiter) >= min_agreement else Verdict.ORIGINAL_INVALID


@dataclass(frozen=True)
class Party:
    """What the coordinator itself observed of an identity: the addresses it registered from (the first and
    the latest) and when it first registered. Nothing here is the client's own claim."""

    client_id: str
    addresses: frozenset[str]
    registered_at: float


def independent(a: Party, b: Party, burst_s: float) -> bool:
    """May ``b`` judge ``a``'s work (or the reverse)? Not the same identity, no address in common, and not
    registered within ``burst_s`` of each other (a sybil farm registers its identities together).
    An unknown (empty) address counts as shared: it proves nothing."""
    if a.client_id == b.client_id or not a.addresses or not b.addresses or "" in a.addresses | b.addresses:
        return False
    return not (a.addresses & b.addresses) and abs(a.registered_at - b.registered_at) >= burst_s
