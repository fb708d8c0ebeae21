from __future__ import annotations

from typing import Any

import pytest

from coordinator.core.leases import JobState, LeaseView
from coordinator.core.verify import JobTerms, LogprobStats, check_logprobs, logprob_stats, verify_submission
from shared.errors import ProtocolError, Reason
from shared.messages import Completion, ResultSubmission

NOW = 1000.0
CLIENT = "alice"
STOP = 2
MAX_TOKENS = 4
VOCAB = 100
PHASH = "cd" * 32


def terms(**kw: Any) -> JobTerms:
    fields: dict[str, Any] = dict(version=3, prompt_hash=PHASH, seed=99, group_size=2, n_prompts=2,
                                  max_tokens=MAX_TOKENS, stop_token_ids=frozenset({STOP}), vocab_size=VOCAB)
    return JobTerms(**(fields | kw))


def lease(**kw: Any) -> LeaseView:
    fields: dict[str, Any] = dict(job_id="j0", state=JobState.LEASED, version=3, created_at=NOW - 100,
                                  lease_id="L1", lease_client=CLIENT, lease_deadline=NOW + 60)
    return LeaseView(**(fields | kw))


def comp(tokens: list[int], finish: str = "stop", logprobs: list[float] | None = None) -> Completion:
    return Completion(token_ids=tokens, logprobs=[-0.1] * len(tokens) if logprobs is None else logprobs,
                      finish_reason=finish)


def good_completions() -> list[Completion]:
    return [comp([5, STOP]), comp([7, 8, 9, 10], "length"), comp([STOP]), comp([1, 1, 1, STOP])]


def sub(**kw: Any) -> ResultSubmission:
    fields: dict[str, Any] = dict(job_id="j0", lease_id="L1", version=3, prompt_hash=PHASH, seed=99,
                                  group_size=2, completions=good_completions(), backend="torch", generation_s=0.5)
    return ResultSubmission(**(fields | kw))


def refused(s: ResultSubmission, *, lease_view: LeaseView | None = None, job_terms: JobTerms | None = None,
            client: str = CLIENT, now: float = NOW, oldest: int = 3) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        verify_submission(s, lease_view or lease(), job_terms or terms(), client, now, oldest)
    return info.value


def test_accepts_valid_submission() -> None:
    assert verify_submission(sub(), lease(), terms(), CLIENT, NOW, 3) is None


@pytest.mark.parametrize("oldest", [0, 1, 2, 3])
def test_accepts_result_of_any_kept_version(oldest: int) -> None:
    # async push-pull: the policy may have moved on since the job was leased; the result is still
    # verified as long as its version (the job's bound version) is still kept
    verify_submission(sub(), lease(), terms(), CLIENT, NOW, oldest)  # raises on refusal


def test_accepts_just_before_deadline() -> None:
    verify_submission(sub(), lease(), terms(), CLIENT, NOW + 59.999, 3)


# ---- lease ----------------------------------------------------------------------------------------------
def test_job_completed() -> None:
    err = refused(sub(), lease_view=lease(state=JobState.DONE))
    assert err.reason is Reason.JOB_COMPLETED


def test_job_completed_takes_precedence_over_every_other_fault() -> None:
    bad = sub(lease_id="other", version=9, seed=1, completions=[comp([STOP])])
    err = refused(bad, lease_view=lease(state=JobState.DONE), client="mallory", now=NOW + 1e6, oldest=7)
    assert err.reason is Reason.JOB_COMPLETED


def test_not_lease_holder_other_client() -> None:
    assert refused(sub(), client="mallory").reason is Reason.NOT_LEASE_HOLDER


def test_not_lease_holder_reissued_lease_id() -> None:
    err = refused(sub(lease_id="L1"), lease_view=lease(lease_id="L2"))
    assert err.reason is Reason.NOT_LEASE_HOLDER
    assert err.http_status == 403


def test_lease_expired_at_deadline() -> None:
    err = refused(sub(), now=NOW + 60)
    assert err.reason is Reason.LEASE_EXPIRED
    assert err.http_status == 410


# ---- binding --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("claimed", [2, 4, 0])
def test_wrong_version_vs_job(claimed: int) -> None:
    err = refused(sub(version=claimed), oldest=0)  # old enough to be kept, but not the job's bound version
    assert err.reason is Reason.WRONG_VERSION
    assert "job" in err.message and "version 3" in err.message and f"claims {claimed}" in err.message


def test_wrong_version_vs_job_checked_before_age() -> None:
    err = refused(sub(version=1), oldest=2)  # both wrong: the binding is reported
    assert err.reason is Reason.WRONG_VERSION
    assert "job" in err.message and "too old" not in err.message


def test_version_too_old_to_verify() -> None:
    err = refused(sub(), oldest=4)  # matches the job, but that version's snapshot is no longer kept
    assert err.reason is Reason.VERSION_RETIRED  # not the client's fault: no trust is lost over it
    assert "too old to be verified" in err.message
    assert "3" in err.message and "4" in err.message


def test_version_too_old_boundary() -> None:
    verify_submission(sub(), lease(), terms(), CLIENT, NOW, 3)  # oldest == version: still verifiable
    assert refused(sub(), oldest=4).reason is Reason.VERSION_RETIRED


def test_lease_checked_before_version() -> None:
    assert refused(sub(version=9), now=NOW + 60, oldest=10).reason is Reason.LEASE_EXPIRED
    assert refused(sub(version=9), client="mallory", oldest=10).reason is Reason.NOT_LEASE_HOLDER


def test_version_checked_before_binding() -> None:
    assert refused(sub(seed=1), oldest=4).reason is Reason.VERSION_RETIRED
    assert refused(sub(seed=1, version=2), oldest=0).reason is Reason.WRONG_VERSION


@pytest.mark.parametrize(("field", "value", "word"), [
    ("prompt_hash", "ef" * 32, "prompt_hash"),
    ("seed", 100, "seed"),
    ("group_size", 4, "group_size"),
])
def test_binding_mismatch(field: str, value: Any, word: str) -> None:
    err = refused(sub(**{field: value}))
    assert err.reason is Reason.BINDING_MISMATCH
    assert word in err.message


# ---- shapes and tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [3, 5, 1])
def test_shape_mismatch_wrong_completion_count(n: int) -> None:
    err = refused(sub(completions=[comp([STOP])] * n))
    assert err.reason is Reason.SHAPE_MISMATCH
    assert "expected 4 completions" in err.message


def test_shape_mismatch_logprob_length() -> None:
    comps = good_completions()
    comps[1] = comp([7, 8, 9, 10], "length", logprobs=[-0.1, -0.1, -0.1])
    err = refused(sub(completions=comps))
    assert err.reason is Reason.SHAPE_MISMATCH
    assert "completion 1" in err.message


def test_token_out_of_range_empty() -> None:
    comps = good_completions()
    comps[2] = comp([], "length")
    assert refused(sub(completions=comps)).reason is Reason.TOKEN_OUT_OF_RANGE


def test_token_out_of_range_too_long() -> None:
    comps = good_completions()
    comps[0] = comp([5] * MAX_TOKENS + [STOP])
    assert refused(sub(completions=comps)).reason is Reason.TOKEN_OUT_OF_RANGE


@pytest.mark.parametrize("token", [VOCAB, VOCAB + 1, 2**31 - 1])
def test_token_out_of_range_id_at_or_above_vocab(token: int) -> None:
    comps = good_completions()
    comps[3] = comp([1, token, STOP])
    err = refused(sub(completions=comps))
    assert err.reason is Reason.TOKEN_OUT_OF_RANGE
    assert str(token) in err.message


def test_largest_vocab_token_is_fine() -> None:
    comps = good_completions()
    comps[3] = comp([VOCAB - 1, STOP])
    verify_submission(sub(completions=comps), lease(), terms(), CLIENT, NOW, 3)


# ---- finish reasons -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("tokens", "finish"), [
    ([5, 6], "stop"),                 # 'stop' without a stop token
    ([STOP, 6], "stop"),              # stop token not at the end
    ([STOP, STOP], "stop"),           # more than one stop token
    ([5, 6, STOP, 7], "length"),      # 'length' containing a stop token (and max_tokens long)
    ([5, 6], "length"),               # 'length' while short of max_tokens
    ([5, 6, 7, STOP], "length"),      # 'length' ending in a stop token
])
def test_finish_reason_inconsistent(tokens: list[int], finish: str) -> None:
    comps = good_completions()
    comps[1] = comp(tokens, finish)
    err = refused(sub(completions=comps))
    assert err.reason is Reason.FINISH_REASON
    assert "completion 1" in err.message


def test_multiple_stop_token_ids() -> None:
    t = terms(stop_token_ids=frozenset({STOP, 3}))
    comps = [comp([5, 3]), comp([STOP]), comp([4, 4, 4, 4], "length"), comp([3])]
    verify_submission(sub(completions=comps), lease(), t, CLIENT, NOW, 3)
    comps[2] = comp([4, 3, 4, 4], "length")
    assert refused(sub(completions=comps), job_terms=t).reason is Reason.FINISH_REASON


def test_rule_order_lease_before_binding_before_shape() -> None:
    bad_everything = sub(seed=1, completions=[comp([STOP])])
    assert refused(bad_everything, now=NOW + 60).reason is Reason.LEASE_EXPIRED
    assert refused(bad_everything).reason is Reason.BINDING_MISMATCH
    assert refused(sub(completions=[comp([VOCAB])])).reason is Reason.SHAPE_MISMATCH


# ---- logprobs -------------------------------------------------------------------------------------------
def test_logprob_stats_values() -> None:
    stats = logprob_stats([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]])
    assert stats.n_tokens == 3
    assert stats.mean_abs == pytest.approx(0.75 / 3)
    assert stats.max_abs == pytest.approx(0.5)


def test_logprob_stats_empty() -> None:
    assert logprob_stats([], []) == LogprobStats(0.0, 0.0, 0)


def test_logprob_stats_length_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        logprob_stats([[-1.0, -2.0]], [[-1.0]])
    with pytest.raises(ValueError):
        logprob_stats([[-1.0]], [[-1.0], [-2.0]])


def test_check_logprobs_thresholds_inclusive() -> None:
    check_logprobs(LogprobStats(0.05, 1.0, 10), 0.05, 1.0)  # exactly at both tolerances passes
    check_logprobs(LogprobStats(0.0, 0.0, 0), 0.05, 1.0)


@pytest.mark.parametrize("stats", [LogprobStats(0.0501, 0.1, 10), LogprobStats(0.01, 1.0001, 10),
                                   LogprobStats(3.0, 5.0, 10)])
def test_check_logprobs_refuses(stats: LogprobStats) -> None:
    with pytest.raises(ProtocolError) as info:
        check_logprobs(stats, 0.05, 1.0)
    assert info.value.reason is Reason.LOGPROB_MISMATCH
    assert info.value.http_status == 422
