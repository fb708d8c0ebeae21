"""Records that cross a role boundary, typed and encoded in one place: the role that writes one and the role that
reads it share this definition rather than a dict's keys."""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared import wire


@dataclass(frozen=True)
class AcceptedResult:
    """A verified result as the learner trains on it: the ``payload`` of its row in the results table, written once
    by the API's intake when it accepts the result, read by the learner when it batches it (and again when a
    restart replays a recorded step, so an older run's payloads must still decode: every field added later has a
    default). One entry per completion; for a multi-turn job, per episode, whose sequence holds the actions and
    the observations."""

    completions: list[list[int]]
    behaviour_logprobs: list[list[float]]  # π_b per token: the client's, or (episodes) the recompute at observations
    recomputed_logprobs: list[list[float]]  # the verifier's recompute at the result's version
    finish_reasons: list[str]
    logprob_mean_abs_diff: float  # how far the client's logprobs were from the recompute
    reward_means: dict[str, float]  # each reward's mean over the result (task.rewards)
    loss_mask: list[list[int]] | None = None  # episodes: 1 on the model's tokens, 0 on observation tokens

    def encode(self) -> bytes:
        data = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict(): no deep copy of the lists
        if self.loss_mask is None:
            del data["loss_mask"]
        return wire.pack(data)

    @classmethod
    def decode(cls, payload: bytes) -> AcceptedResult:
        data = wire.unpack(payload, max_bytes=len(payload))
        return cls(completions=data["completions"], behaviour_logprobs=data["behaviour_logprobs"],
                   recomputed_logprobs=data["recomputed_logprobs"], finish_reasons=data.get("finish_reasons", []),
                   logprob_mean_abs_diff=float(data.get("logprob_mean_abs_diff", 0.0)),
                   reward_means={str(k): float(v) for k, v in (data.get("reward_means") or {}).items()},
                   loss_mask=data.get("loss_mask"))
