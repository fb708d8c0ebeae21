"""The records that cross a role boundary (coordinator.run.records): encoded once by the writer, read by attribute
by the reader, and an older run's payloads still read after an upgrade (a restart replays recorded steps)."""

from __future__ import annotations

from coordinator.run.records import AcceptedResult
from shared import wire


def test_an_accepted_result_round_trips_with_and_without_a_loss_mask() -> None:
    plain = AcceptedResult(completions=[[5, 6], [7]], behaviour_logprobs=[[-0.5, -1.0], [-2.0]],
                           recomputed_logprobs=[[-0.4, -1.1], [-2.1]], finish_reasons=["stop", "length"],
                           logprob_mean_abs_diff=0.1, reward_means={"last_number": 0.5})
    assert AcceptedResult.decode(plain.encode()) == plain
    assert "loss_mask" not in wire.unpack(plain.encode())  # a single-turn result stores no mask
    episodes = AcceptedResult(completions=[[5, 9, 6]], behaviour_logprobs=[[-0.5, -3.0, -1.0]],
                              recomputed_logprobs=[[-0.4, -3.0, -1.1]], finish_reasons=["stop"],
                              logprob_mean_abs_diff=0.0, reward_means={"episode": 1.0}, loss_mask=[[1, 0, 1]])
    decoded = AcceptedResult.decode(episodes.encode())
    assert decoded == episodes and decoded.loss_mask == [[1, 0, 1]]


def test_a_payload_of_an_older_run_still_decodes() -> None:
    """Before per-reward means (and for single-turn jobs, always) a payload had fewer keys: the learner's replay of a
    recorded step must still read it."""
    old = wire.pack({"completions": [[1, 2]], "behaviour_logprobs": [[-1.0, -1.0]],
                     "recomputed_logprobs": [[-1.0, -0.9]], "finish_reasons": ["stop"],
                     "logprob_mean_abs_diff": 0.05})
    result = AcceptedResult.decode(old)
    assert result.completions == [[1, 2]] and result.recomputed_logprobs == [[-1.0, -0.9]]
    assert result.reward_means == {} and result.loss_mask is None
