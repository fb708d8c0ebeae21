"""Copies (coordinator.core.duplicates): an identical result of another job is refused only when it holds enough
choice for the coincidence to be impossible; the content hash sees tokens, nothing else."""

from __future__ import annotations

import pytest

from coordinator.core.duplicates import MIN_COPY_SURPRISAL_NATS, check_copy, surprisal
from coordinator.core.trust import is_invalidating
from shared.errors import HTTP_STATUS, ProtocolError, Reason
from shared.hashing import tokens_sha256


def test_a_copy_of_another_jobs_result_is_refused_with_what_happened() -> None:
    with pytest.raises(ProtocolError) as info:
        check_copy("j7", "j9", 50.0)
    assert info.value.reason is Reason.DUPLICATE_RESULT and HTTP_STATUS[Reason.DUPLICATE_RESULT] == 409
    assert "job j7" in info.value.message and "copy" in info.value.message and "own lease" in info.value.message
    assert not is_invalidating(Reason.DUPLICATE_RESULT)  # it earns nothing, but says nothing of forged tokens


def test_no_earlier_result_the_same_job_or_too_little_choice_is_no_copy() -> None:
    check_copy(None, "j9", 1e6)
    check_copy("j9", "j9", 1e6)  # the same job (a resend is answered before this check)
    check_copy("j7", "j9", MIN_COPY_SURPRISAL_NATS - 0.01)  # a converged policy: honest draws may coincide
    with pytest.raises(ProtocolError):
        check_copy("j7", "j9", MIN_COPY_SURPRISAL_NATS)


def test_surprisal_sums_the_reported_logprobs() -> None:
    assert surprisal([[-1.0, -0.5], [], [-2.5]]) == pytest.approx(4.0)
    assert surprisal([]) == 0.0


def test_the_content_hash_is_the_tokens_in_order() -> None:
    a = tokens_sha256([[1, 2, 3], [4]])
    assert a == tokens_sha256([(1, 2, 3), (4,)])  # any sequence type
    assert a != tokens_sha256([[4], [1, 2, 3]])  # another order is another result
    assert a != tokens_sha256([[1, 2], [3, 4]])  # the split between completions counts
    assert len(a) == 64
