"""Records that cross a role boundary, typed and encoded in one place: the role that writes one and the role that
reads it share this definition rather than a dict's keys. The roles' status reports are here (each a
coordinator.store.hops.RoleReport, the only thing the store's role status takes), beside the views a reader takes
of another role's report (defaults for every field, so a report of an older release still reads); the work
queue's records are coordinator.store.hops'."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pydantic import BaseModel, ConfigDict

from coordinator.store.hops import RoleReport
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


class P2PReport(RoleReport):
    """What the p2p role reports of the coordinator's libp2p peer, written by that role into the store's role
    status and read by the API (GET /v1/p2p, the status page's egress) — the one report its reader reads whole, so
    unknown fields are ignored (a report of a newer release) and every field has a default. A stopped or unstarted
    peer reports no ``peer_id``."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    peer_id: str | None = None
    maddrs: list[str] = []
    served_bytes: int = 0  # bytes the coordinator's peer served over libp2p
    peer_served_bytes: int = 0  # bytes volunteers say they served each other
    calls: RelayReport | None = None


class LearnerReport(RoleReport):
    """The learner role's report (coordinator.roles.learner), served as it is in ``/v1/status`` ``learner``
    (docs/protocol.md §4); the API reads :class:`LearnerProgress` of it. The model's figures are None until the
    learner has built its model."""

    target: int  # the version the step in training makes (the sequential-pull guard)
    version: int  # the newest published version
    in_training: list[str]  # job ids of the steps trained but not yet recorded
    busy_s: float
    last_error: str | None
    publishing: list[int]  # versions trained, being published
    last_checkpoint: int | None
    snapshot_dtype: str | None
    trained_version: int | None
    parameters: int | None = None  # coordinator.engine.learner.LearnerDescription
    device: str | None = None
    vocab_size: int | None = None


class VerifierReport(RoleReport):
    """A verifier role's report (coordinator.roles.verifier): its queue and held-out evaluations, its torch
    verifier's figures (the keys of coordinator.engine.verifier.VerifierDescription, flat as ``/v1/status``
    ``roles`` serves them: declared again here because the engine and the run files know nothing of each other,
    and checked against it by tests/unit/test_run_records.py) and the other engines' (``engines``: the llama.cpp
    recompute's and the bf16 replay's counters, once each has run). The learner reads :class:`VerifierTotals` of
    it."""

    in_flight: int
    evaluations: int
    eval_s: float
    evaluations_skipped: list[int]  # versions whose held-out evaluation could not be done (newest last)
    engines: dict[str, int | float] = {}
    # coordinator.engine.verifier.VerifierDescription
    device: str
    cached_versions: list[int]
    ranks: int
    rank_pids: list[int]
    recompute_s: float
    load_s: float
    results: int
    batches: int
    loads: int


class ProcessReport(RoleReport):
    """The API's entry in the roles' reports (coordinator.launch.serve): its process and when it started."""

    started_at: float


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
