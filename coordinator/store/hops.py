"""What crosses between role processes through the store, one typed record per hop, each with the codec its type
derives: the work queue's requests and answers (msgpack, :class:`Hop`) and the roles' status reports (JSON,
:class:`RoleReport`).

Roles meet only through the store, so the record a role writes is the only contract between it and the role that
reads it. Declaring the record once, and having the store take nothing else (:class:`coordinator.store.work_rows.WorkRows`
and :class:`coordinator.store.role_status.RoleStatus` refuse a dict), makes a misspelt or missing key a mypy error in
the writer instead of a ``KeyError`` in another process an hour later.

The work kinds are declared as shared.endpoints declares the volunteer calls: each names its request and answer
records, and both the queue's requester (coordinator.run.workqueue, the learner) and its worker
(coordinator.roles.verifier) read these, so the two sides cannot pair a kind with the wrong record.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, Self, TypeVar, cast, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from coordinator.core.verify import TokenStats
from shared import wire
from shared.sampler import Segment

#: What recomputes a result: torch from the version's safetensors in one batched pass ("torch"), torch replaying a
#: bf16 client's generations in bf16 ("torch-bf16", coordinator.engine.torch_replay), or llama.cpp from its GGUF file
#: (the file a llama.cpp client ran, coordinator.engine.llama_verifier).
Engine = Literal["torch", "torch-bf16", "llama"]


class Hop(BaseModel):
    """A record of the work queue: strict (no coercion, no unknown field) and immutable, like the protocol's
    messages (shared.messages), and encoded the same way (msgpack, shared.wire). Written only by our own roles, so a
    record that does not decode is a bug, raised as shared.errors.ProtocolError."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    def encode(self) -> bytes:
        return wire.pack(self._plain())

    def _plain(self) -> dict[str, object]:
        """The fields as msgpack takes them — not model_dump(), which copies every list (a recompute's answer holds
        four floats per token)."""
        return {name: value._plain() if isinstance(value, Hop) else value
                for name, value in ((n, getattr(self, n)) for n in type(self).model_fields)}

    @classmethod
    def decode(cls, data: bytes) -> Self:
        return wire.decode(data, cls, max_bytes=len(data))


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # msgpack gives a tuple back as a list


WireSegment = Annotated[Segment, BeforeValidator(_tuple)]


def engine_from_wire(raw: Any) -> Engine:
    """A recompute request's engine; requests written before engines existed are torch's. The API wrote it (never a
    client), so an unknown name is a bug, not bad input."""
    if raw is None:
        return "torch"
    if raw not in get_args(Engine):
        raise ValueError(f"unknown recompute engine {raw!r}: one of {', '.join(get_args(Engine))}")
    return cast(Engine, raw)


class RecomputeRequest(Hop):
    """The API asks a verifier for its recompute of one result (coordinator.run.workqueue.RemoteVerifier)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    segments: list[list[WireSegment]] | None = None  # keyed draws (shared.sampler.Segment); None: no margins
    engine: Annotated[Engine, BeforeValidator(engine_from_wire)] = "torch"
    group: int = 1  # llama.cpp: completions per prompt, which shared the prompt's evaluation on the client
    precision: str | None = None  # llama.cpp: the GGUF file's precision the lease named; None: the run's default


class RecomputedStats(Hop):
    """:class:`TokenStats` as a verifier's answer carries it."""

    logprobs: list[list[float]]
    entropy: list[list[float]]
    variance: list[list[float]]
    top: list[list[float]]
    margins: list[list[float]] | None = None

    @classmethod
    def of(cls, stats: TokenStats) -> RecomputedStats:
        return cls(logprobs=stats.logprobs, entropy=stats.entropy, variance=stats.variance, top=stats.top,
                   margins=stats.margins)

    def token_stats(self) -> TokenStats:
        return TokenStats(self.logprobs, self.entropy, self.variance, self.top, self.margins)


class RecomputeAnswer(Hop):
    """A verifier's answer to a :class:`RecomputeRequest`: the stats, or ``gone`` when the version is no longer
    kept."""

    stats: RecomputedStats | None = None
    gone: bool = False


class EvaluateRequest(Hop):
    """The learner asks for the held-out evaluation of the row's version; the verifier records the outcome in the
    store's evals itself (no answer)."""


Req = TypeVar("Req", bound=Hop)
Ans = TypeVar("Ans", bound=Hop)


@dataclass(frozen=True, slots=True)
class WorkKind(Generic[Req, Ans]):
    """A kind of request of the work queue: ``name`` is the ``kind`` column, ``request`` the record a requester
    writes, ``answer`` the record a worker answers with (None: nobody waits for an answer)."""

    name: str
    request: type[Req]
    answer: type[Ans] | None


RECOMPUTE: WorkKind[RecomputeRequest, RecomputeAnswer] = WorkKind("recompute", RecomputeRequest, RecomputeAnswer)
EVALUATE: WorkKind[EvaluateRequest, Hop] = WorkKind("evaluate", EvaluateRequest, None)
#: Every kind, in the order of the work table's CHECK constraint.
WORK_KINDS: tuple[WorkKind[Any, Any], ...] = (RECOMPUTE, EVALUATE)


def work_kind(name: str) -> WorkKind[Any, Any]:
    """The kind a claimed row names (its ``kind`` column)."""
    for kind in WORK_KINDS:
        if kind.name == name:
            return kind
    raise ValueError(f"unknown work kind {name!r}: one of {', '.join(k.name for k in WORK_KINDS)}")


class RoleReport(BaseModel):
    """What a role process reports for the others and the status page (coordinator.store.role_status): stamped with
    the process and the time of the report by construction, kept as JSON and served as it is (``/v1/status``
    ``roles``). Its fields are typed for the writer (an unknown one is refused); a reader that must tolerate a report
of another release reads a view of it with defaults (coordinator.run.records)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int = Field(default_factory=os.getpid)
    at: float = Field(default_factory=time.time)

    def to_json(self) -> str:
        return self.model_dump_json()
