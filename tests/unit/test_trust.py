"""Trust per identity and rate limits: the pure rules of the trust boundary."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.core.ratelimit import Limiter, Rate, take
from coordinator.core.trust import (
    TrustPolicy,
    TrustState,
    backend_class,
    class_backend,
    is_invalidating,
    known_class,
    on_flag,
    on_invalid,
    on_valid,
    quarantined,
)
from shared.errors import Reason

POLICY = TrustPolicy(quarantine_after=3, quarantine_s=100.0)


def test_trust_is_slow_to_earn_and_quick_to_lose() -> None:
    state = TrustState()
    for _ in range(100):
        state = on_valid(state)
    assert state.consecutive_valid == 100
    state = on_invalid(state, 0.0, POLICY)
    assert state.consecutive_valid == 0 and state.consecutive_invalid == 1


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


def test_every_quarantine_after_th_flag_quarantines_whatever_came_between() -> None:
    state = on_flag(TrustState(consecutive_valid=50), 1, 0.0, POLICY)
    assert state.consecutive_valid == 0 and not quarantined(state, 0.0)
    state = on_flag(on_valid(on_valid(state)), 2, 10.0, POLICY)  # accepted results between: no reprieve
    assert not quarantined(state, 10.0)
    state = on_flag(on_valid(state), 3, 20.0, POLICY)  # the third flag (quarantine_after = 3)
    assert quarantined(state, 20.0) and quarantined(state, 119.0) and not quarantined(state, 120.0)
    state = on_flag(state, 6, 500.0, POLICY)  # the sixth: the second quarantine, twice as long
    assert state.quarantines == 2 and state.quarantined_until == 700.0


def test_only_result_evidence_counts_against_trust() -> None:
    assert is_invalidating(Reason.LOGPROB_MISMATCH) and is_invalidating(Reason.CHOICE_MISMATCH)
    for reason in (Reason.LEASE_EXPIRED, Reason.JOB_COMPLETED, Reason.RATE_LIMITED, Reason.REPLAYED_NONCE):
        assert not is_invalidating(reason)


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


def test_a_llama_class_is_recomputed_in_the_published_precision_and_everything_else_by_torch() -> None:
    from coordinator.core.trust import recompute_class

    assert recompute_class("llama/gpu", "q4_K_M") == "llama-q4_K_M"
    assert recompute_class("llama/cpu", "f16") == "llama-f16"
    assert recompute_class("llama/cpu", None) == "torch"  # no GGUF published: nothing for llama.cpp to rerun
    assert recompute_class("torch/cuda", None) == "torch"
    assert recompute_class("", "f16") == "torch"  # the co-located loop's identity has no pinned class


def test_a_lease_gets_an_offered_precision_of_its_pinned_class_or_is_refused() -> None:
    from coordinator.core.trust import lease_precision, recompute_class
    from shared.errors import ProtocolError, Reason

    offered = ("f16", "q4_K_M")
    assert lease_precision("llama/cpu", None, offered) == "f16"  # the run's default, recorded as such
    assert lease_precision("llama/gpu", "q4_K_M", offered) == "q4_K_M"
    assert lease_precision("torch/cpu", None, offered) is None and lease_precision("torch/cpu", "f32", offered) is None
    assert lease_precision("torch/cuda", "bf16", offered) == "bf16"  # a torch client computing in bf16
    assert recompute_class("torch/cuda", "bf16") == "torch-bf16" and recompute_class("llama/cpu", "bf16") == "llama-bf16"
    for pinned, asked in (("llama/cpu", "q8_0"), ("torch/cuda", "q4_K_M"), ("torch/cpu", "f16")):
        with pytest.raises(ProtocolError) as caught:  # class shopping by asking is refused, naming what is offered
            lease_precision(pinned, asked, offered)
        assert caught.value.reason is Reason.PRECISION_NOT_OFFERED and asked in caught.value.message
    with pytest.raises(ProtocolError, match="publishes no GGUF"):
        lease_precision("llama/cpu", "f16", ())


def test_each_recompute_class_has_its_engine() -> None:
    from coordinator.core.trust import recompute_class
    from coordinator.run.workqueue import engine_of

    assert engine_of(recompute_class("llama/gpu", "q4_K_M")) == "llama"
    assert engine_of(recompute_class("torch/cuda", "bf16")) == "torch-bf16"
    assert engine_of(recompute_class("torch/cpu", None)) == engine_of(recompute_class("llama/cpu", None)) == "torch"
