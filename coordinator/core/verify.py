"""Verification rules for a returned result, in a fixed order; each failure names its reason code.

Order: lease ownership and deadline → job binding (version, prompt hash, seed, group size) → shapes →
token validity → finish-reason consistency. The behaviour-logprob plausibility check runs after the
learner has recomputed the logprobs (:func:`check_logprobs`), then the sampling test on the same recompute
(:func:`check_sampling`: are the tokens as surprising as sampling would make them?). Rewards are never read from
a client.
Authentication (signature, nonce, timestamp) happens before any of this, in :mod:`coordinator.core.auth`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
    episodes: bool = False  # a multi-turn job: completions are episodes, checked turn by turn by replay


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
    if sub.version < oldest_version:  # not the client's fault: its version was retired while it held the lease
        raise ProtocolError(Reason.VERSION_RETIRED,
                            f"policy version {sub.version} is too old to be verified (oldest kept: {oldest_version}); "
                            f"the job will be issued again at a current version")
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
        if (comp.turns is not None) != terms.episodes:
            raise ProtocolError(Reason.SHAPE_MISMATCH,
                                f"completion {i}: " + ("this multi-turn job's completions are episodes: send their "
                                                       "turns" if terms.episodes else "this job is not multi-turn: "
                                                       "send no turns"))
        if terms.episodes:
            continue  # each turn is checked as a completion is, while it is replayed (coordinator.tasks.episodes)
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


@dataclass(frozen=True)
class TokenStats:
    """The coordinator's recompute of a result, per completion and token: the logprob of the token that was
    sent, and the entropy, surprisal variance and largest logprob of the policy's tempered distribution at that
    position (shared.policy.completion_stats)."""

    logprobs: list[list[float]]
    entropy: list[list[float]]
    variance: list[list[float]]
    top: list[list[float]]
    margins: list[list[float]] | None = None  # keyed-sampler margin of each token (None: not computed)


@dataclass(frozen=True)
class SamplingStats:
    """How a result's tokens compare with what honest sampling of the policy would give, as two z-scores.

    ``z`` = Σ(s − H) / √(Σ V + n · var_floor) over all n completion tokens, with s = −log π(token) from the
    coordinator's recompute (never the client's report), H the entropy and V the surprisal variance at that
    position. ``z_top`` = Σ(1[token is the likeliest] − p_top) / √(Σ p_top(1 − p_top) + n · var_floor), p_top the
    probability of the likeliest token. Under honest sampling at the job's temperature both sums are martingales
    with those conditional variances, so both scores are close to a standard normal. Greedy decoding and keeping
    the likeliest of several samples push z far below 0 and z_top far above; tokens the policy would rarely have
    produced push z far above 0. z_top's increments are bounded, so it stays near-normal where surprisal's long
    upper tail makes z a weak detector of greedy decoding.
    """

    z: float
    z_top: float
    n_tokens: int
    mean_surprisal: float
    mean_entropy: float
    top_rate: float  # fraction of tokens that are the likeliest at their position
    expected_top_rate: float  # what honest sampling gives on average: mean p_top


def sampling_stats(stats: TokenStats, var_floor: float) -> SamplingStats:
    """Aggregate the per-token recompute into the two z-scores. ``var_floor`` (per token) keeps them finite and
    float rounding harmless where the policy is nearly deterministic (the variances → 0)."""
    surprisal = entropy = var = hits = p_top = var_top = 0.0
    n = 0
    for lps, hs, vs, tops in zip(stats.logprobs, stats.entropy, stats.variance, stats.top, strict=True):
        for lp, h, v, top in zip(lps, hs, vs, tops, strict=True):
            surprisal -= lp
            entropy += h
            var += max(0.0, v)
            q = min(1.0, math.exp(top))
            hits += 1.0 if lp >= top else 0.0
            p_top += q
            var_top += q * (1.0 - q)
            n += 1
    floor = n * var_floor
    z = (surprisal - entropy) / math.sqrt(var + floor) if var + floor > 0 else 0.0
    z_top = (hits - p_top) / math.sqrt(var_top + floor) if var_top + floor > 0 else 0.0
    m = max(1, n)
    return SamplingStats(z=z, z_top=z_top, n_tokens=n, mean_surprisal=surprisal / m, mean_entropy=entropy / m,
                         top_rate=hits / m, expected_top_rate=p_top / m)


def check_sampling(stats: SamplingStats, *, z_low: float, z_high: float, top_z: float, min_tokens: int,
                   temperature: float) -> None:
    """Refuse a result whose tokens could not plausibly have been sampled from the policy at ``temperature``.

    Accepted: ``z_low`` ≤ z ≤ ``z_high`` and |z_top| ≤ ``top_z`` (coordinator.config.VerificationConfig,
    calibrated by bench/sampling_calibration.py). Results with fewer than ``min_tokens`` tokens are not judged:
    the scores are only near-normal over many tokens. The check needs no claim from the client,
    so it holds across backends and quantisation: an honest llama.cpp q8_0 client samples from nearly the same
    distribution.
    """
    if stats.n_tokens < min_tokens:
        return
    if stats.z < z_low or stats.z_top > top_z:
        what = ("more predictable than sampling would make them: greedy decoding, top-k/top-p or min-p "
                "truncation, a temperature below the job's, or keeping the likeliest of several samples")
    elif stats.z > z_high or stats.z_top < -top_z:
        what = ("less likely than sampling would make them: tokens chosen by other means than sampling this "
                "policy, a temperature above the job's, or a repetition penalty")
    else:
        return
    raise ProtocolError(
        Reason.SAMPLING_MISMATCH,
        f"the completions' tokens are {what} (over {stats.n_tokens} tokens: surprisal {stats.mean_surprisal:.3f} "
        f"vs policy entropy {stats.mean_entropy:.3f} nats/token, z = {stats.z:.1f}, accepted {z_low} to {z_high}; "
        f"likeliest token {stats.top_rate:.1%} of the time vs {stats.expected_top_rate:.1%} expected, z = "
        f"{stats.z_top:.1f}, accepted ±{top_z}). Sample every completion from the full softmax at the job's "
        f"temperature ({temperature}) with the job's seed, and return each one you sampled.",
    )


@dataclass(frozen=True)
class ChoiceStats:
    """How a result's tokens compare with the keyed sampler's choices (shared.sampler) under the verifier's logits:
    ``tokens`` checked, ``off_argmax`` of them not the exact argmax (margin > 0), the ``worst`` margin and where
    (completion, position)."""

    tokens: int
    off_argmax: int
    worst: float
    worst_at: tuple[int, int] | None


def choice_stats(margins: list[list[float]]) -> ChoiceStats:
    tokens = off = 0
    worst, at = 0.0, None
    for c, row in enumerate(margins):
        tokens += len(row)
        for t, m in enumerate(row):
            if m > 0.0:
                off += 1
                if m > worst:
                    worst, at = m, (c, t)
    return ChoiceStats(tokens, off, worst, at)


#: Edges of the margin-to-tolerance histogram (:class:`MarginTally`): where a class's honest results sit below it.
MARGIN_RATIO_EDGES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


@dataclass
class MarginTally:
    """The worst keyed-sampler margin of every result that passed the choice check, as a share of its class's
    tolerance, per backend class: a histogram over :data:`MARGIN_RATIO_EDGES` (``/metrics``).

    Why: the tolerances were calibrated on particular models and machines (docs/benchmarks.md); honest margins grow
    as training sharpens the policy and differ on other hardware. A class whose passing results drift towards 1 is
    about to refuse honest work: the operator raises its ``choice_tol`` before that happens."""

    buckets: dict[str, list[int]] = field(default_factory=dict)  # class → count per edge (not cumulative)
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, backend_class: str, worst: float, tolerance: float) -> None:
        ratio = worst / tolerance if tolerance > 0 else 0.0
        counts = self.buckets.setdefault(backend_class, [0] * (len(MARGIN_RATIO_EDGES) + 1))
        k = next((i for i, edge in enumerate(MARGIN_RATIO_EDGES) if ratio <= edge), len(MARGIN_RATIO_EDGES))
        counts[k] += 1
        self.sums[backend_class] = self.sums.get(backend_class, 0.0) + ratio

    def cumulative(self, backend_class: str) -> list[tuple[str, float]]:
        """Prometheus' cumulative buckets of one class, ``+Inf`` last."""
        total, out = 0, []
        counts = self.buckets[backend_class]
        for edge, n in zip((*MARGIN_RATIO_EDGES, math.inf), counts, strict=True):
            total += n
            out.append(("+Inf" if edge == math.inf else str(edge), float(total)))
        return out


def check_choices(stats: ChoiceStats, tolerance: float) -> None:
    """Refuse a result one of whose tokens is not the keyed sampler's choice beyond ``tolerance``.

    An honest token is the argmax of the verifier's noised scores too, except where the two best scores lie
    closer than the two implementations' logit difference; there its margin is that small difference. A token
    chosen any other way (forced, picked among samples, greedy, steered) lies below the best by the gap between
    two Gumbel-noised scores — typically of order 1, and ≈ log V for a forced token over a large vocabulary."""
    if stats.worst > tolerance and stats.worst_at is not None:
        c, t = stats.worst_at
        raise ProtocolError(Reason.CHOICE_MISMATCH,
                            f"completion {c}, token {t} is not the job's keyed sampler's choice: its score is "
                            f"{stats.worst:.3g} below the best at that position (tolerance {tolerance:g}; "
                            f"{stats.off_argmax} of {stats.tokens} tokens off the argmax). Sample every token with "
                            f"the keyed Gumbel-max sampler (docs/protocol.md §5b) from the job's exact snapshot")
