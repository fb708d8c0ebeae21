"""Pure rules behind the operator and contributor views (admin API, status page, /metrics).

Everything here takes plain values and ``now``; the read models in :mod:`coordinator.store.readmodels` feed it
rows from the store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from coordinator.core.leases import JobState, LeaseView

ClientState = Literal["working", "active", "idle", "banned"]
CLIENT_STATES: tuple[ClientState, ...] = ("working", "active", "idle", "banned")
JobStatus = Literal["open", "leased", "expired", "done"]
JOB_STATES: tuple[JobStatus, ...] = ("open", "leased", "expired", "done")
MIN_CLIENT_PREFIX = 6


def active_window_s(lease_timeout_s: float) -> float:
    """How long after its last accepted result (or registration) a client still counts as active: long enough
    for one slow job plus a retry, never under two minutes."""
    return max(120.0, 2.0 * lease_timeout_s)


def client_state(*, banned: bool, holds_live_lease: bool, last_seen: float, now: float,
                 window_s: float) -> ClientState:
    """banned > working (holds an unexpired lease) > active (seen within the window) > idle."""
    if banned:
        return "banned"
    if holds_live_lease:
        return "working"
    if now - last_seen <= window_s:
        return "active"
    return "idle"


def job_status(view: LeaseView, now: float) -> JobStatus:
    """A leased job whose deadline has passed is 'expired': it will be reissued to the next client."""
    if view.state is JobState.DONE:
        return "done"
    if view.state is JobState.LEASED:
        return "leased" if view.lease_deadline is not None and view.lease_deadline > now else "expired"
    return "open"


class ClientLookupError(LookupError):
    """An operator named a client (or an operator key) that does not exist, or a prefix matching several."""


@dataclass(frozen=True)
class IdKind:
    """What an operator names by a hex id or its prefix, in the words of the lookup's refusals: the id's name, the
    plural, and the command that lists them."""

    noun: str
    plural: str
    lister: str


CLIENTS = IdKind("client id", "clients", "echo-swarm admin clients")
ADMIN_KEYS = IdKind("admin key id", "admin keys", "echo-swarm admin keys list")


def resolve_client(text: str, client_ids: Iterable[str], kind: IdKind = CLIENTS) -> str:
    """A full id or a unique prefix of at least MIN_CLIENT_PREFIX hex digits → the full id; ``kind`` says what
    the ids are (a client's by default, or an operator key's) in the refusal's message."""
    text = text.strip().lower()
    if len(text) < MIN_CLIENT_PREFIX:
        raise ClientLookupError(f"give at least {MIN_CLIENT_PREFIX} characters of the {kind.noun} (got {text!r}); "
                                f"`{kind.lister}` lists them")
    matches = sorted(c for c in client_ids if c.startswith(text))
    if not matches:
        raise ClientLookupError(f"no {kind.noun} starts with {text!r}; `{kind.lister}` lists them")
    if len(matches) > 1:
        raise ClientLookupError(f"{text!r} matches {len(matches)} {kind.plural} "
                                f"({', '.join(m[:12] for m in matches[:5])}…); give more characters")
    return matches[0]


def bucket_width(start: float, end: float, bins: int) -> float:
    return max(end - start, 1e-9) / max(1, bins)


def throughput_series(buckets: Iterable[tuple[int, int, int]], start: float, end: float, bins: int
                      ) -> list[dict[str, float]]:
    """Per-bucket (index, results, tokens) — index = floor((time − start) / width), as the store groups them —
    → ``bins`` equal time buckets from ``start`` to ``end`` with tokens/s and results/min. Indices outside
    0..bins−1 (clock skew, results after ``end``) are clamped into the first/last bucket."""
    bins = max(1, bins)
    width = bucket_width(start, end, bins)
    tokens = [0] * bins
    results = [0] * bins
    for k, n_results, n_tokens in buckets:
        k = min(bins - 1, max(0, k))
        tokens[k] += n_tokens
        results[k] += n_results
    return [{"t": start + (k + 1) * width, "tokens_per_s": tokens[k] / width, "results_per_min": results[k] * 60 / width}
            for k in range(bins)]


def count_by(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))
