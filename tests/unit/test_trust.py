"""Adaptive trust, rate limits and replica judgement: the pure rules of the trust boundary."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from coordinator.core.ratelimit import Limiter, Rate, take
from coordinator.core.replicas import (
    Party,
    Verdict,
    agreement,
    independent,
    judge,
    judge_original,
    needs_arbiter,
)
from coordinator.core.trust import (
    TrustPolicy,
    TrustState,
    backend_class,
    class_backend,
    is_invalidating,
    known_class,
    on_invalid,
    on_valid,
    quarantined,
    replication_rate,
    should_replicate,
)
from shared.errors import Reason

POLICY = TrustPolicy(trusted_after=10, min_rate=0.05, quarantine_after=3, quarantine_s=100.0)


def test_new_identity_is_untrusted_and_always_replicated() -> None:
    assert replication_rate(TrustState(), POLICY) == 1.0
    assert should_replicate(TrustState(), POLICY, "j1", b"secret")


def test_trust_is_slow_to_earn_and_quick_to_lose() -> None:
    state = TrustState()
    for _ in range(9):
        state = on_valid(state)
    assert replication_rate(state, POLICY) == 1.0  # 9 valid: still untrusted
    state = on_valid(state)
    assert replication_rate(state, POLICY) == 0.1  # 10 valid: 1/10
    for _ in range(90):
        state = on_valid(state)
    assert replication_rate(state, POLICY) == 0.05  # floor
    state = on_invalid(state, 0.0, POLICY)
    assert state.consecutive_valid == 0 and replication_rate(state, POLICY) == 1.0


def test_repeated_failures_quarantine_for_growing_periods() -> None:
    state = TrustState()
    state = on_invalid(on_invalid(state, 0.0, POLICY), 0.0, POLICY)
    assert not quarantined(state, 0.0) and state.consecutive_invalid == 2
    state = on_invalid(state, 10.0, POLICY)
    assert quarantined(state, 10.0) and quarantined(state, 109.0) and not quarantined(state, 110.0)
    for _ in range(3):
        state = on_invalid(state, 200.0, POLICY)
    assert state.quarantines == 2 and state.quarantined_until == 400.0  # the second lasts twice as long


def test_a_valid_result_clears_the_failure_streak() -> None:
    state = on_valid(on_invalid(on_invalid(TrustState(), 0.0, POLICY), 0.0, POLICY))
    assert state.consecutive_invalid == 0
    assert not quarantined(on_invalid(state, 0.0, POLICY), 0.0)


def test_only_result_evidence_counts_against_trust() -> None:
    assert is_invalidating(Reason.LOGPROB_MISMATCH) and is_invalidating(Reason.REPLICA_MISMATCH)
    for reason in (Reason.LEASE_EXPIRED, Reason.JOB_COMPLETED, Reason.RATE_LIMITED, Reason.REPLAYED_NONCE):
        assert not is_invalidating(reason)


def test_replication_draw_is_deterministic_and_near_its_rate() -> None:
    state = TrustState(consecutive_valid=20)  # rate 1/20
    draws = [should_replicate(state, POLICY, f"j{i:06d}", b"k") for i in range(4000)]
    assert draws == [should_replicate(state, POLICY, f"j{i:06d}", b"k") for i in range(4000)]
    assert 0.03 < sum(draws) / len(draws) < 0.07
    assert draws != [should_replicate(state, POLICY, f"j{i:06d}", b"other") for i in range(4000)]


def test_backend_class_ignores_the_device_model_name() -> None:
    assert backend_class("torch", "cuda:NVIDIA RTX 3060") == "torch/cuda"
    assert backend_class("llama", "cpu") == "llama/cpu"
    assert backend_class("torch", "") == "torch/cpu"


def test_only_a_fixed_set_of_classes_is_known() -> None:
    # what swarm_client really reports: torch cpu | cuda:<name> | mps, llama.cpp cpu | gpu
    assert known_class("torch", "cuda:NVIDIA RTX 3060") == "torch/cuda"
    assert known_class("torch", "mps") == "torch/mps"
    assert known_class("llama", "gpu") == "llama/gpu"
    assert known_class("llama", "cpu") == "llama/cpu"
    for backend, device in (("torch", "tpu:v5"), ("torch", "xpu:0"), ("llama", "cuda"), ("torch", "gpu"),
                            ("llama", "metal"), ("onnx", "cpu"), ("torch", "cpu\n")):
        assert known_class(backend, device) is None, (backend, device)
    assert class_backend("llama/cpu") == "llama" and class_backend("torch") == "torch"


def test_token_bucket_allows_burst_then_refills() -> None:
    rate = Rate(rate=2.0, burst=3.0)
    bucket = None
    for _ in range(3):
        bucket, wait = take(bucket, rate, 100.0)
        assert wait == 0.0
    bucket, wait = take(bucket, rate, 100.0)
    assert wait == 0.5
    bucket, wait = take(bucket, rate, 100.5)
    assert wait == 0.0
    assert take(None, Rate(0.0, 1.0), 0.0)[1] == 0.0
    assert math.isinf(take(take(None, Rate(0.0, 1.0), 0.0)[0], Rate(0.0, 1.0), 0.0)[1])


def test_limiter_is_per_key_and_bounded() -> None:
    lim = Limiter(Rate(1.0, 1.0), max_keys=10)
    assert lim.check("a", 0.0) == 0.0 and lim.check("a", 0.0) > 0 and lim.check("b", 0.0) == 0.0
    for i in range(100):
        lim.check(f"k{i}", 0.0)
    assert len(lim) == 10
    assert Limiter(Rate(0.0, 1.0)).check("x", 0.0) == 0.0  # rate 0: unlimited


@given(st.lists(st.floats(min_value=0, max_value=1000), min_size=1, max_size=50))
def test_bucket_never_exceeds_burst_or_goes_negative(times: list[float]) -> None:
    rate = Rate(rate=1.5, burst=4.0)
    bucket = None
    for now in sorted(times):
        bucket, _ = take(bucket, rate, now)
        assert 0.0 <= bucket.tokens <= 4.0


def test_replica_agreement_and_arbiter() -> None:
    a = [[1, 2, 3], [4, 5]]
    assert agreement(a, a) == 1.0
    assert agreement(a, [[1, 2, 9], [4, 5]]) == 0.8
    assert agreement(a, [[1]]) == 0.0
    assert needs_arbiter(a, a, True, 0.95) is Verdict.AGREE
    cheat = [[7, 7, 7], [7, 7]]
    assert needs_arbiter(a, cheat, False, 0.95) is Verdict.INCONCLUSIVE  # other hardware class: no blame
    assert needs_arbiter(a, cheat, True, 0.95) is None
    assert judge(a, cheat, a, 0.95) is Verdict.REPLICA_INVALID
    assert judge(cheat, a, a, 0.95) is Verdict.ORIGINAL_INVALID
    assert judge(a, cheat, [[0, 0, 0], [0, 0]], 0.95) is Verdict.INCONCLUSIVE


def test_the_arbiter_alone_judges_an_original_of_its_class() -> None:
    a = [[1, 2, 3], [4, 5]]
    assert judge_original(a, a, 0.95) is Verdict.AGREE
    assert judge_original([[1, 2, 9], [4, 5]], a, 0.95) is Verdict.ORIGINAL_INVALID  # 0.8 < 0.95
    assert judge_original([[7, 7, 7], [7, 7]], a, 0.95) is Verdict.ORIGINAL_INVALID  # never inconclusive


def test_independence_needs_other_addresses_and_another_registration_burst() -> None:
    a = Party("a", frozenset({"10.0.0.1"}), 1000.0)
    assert independent(a, Party("b", frozenset({"10.0.0.2"}), 1100.0), burst_s=60)
    assert not independent(a, Party("b", frozenset({"10.0.0.2"}), 1030.0), burst_s=60)  # same burst
    assert not independent(a, Party("b", frozenset({"10.0.0.2", "10.0.0.1"}), 2000.0), burst_s=60)  # shared address
    assert not independent(a, Party("a", frozenset({"10.0.0.9"}), 5000.0), burst_s=60)  # itself
    assert not independent(a, Party("b", frozenset(), 5000.0), burst_s=60)  # unobserved: proves nothing
    assert not independent(a, Party("b", frozenset({""}), 5000.0), burst_s=60)
    b = Party("b", frozenset({"10.0.0.2"}), 1100.0)
    assert independent(a, b, 60) == independent(b, a, 60)
