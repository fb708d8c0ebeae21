"""Selective reporting (coordinator.core.reporting): the pure rule, with an injected clock.

A client that abandons the leases whose rewards it dislikes returns only honest, keyed-sampler-exact results, so
no per-result check can refuse it; the rule compares its unreturned share and its returned rewards with the other
volunteers' at the same versions, and with the rewards of the jobs it dropped (reissued with their keys at their
versions: the very samples it saw, returned by whoever took them next). Simulated swarms here: honest clients (some
abandoning at random, as laptops do) are never flagged; one that abandons its low-reward results is, once per
cooldown — in small runs too (2 jobs per version), through the second comparison."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from coordinator.core.reporting import (
    DroppedBias,
    Reporting,
    ReportingPolicy,
    RewardBias,
    Sample,
    VersionGroup,
    dropped_bias,
    reward_bias,
    reward_biases,
    selective,
    worth_comparing,
)

POLICY = ReportingPolicy(min_leases=40, max_unreturned_share=0.25, min_results=20, max_reward_z=4.0,
                         cooldown_s=600.0)
T0 = 1_000_000.0


def swarm(rng: random.Random, *, versions: int = 30, jobs_per_version: int = 12, completions: int = 8,
          p: float = 0.3, abandon: dict[str, float] | None = None, selective_below: dict[str, float] | None = None
          ) -> tuple[list[VersionGroup], dict[str, tuple[int, int]]]:
    """Clients h0..h3 and x draw jobs at random; a job's result has mean reward of ``completions`` Bernoulli(p)
    draws. ``abandon``: a client drops that share of its leases at random; ``selective_below``: it drops every
    result whose mean reward is below the given value. Returns the store's per-(client, version) groups and each
    client's (leased, unreturned)."""
    names = ["h0", "h1", "h2", "h3", "x"]
    abandon, selective_below = abandon or {}, selective_below or {}
    groups: dict[tuple[str, int], list[float]] = {}
    leases = {c: [0, 0] for c in names}
    for v in range(versions):
        for _ in range(jobs_per_version * len(names)):
            c = rng.choice(names)
            reward = sum(rng.random() < p for _ in range(completions)) / completions
            leases[c][0] += 1
            if rng.random() < abandon.get(c, 0.0) or reward < selective_below.get(c, -1.0):
                leases[c][1] += 1
                continue
            groups.setdefault((c, v), []).append(reward)
    out = [VersionGroup(c, v, len(r), sum(r), sum(x * x for x in r)) for (c, v), r in groups.items()]
    return out, {c: (a, b) for c, (a, b) in leases.items()}


def verdict(groups: list[VersionGroup], leases: dict[str, tuple[int, int]], client: str, now: float = T0,
            last: float | None = None) -> str | None:
    return selective(Reporting(*leases[client], reward_bias(groups, client)), POLICY, now, last)


@pytest.mark.parametrize("seed", range(20))
def test_honest_clients_are_never_flagged_even_when_they_abandon_at_random(seed: int) -> None:
    rng = random.Random(seed)
    groups, leases = swarm(rng, abandon={"h1": 0.5, "x": 0.4})  # laptops closed mid-job: half their leases
    for c in leases:
        assert verdict(groups, leases, c) is None, (c, reward_bias(groups, c))
    assert abs(reward_bias(groups, "h1").z) < 4.0 and reward_bias(groups, "h1").results >= 20


@pytest.mark.parametrize("seed", range(20))
def test_a_client_that_abandons_its_low_rewards_is_flagged(seed: int) -> None:
    rng = random.Random(seed)
    groups, leases = swarm(rng, selective_below={"x": 0.375})  # keeps a result only if it scored ≥ 3/8
    why = verdict(groups, leases, "x")
    assert why is not None and "ended without a result" in why and "z = " in why
    bias = reward_bias(groups, "x")
    assert bias.excess > 0.05 and bias.z > 4.0
    for c in ("h0", "h1", "h2", "h3"):  # the others lose nothing: its own results never raise their expectation
        assert verdict(groups, leases, c) is None


def test_the_same_evidence_lowers_trust_once_per_cooldown() -> None:
    groups, leases = swarm(random.Random(7), selective_below={"x": 0.375})
    assert verdict(groups, leases, "x", now=T0, last=None) is not None
    assert verdict(groups, leases, "x", now=T0 + 599.0, last=T0) is None  # within the cooldown
    assert verdict(groups, leases, "x", now=T0 + 600.0, last=T0) is not None  # the next period


def test_each_condition_needs_its_minimum_sample() -> None:
    strong = RewardBias(results=50, excess=0.2, z=9.0)
    assert selective(Reporting(39, 30, strong), POLICY, T0, None) is None  # too few leases
    assert selective(Reporting(100, 25, strong), POLICY, T0, None) is None  # share 0.25: not past the threshold
    assert selective(Reporting(100, 26, strong), POLICY, T0, None) is not None
    assert selective(Reporting(100, 50, RewardBias(19, 0.2, 9.0)), POLICY, T0, None) is None  # too few results
    assert selective(Reporting(100, 50, RewardBias(50, 0.2, 4.0)), POLICY, T0, None) is None  # z not above 4
    assert selective(Reporting(100, 50, RewardBias(50, -0.2, -9.0)), POLICY, T0, None) is None  # below: no gain
    assert not worth_comparing(0, 0, POLICY) and worth_comparing(40, 11, POLICY)
    assert Reporting(0, 0).unreturned_share == 0.0 and Reporting(8, 2).unreturned_share == 0.25


def test_reward_bias_is_leave_one_out_per_version_and_skips_thin_versions() -> None:
    # version 0: x's 4 results average 0.75, the others' 6 average 0.25 (variance 0.0625); version 1: 2 others only
    groups = [VersionGroup("x", 0, 4, 3.0, 4 * 0.75 ** 2), VersionGroup("a", 0, 6, 1.5, 6 * 0.125),
              VersionGroup("x", 1, 5, 5.0, 5.0), VersionGroup("a", 1, 2, 0.0, 0.0)]
    bias = reward_bias(groups, "x", min_peers=3)
    assert bias.results == 4  # version 1 has 2 other results: skipped
    assert bias.excess == pytest.approx(0.5)
    var = 0.125 - 0.25 ** 2
    assert bias.z == pytest.approx(4 * 0.5 / (4 * var + 16 * var / 6) ** 0.5)
    # a version where every other result scored the same: the variance floor keeps z finite
    flat = [VersionGroup("x", 0, 3, 3.0, 3.0), VersionGroup("a", 0, 10, 0.0, 0.0)]
    assert reward_bias(flat, "x", var_floor=1e-3).z == pytest.approx(3.0 / (3 * 1e-3 + 9 * 1e-3 / 10) ** 0.5)
    assert reward_bias(groups, "nobody") == RewardBias()
    assert set(reward_biases(groups)) == {"x", "a"} and reward_biases([]) == {}


# ---- the second comparison: what a client returned against what it dropped -------------------------------------
def small_swarm(rng: random.Random, *, jobs_per_version: int, versions: int, abandon: float, attacker: bool
                ) -> tuple[dict[str, int], dict[str, float]]:
    """A small run as the issuer plays it: ``jobs_per_version`` jobs per version, two identities taking them in
    turn at random; a dropped job goes back to the queue with its sample (its key at its version) and the next
    taker returns that very reward. The policy trains: a job's reward is the mean of 8 Bernoulli(p) draws with p
    rising 0.15 → 0.55 over the run. Identity "h" drops at random at rate ``abandon``; so does "x", or —
    ``attacker`` — it drops every result not above the median of all it computed so far. The rule is asked, as the
    intake asks it, after every accepted result, with the default policy (ReportingPolicy()). Returns how many
    times each identity was flagged, and the largest z each reached once both samples held ``min_results``."""
    policy = ReportingPolicy()
    names = ("h", "x")
    leases, unreturned = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    kept: dict[str, Sample] = dict.fromkeys(names, Sample())
    lost: dict[str, Sample] = dict.fromkeys(names, Sample())
    flags, top = dict.fromkeys(names, 0), dict.fromkeys(names, -math.inf)
    computed: list[float] = []

    def add(s: Sample, x: float) -> Sample:
        return Sample(s.n + 1, s.total + x, s.squares + x * x)

    for v in range(versions):
        p = 0.15 + 0.4 * v / versions
        queue = [(sum(rng.random() < p for _ in range(8)) / 8, set[str]()) for _ in range(jobs_per_version)]
        while queue:
            c = rng.choice(names)
            reward, dropped_by = queue.pop(0)
            leases[c] += 1
            if c == "x" and attacker:
                drop = bool(computed) and reward <= statistics.median(computed)
                computed.append(reward)
            else:
                drop = rng.random() < abandon
            if drop:
                unreturned[c] += 1
                dropped_by.add(c)
                queue.append((reward, dropped_by))
                continue
            kept[c] = add(kept[c], reward)
            for d in dropped_by - {c}:
                lost[d] = add(lost[d], reward)
            rep = Reporting(leases[c], unreturned[c], dropped=dropped_bias(kept[c], lost[c]))
            flags[c] += selective(rep, policy, T0, None) is not None
            if worth_comparing(rep.leased, rep.unreturned, policy) and min(kept[c].n, lost[c].n) >= 20:
                top[c] = max(top[c], rep.dropped.z)
    return flags, top


SHAPES = [(2, 150, 0.3), (2, 300, 0.6), (4, 150, 0.4), (8, 100, 0.5)]  # jobs per version, versions, abandon rate


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{j}-jobs-{v}-versions-{a}" for j, v, a in SHAPES])
def test_in_small_runs_honest_clients_are_never_flagged_and_one_returning_above_its_median_is(
        shape: tuple[int, int, float]) -> None:
    """60 simulated swarms per shape (240 in all), both identities honest and abandoning at random: neither is
    flagged at any of the hundreds of times the rule is asked. 60 more per shape with "x" returning only results
    above its running median: its z passes the threshold (6) in every one, the honest identity beside it never."""
    jobs, versions, abandon = shape
    for seed in range(60):
        flags, _ = small_swarm(random.Random(seed), jobs_per_version=jobs, versions=versions, abandon=abandon,
                               attacker=False)
        assert flags == {"h": 0, "x": 0}, (shape, seed)
    for seed in range(60):
        flags, top = small_swarm(random.Random(1000 + seed), jobs_per_version=jobs, versions=versions, abandon=0.1,
                                 attacker=True)
        assert flags["h"] == 0 and flags["x"] > 0 and top["x"] > ReportingPolicy().max_dropped_z, (shape, seed, top)


def test_dropped_bias_is_welch_between_the_returned_and_the_dropped() -> None:
    returned = Sample(4, 3.0, 4 * 0.75 ** 2 + 0.04 * 3)  # mean 0.75, variance 0.04
    dropped = Sample(5, 1.25, 5 * 0.25 ** 2 + 0.09 * 4)  # mean 0.25, variance 0.09
    bias = dropped_bias(returned, dropped)
    assert (bias.returned, bias.dropped) == (4, 5) and bias.excess == pytest.approx(0.5)
    assert bias.z == pytest.approx(0.5 / (0.04 / 4 + 0.09 / 5) ** 0.5)
    # alike within each sample: the variance floor keeps z finite
    assert dropped_bias(Sample(3, 3.0, 3.0), Sample(3, 0.0, 0.0)).z == pytest.approx(1.0 / (2e-3 / 3) ** 0.5)
    assert dropped_bias(Sample(3, 1.0, 1.0), Sample()) == DroppedBias(3, 0)  # nothing dropped: nothing compared


def test_either_comparison_flags_and_each_needs_its_minimum_sample() -> None:
    strong = DroppedBias(returned=30, dropped=25, excess=0.3, z=9.0)
    assert selective(Reporting(100, 50, dropped=strong), POLICY, T0, None) is not None
    assert "jobs dropped" in (selective(Reporting(100, 50, dropped=strong), POLICY, T0, None) or "")
    assert selective(Reporting(100, 20, dropped=strong), POLICY, T0, None) is None  # share 0.2: not past 0.25
    assert selective(Reporting(100, 50, dropped=DroppedBias(30, 19, 0.3, 9.0)), POLICY, T0, None) is None
    assert selective(Reporting(100, 50, dropped=DroppedBias(30, 25, 0.3, 6.0)), POLICY, T0, None) is None  # not > 6
    assert selective(Reporting(100, 50, dropped=strong), POLICY, T0 + 10, T0) is None  # within the cooldown
