"""echo_swarm.demo's wait for the final held-out evaluation ends by itself, saying why (issue 37): when the
evaluation is recorded, when the verifier reports it skipped, or after its bound — never a silent wait."""

from __future__ import annotations

from typing import Any

from echo_swarm.demo import final_evaluation


def status(version: int, evals: list[int], skipped: list[int] | None = None) -> dict[str, Any]:
    """A finished run's /v1/status, as far as the wait reads it."""
    roles = {} if skipped is None else {"verifier-0": {"evaluations_skipped": skipped}}
    return {"version": version, "finished": True, "roles": roles,
            "evals": [{"version": v, "accuracy": 0.5, "n": 64} for v in evals]}


def test_the_final_evaluation_recorded_ends_the_wait_silently() -> None:
    wait = final_evaluation(status(100, [0, 75, 100]), waited_s=3.0, bound_s=600.0)
    assert wait.done and wait.message == ""


def test_a_verifier_still_evaluating_is_waited_for_within_the_bound() -> None:
    assert not final_evaluation(status(100, [0, 75], skipped=[25]), waited_s=599.0, bound_s=600.0).done


def test_an_evaluation_the_verifier_skipped_ends_the_wait_at_once_saying_so() -> None:
    wait = final_evaluation(status(100, [0, 75], skipped=[50, 100]), waited_s=0.0, bound_s=600.0)
    assert wait.done and "v100 was skipped" in wait.message and "v75's" in wait.message


def test_the_bound_ends_the_wait_saying_what_is_missing() -> None:
    wait = final_evaluation(status(100, [], skipped=[]), waited_s=600.0, bound_s=600.0)
    assert wait.done and "no held-out evaluation of the final version v100 within 600s" in wait.message
    assert "there is none" in wait.message
