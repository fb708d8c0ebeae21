"""Copies: a result whose tokens are those of another job's accepted result.

Each job's sampling key is its own (the job seed, keyed with the run's secret: shared.sampler, core.jobs), so two
jobs' honest completions are two independent draws: they coincide only where the policy leaves no choice. A
result whose completions are token for token those of an already-accepted result of *another* job — whoever sent
either — is therefore a copy, and is refused (``duplicate_result``) before any forward pass is spent on it; the
keyed sampler's check would refuse most copies too (another job's noise), but this costs one indexed lookup and
says what happened.

Where the policy leaves (almost) no choice — a converged policy answering the same prompts the same way — two
honest jobs can give the same tokens. The chance that two independent draws of a result coincide is at most
exp(−surprisal), the surprisal being the result's total −log-probability under the policy; so an identical result
is refused only when its reported surprisal is at least :data:`MIN_COPY_SURPRISAL_NATS` (an honest coincidence
then has probability below e^-20 ≈ 2·10⁻⁹). A copier that under-reports its logprobs to stay below that is
refused by the logprob check instead. A duplicate refusal is not counted against trust (coordinator.core.trust): it
says the work was not the client's own, not that its tokens were forged, and it earns nothing either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.errors import ProtocolError, Reason

#: An identical result with at least this total surprisal (nats) is a copy, not a coincidence (see above).
MIN_COPY_SURPRISAL_NATS = 20.0


def surprisal(logprob_rows: Sequence[Sequence[float]]) -> float:
    """A result's total −log-probability under the policy, from its reported per-token logprobs (nats)."""
    return -sum(float(x) for row in logprob_rows for x in row)


def check_copy(earlier_job: str | None, job_id: str, nats: float,
               min_nats: float = MIN_COPY_SURPRISAL_NATS) -> None:
    """Refuse a result whose tokens equal ``earlier_job``'s accepted result (None: no such result), unless that
    is the same job or the result is too predictable for an identical draw to mean anything."""
    if earlier_job is None or earlier_job == job_id or nats < min_nats:
        return
    raise ProtocolError(Reason.DUPLICATE_RESULT,
                        f"these completions are token for token those of job {earlier_job}, already accepted; each "
                        f"job has its own sampling key, so two jobs' results never coincide by chance "
                        f"({nats:.0f} nats of choice in them): this result is a copy. Generate each job's "
                        f"completions yourself, from its own lease")
