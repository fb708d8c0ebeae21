"""Records that cross a role boundary, typed and encoded in one place: the role that writes one and the role that
reads it share this definition rather than a dict's keys."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pydantic import BaseModel, ConfigDict

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
    # the class whose recompute is π_b (core.trust.recompute_class: "torch", "llama-q4_K_M", ...); None: a result
    # accepted before the intake recorded it (the learner derives it from the client's pinned class)
    source: str | None = None

    def encode(self) -> bytes:
        data = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict(): no deep copy of the lists
        for optional in ("loss_mask", "source"):
            if data[optional] is None:
                del data[optional]
        return wire.pack(data)

    @classmethod
    def decode(cls, payload: bytes) -> AcceptedResult:
        data = wire.unpack(payload, max_bytes=len(payload))
        return cls(completions=data["completions"], behaviour_logprobs=data["behaviour_logprobs"],
                   recomputed_logprobs=data["recomputed_logprobs"], finish_reasons=data.get("finish_reasons", []),
                   logprob_mean_abs_diff=float(data.get("logprob_mean_abs_diff", 0.0)),
                   reward_means={str(k): float(v) for k, v in (data.get("reward_means") or {}).items()},
                   loss_mask=data.get("loss_mask"), source=data.get("source"))


class RelayReport(BaseModel):
    """The p2p role's call relay, as its report says (coordinator.roles.p2p_relay): calls answered per path,
    refused, in progress."""

    model_config = ConfigDict(frozen=True)

    relayed: dict[str, int]
    refused: int
    active: int


class P2PReport(BaseModel):
    """What the p2p role reports of the coordinator's libp2p peer, written by that role into the store's role
    status and read by the API (GET /v1/p2p, the status page's egress) — a pydantic model because the API reads it
    back from JSON another process wrote. A stopped or unstarted peer reports no ``peer_id``; the role's own
    ``pid``/``at`` beside it are not read here."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    peer_id: str | None = None
    maddrs: list[str] = []
    served_bytes: int = 0  # bytes the coordinator's peer served over libp2p
    peer_served_bytes: int = 0  # bytes volunteers say they served each other
    calls: RelayReport | None = None

    def as_json(self) -> dict[str, object]:
        """The report as the role writes it (its keys, in order); ``dict[str, object]``: JSON for the store."""
        return self.model_dump()


class VerifierTotals(BaseModel):
    """The seconds a verifier role reports it spent recomputing and evaluating (coordinator.roles.verifier):
    what the learner reads of the verifiers' reports for its step metrics."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    recompute_s: float = 0.0
    eval_s: float = 0.0


class LearnerProgress(BaseModel):
    """What the API reads of the learner role's report (coordinator.roles.learner): the version it is training
    towards (the sequential-pull guard issues nothing bound to a version that step supersedes)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    target: int = 0
