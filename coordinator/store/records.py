"""The store's rows as typed records: what a repository's read returns, read by attribute, so a reader that
names a column the table lacks fails in mypy rather than at the first request.

Each record lists its table's columns in the table's order (coordinator.store.store.SCHEMA): where a row is served
as JSON as it is (``/v1/status``), :func:`as_json` gives the same keys in the same order a ``dict(row)`` gave. A leaf:
it imports nothing of the store, so every repository can build its records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class _Row(Protocol):
    def __getitem__(self, key: str, /) -> Any: ...


R = TypeVar("R", bound="DataclassInstance")


def from_row(cls: type[R], row: _Row) -> R:
    """``cls`` from the row's columns of the same names (a ``SELECT *`` may hold more: a later migration's)."""
    return cls(**{f.name: row[f.name] for f in fields(cls)})


def as_json(record: DataclassInstance) -> dict[str, object]:
    """The record as the JSON object its row used to be served as (its columns, in order): ``dict[str, object]``
    because it is the one encoder of every record here, each record's own fields being typed."""
    return asdict(record)


@dataclass(frozen=True, slots=True)
class VersionRow:
    """A committed policy version (``versions``)."""

    version: int
    manifest_sha256: str
    created_at: float


@dataclass(frozen=True, slots=True)
class StepRow:
    """A learner step (``steps``), its metrics decoded. ``metrics`` is the learner's own open set of figures
    (timings, counts, per-reward means: coordinator.roles.learner adds to it as it grows), kept as JSON."""

    step: int
    trained_version: int
    mean_reward: float
    metrics: dict[str, Any]
    at: float


@dataclass(frozen=True, slots=True)
class LastStep:
    """The newest step's number, mean reward and time (admin status, /metrics)."""

    step: int
    mean_reward: float
    at: float


@dataclass(frozen=True, slots=True)
class EvalRow:
    """A version's held-out evaluation (``evals``)."""

    version: int
    accuracy: float
    n: int
    at: float


@dataclass(frozen=True, slots=True)
class ResultSummary:
    """An accepted result without its payload: who, which version, its hash and reward, the step that trained it."""

    job_id: str
    client_id: str
    version: int
    content_sha256: str
    mean_reward: float
    ingested_step: int | None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refused result (``rejections``)."""

    id: int
    client_id: str
    job_id: str | None
    reason: str
    message: str
    content_sha256: str | None
    at: float


@dataclass(frozen=True, slots=True)
class AuditLine:
    """One line of the audit log (``audit``)."""

    id: int
    at: float
    client_id: str
    job_id: str | None
    version: int | None
    outcome: str
    reason: str
    content_sha256: str | None
    detail: str


@dataclass(frozen=True, slots=True)
class TrustStanding:
    """A client's trust in one backend class (``trust``)."""

    client_id: str
    backend_class: str
    consecutive_valid: int
    consecutive_invalid: int
    quarantines: int
    quarantined_until: float
    valid_total: int
    invalid_total: int


@dataclass(frozen=True, slots=True)
class ClientRow:
    """A registered client as /v1/status lists it. ``profile`` is what the client reported of itself at
    registration (name, backend, device, hardware…): an open, client-written shape, bounded by the wire."""

    client_id: str
    profile: dict[str, Any]
    registered_at: float
    last_seen: float
    accepted: int
    rejected: int
    credit: float
    banned: int
    benchmark_tokens_per_s: float | None
    leased: int
    unreturned: int
