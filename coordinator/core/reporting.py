"""Selective reporting: what the keyed sampler cannot see, measured per identity.

The keyed sampler (docs/security.md, § Keyed sampling) fixes every token of a result once the job is leased, so a
client cannot choose *what* it returns — but it can choose *whether* to return it. A client that generates, scores
its own completions (the task's reward is public) and abandons the leases whose rewards it dislikes returns only
honest results, each of which passes every check, and still tilts the training data toward what it likes. Two
observations expose it, both kept per identity:

- the share of its leases that ended without a result from it (released, or run out and reissued);
- the rewards of what it does return, against the coordinator's expectation for them: the mean reward of the
  other identities' results at the same policy version (jobs are drawn at random from the task, so an honest
  client's results have that expectation whatever it abandons — a selective one's are higher);
- the rewards of what it returned against the rewards of what it dropped. A dropped job is reissued with its key at
  its version (coordinator.core.scheduling), so whoever computes it next produces the very tokens, and the very
  reward, the dropping client saw: the store knows exactly what was dropped. An honest client drops at random
  (its two samples share one distribution); a selective one drops what scores low. This needs no other results at
  the same version, so it holds in small runs (2 jobs per version: the version comparison rarely has 3 others).

Abandoning alone is what honest volunteers do too (a laptop closed mid-job, a client stopped): only both together —
a high unreturned share *and* returned rewards significantly above expectation, each past a minimum sample — are
evidence (either comparison), and then the identity is *flagged* (coordinator.core.trust.on_flag: its valid
streak resets, and every ``quarantine_after``-th flag quarantines it), at most once per ``cooldown_s``. Everything here is pure: counts in, decision out, with ``now`` passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: The audit log's outcome and reason for a lowering of trust by this rule (it is no refusal of a request).
FLAGGED = "flagged"
SELECTIVE_REPORTING = "selective_reporting"


@dataclass(frozen=True)
class VersionGroup:
    """One identity's accepted results at one policy version: how many, and the sum and sum of squares of their
    mean rewards (what the store aggregates, so the rule never needs the rows themselves)."""

    client_id: str
    version: int
    n: int
    total: float
    squares: float


@dataclass(frozen=True)
class RewardBias:
    """An identity's returned rewards against the expectation: over ``results`` results compared (those at a
    version with enough results of others), the mean excess per result and its z-score."""

    results: int = 0
    excess: float = 0.0
    z: float = 0.0


def reward_biases(groups: Iterable[VersionGroup], *, min_peers: int = 3, var_floor: float = 1e-3
                  ) -> dict[str, RewardBias]:
    """Compare every identity's results with the other identities' at the same versions (leave-one-out means).

    Per version v with n of the identity's results summing to s, and N_o other results with mean e and per-result
    variance σ² (floored at ``var_floor``: a version where every other result scored alike must not make any
    difference infinitely significant): the excess is s − n·e, with variance n·σ² + n²·σ²/N_o (its own spread
    plus the uncertainty of e). Versions with fewer than ``min_peers`` other results are skipped. One pass over
    the groups, whatever the number of identities."""
    rows = list(groups)
    totals: dict[int, tuple[int, float, float]] = {}
    for g in rows:
        n, s, q = totals.get(g.version, (0, 0, 0.0))
        totals[g.version] = (n + g.n, s + g.total, q + g.squares)
    acc: dict[str, tuple[int, float, float]] = {}
    for g in rows:
        n_all, s_all, q_all = totals[g.version]
        n_o = n_all - g.n
        if n_o < min_peers:
            continue
        mean = (s_all - g.total) / n_o
        var = max(var_floor, (q_all - g.squares) / n_o - mean * mean)
        n, e, v = acc.get(g.client_id, (0, 0.0, 0.0))
        acc[g.client_id] = (n + g.n, e + g.total - g.n * mean, v + g.n * var + g.n * g.n * var / n_o)
    return {c: RewardBias(n, e / n, e / math.sqrt(v)) for c, (n, e, v) in acc.items() if n}


def reward_bias(groups: Iterable[VersionGroup], client_id: str, *, min_peers: int = 3,
                var_floor: float = 1e-3) -> RewardBias:
    """:func:`reward_biases` for one identity (none compared: zeros)."""
    return reward_biases(groups, min_peers=min_peers, var_floor=var_floor).get(client_id, RewardBias())


@dataclass(frozen=True)
class Sample:
    """Rewards summed: how many, their sum and their sum of squares (what the store aggregates)."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def mean_and_variance(self, var_floor: float) -> tuple[float, float]:
        """The mean and the unbiased per-result variance (floored: a sample that scored alike must not make any
        difference infinitely significant)."""
        mean = self.total / self.n
        var = (self.squares - self.n * mean * mean) / (self.n - 1) if self.n > 1 else 0.0
        return mean, max(var_floor, var)


@dataclass(frozen=True)
class DroppedBias:
    """An identity's returned rewards against the rewards of the jobs it dropped, as computed at the same version
    by whoever took them next: how many of each, the difference of the means, and its z-score (Welch)."""

    returned: int = 0
    dropped: int = 0
    excess: float = 0.0
    z: float = 0.0


def dropped_bias(returned: Sample, dropped: Sample, *, var_floor: float = 1e-3) -> DroppedBias:
    """Compare what an identity returned with what it dropped (both non-empty: else nothing compared)."""
    if returned.n == 0 or dropped.n == 0:
        return DroppedBias(returned.n, dropped.n)
    m_r, v_r = returned.mean_and_variance(var_floor)
    m_d, v_d = dropped.mean_and_variance(var_floor)
    excess = m_r - m_d
    return DroppedBias(returned.n, dropped.n, excess, excess / math.sqrt(v_r / returned.n + v_d / dropped.n))


@dataclass(frozen=True)
class ReportingPolicy:
    """Thresholds of the rule (coordinator.config.TrustConfig: reporting_*)."""

    min_leases: int = 40
    max_unreturned_share: float = 0.25
    min_results: int = 20
    max_reward_z: float = 4.0
    max_dropped_z: float = 6.0
    cooldown_s: float = 600.0


@dataclass(frozen=True)
class Reporting:
    """What the coordinator observed of one identity's reporting: leases it was granted, how many of them ended
    without a result from it, how its returned rewards compare with the other volunteers' at the same versions, and
    with the rewards of the jobs it dropped."""

    leased: int
    unreturned: int
    bias: RewardBias = RewardBias()
    dropped: DroppedBias = DroppedBias()

    @property
    def unreturned_share(self) -> float:
        return self.unreturned / self.leased if self.leased else 0.0


def worth_comparing(leased: int, unreturned: int, policy: ReportingPolicy) -> bool:
    """Is the unreturned share alone high enough, over enough leases, to compare the rewards (the costlier half)?
    Most identities never get that far."""
    return leased >= policy.min_leases and unreturned / leased > policy.max_unreturned_share


def selective(rep: Reporting, policy: ReportingPolicy, now: float, last_flagged: float | None) -> str | None:
    """The reason to lower the identity's trust now, or None: a high unreturned share over at least
    ``min_leases`` leases, and returned rewards significantly above either expectation — more than ``max_reward_z``
    standard errors above the other volunteers' at the same versions over at least ``min_results`` results, or more
    than ``max_dropped_z`` above the rewards of the jobs it dropped, with at least ``min_results`` of each (the
    intake asks after every accepted result, so a threshold must hold for a path of many looks: in
    tests/unit/test_reporting.py's 240 simulated honest swarms of 2–8 jobs per version no z passed 4.1, in a one-off
    sweep of 2,000 none passed 4.91) — and no flag within the last ``cooldown_s`` (one piece of evidence is counted
    once per period, not once per result)."""
    if not worth_comparing(rep.leased, rep.unreturned, policy):
        return None
    if last_flagged is not None and now - last_flagged < policy.cooldown_s:
        return None
    dropped = rep.dropped
    share = f"{rep.unreturned} of {rep.leased} leases ({rep.unreturned_share:.0%}) ended without a result"
    if min(dropped.returned, dropped.dropped) >= policy.min_results and dropped.z > policy.max_dropped_z:
        return (f"{share}, and the {dropped.returned} results returned score {dropped.excess:+.3f} above the "
                f"{dropped.dropped} jobs dropped (as others computed them, same key, same version; z = "
                f"{dropped.z:.1f}): results look kept or abandoned by their rewards")
    if rep.bias.results >= policy.min_results and rep.bias.z > policy.max_reward_z:
        return (f"{share}, and the {rep.bias.results} results returned score {rep.bias.excess:+.3f} above the "
                f"other volunteers' at the same versions (z = {rep.bias.z:.1f}): results look kept or abandoned "
                "by their rewards")
    return None
