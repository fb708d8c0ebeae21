"""Read-only views over the coordinator's database for operators (admin API), contributors (status page)
and monitoring (/metrics).

These queries only read; every write still goes through :class:`coordinator.store.store.Store`. They run on the
event-loop thread like all other store access. Each listing is bounded by a ``limit`` so that a long run
cannot make one admin call or one scrape arbitrarily expensive.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from coordinator.core.leases import JobState, lease_live
from coordinator.core.ops import (
    JOB_STATES,
    ClientState,
    active_window_s,
    bucket_width,
    client_state,
    count_by,
    job_status,
    throughput_series,
)
from coordinator.core.reporting import (
    DroppedBias,
    RewardBias,
    Sample,
    VersionGroup,
    dropped_bias,
    reward_bias,
    reward_biases,
)
from coordinator.store.db import Row
from coordinator.store.store import Store

_HIDDEN_CLIENT_COLUMNS = {"public_key", "profile"}


# ---- the shapes these views are served in (admin API, /v1/status, /v1/volunteers): JSON as built, in order ----
class Reporting(TypedDict):
    """One client's reporting figures (:func:`reporting_by_client`)."""

    leased: int
    unreturned: int
    unreturned_share: float
    results_compared: int
    reward_excess: float
    reward_z: float
    dropped_compared: int
    dropped_excess: float
    dropped_z: float


class TrustClass(TypedDict):
    """A client's trust row for one backend class, without the client id."""

    backend_class: str
    consecutive_valid: int
    consecutive_invalid: int
    quarantines: int
    quarantined_until: float
    valid_total: int
    invalid_total: int


class TrustSummary(TypedDict):
    """A client's trust summed over its classes (:func:`trust_by_client`)."""

    valid: int
    invalid: int
    quarantined: bool
    classes: list[TrustClass]


@dataclass(frozen=True, slots=True)
class ClientStateRow:
    """What the status page and /metrics count per client (:func:`client_states`)."""

    backend: str
    platform: str
    state: ClientState


class ClientSummary(TypedDict):
    total: int
    by_state: dict[str, int]
    active_by_backend: dict[str, int]
    active_by_platform: dict[str, int]


class LeaderEntry(TypedDict):
    rank: int
    client_id: str
    name: str
    team: str
    backend: str
    platform: str
    accepted: int
    credit: float
    state: str


class TeamEntry(TypedDict):
    rank: int
    team: str
    members: int  # volunteers naming the team, banned ones left out
    accepted: int
    credit: float


class JobListing(TypedDict):
    job_id: str
    state: str
    client_id: str | None
    version: int | None
    deadline: float | None
    expires_in_s: float | None
    issue_count: int
    reissued: bool


class JobsSummary(TypedDict):
    """Job counts over all jobs: by state (open, leased, expired, done), reissued, leases issued, buffered."""

    counts: dict[str, int]
    reissued: int
    leases_issued: int
    buffered_results: int


class JobsView(JobsSummary):
    """:class:`JobsSummary` and the jobs not yet done (:func:`jobs`)."""

    jobs: list[JobListing]


class AuditEntry(TypedDict):
    """An audit line as the admin API lists it; ``mean_reward`` and ``n_tokens`` are kept (always null) for the
    admin CLI's table, which has those columns."""

    at: float
    outcome: str
    client_id: str
    job_id: str | None
    version: int | None
    reason: str
    detail: str
    content_sha256: str | None
    mean_reward: None
    n_tokens: None


class VersionListing(TypedDict):
    version: int
    created_at: float
    manifest_sha256: str
    mean_reward: float | None
    heldout_accuracy: float | None
    step_s: float | None
    samples: int | None
    served: bool


class VolunteerMatch(TypedDict):
    client_id: str
    name: str
    accepted: int
    credit: float


class VolunteerResult(TypedDict):
    job_id: str
    version: int
    received_at: float
    tokens: int
    mean_reward: float


class VolunteerVersion(TypedDict):
    version: int
    results: int
    tokens: int


class VolunteerPage(TypedDict):
    """One volunteer's page (:func:`volunteer`)."""

    client_id: str
    name: str
    backend: str
    device: str
    platform: str
    software: str
    registered_at: float
    last_seen: float
    state: str
    rank: int
    accepted: int
    rejected: int
    credit: float
    results: list[VolunteerResult]
    versions: list[VolunteerVersion]
    refusals: dict[str, int]
    reporting: Reporting


def live_lease_holders(store: Store, now: float) -> set[str]:
    return {j.view.lease_client for j in store.jobs.active() if j.view.lease_client and lease_live(j.view, now)}


def clients(store: Store, now: float, lease_timeout_s: float, limit: int = 10_000, *, exclude_banned: bool = False,
            reporting: bool = False) -> list[dict[str, Any]]:
    """Every client with its profile flattened, counters, credit, state — and any extra columns another
    component keeps on the clients table (e.g. a trust score) passed through unchanged. With ``reporting`` (the
    operator's view) each also gets its reporting figures (:func:`reporting_by_client`). An open shape, left a
    dict: the table's columns pass through as the database holds them, migrations included."""
    holders = live_lease_holders(store, now)
    window = active_window_s(lease_timeout_s)
    trust = trust_by_client(store, now)
    figures = reporting_by_client(store) if reporting else {}
    where = " WHERE banned = 0" if exclude_banned else ""
    rows = store.conn.execute(f"SELECT * FROM clients{where} ORDER BY credit DESC, registered_at LIMIT ?",
                              (limit,)).fetchall()
    out = []
    for r in rows:
        row = dict(r)
        profile = json.loads(row["profile"])
        extra = {k: v for k, v in row.items() if k not in _HIDDEN_CLIENT_COLUMNS and not isinstance(v, bytes)}
        if row["client_id"] in trust:
            extra["trust"] = trust[row["client_id"]]
        if reporting:
            extra["reporting"] = figures.get(row["client_id"], _reporting(r, None, DroppedBias()))
        out.append(extra | {
            "name": profile.get("name", ""), "team": profile.get("team", ""), "backend": profile.get("backend", "?"),
            "device": profile.get("device", "?"), "platform": profile.get("platform", "?"),
            "cpu_count": profile.get("cpu_count"), "memory_gb": profile.get("memory_gb"),
            "software": profile.get("software", ""), "banned": bool(row["banned"]),
            "state": client_state(banned=bool(row["banned"]), holds_live_lease=row["client_id"] in holders,
                                  last_seen=float(row["last_seen"]), now=now, window_s=window),
        })
    return out


def client_ids(store: Store) -> list[str]:
    return [str(r[0]) for r in store.conn.execute("SELECT client_id FROM clients").fetchall()]


def client_summary(rows: list[ClientStateRow]) -> ClientSummary:
    """Counts of clients by state, and of non-idle, non-banned clients by backend and by platform."""
    live = [c for c in rows if c.state in ("working", "active")]
    return {
        "total": len(rows),
        "by_state": {s: sum(1 for c in rows if c.state == s) for s in ("working", "active", "idle", "banned")},
        "active_by_backend": count_by(c.backend for c in live),
        "active_by_platform": count_by(c.platform for c in live),
    }


def leaderboard(rows: list[dict[str, Any]], top: int = 20) -> list[LeaderEntry]:
    """The top ``top`` of :func:`clients`' rows by credit, banned ones left out."""
    ranked = sorted((c for c in rows if not c["banned"]), key=lambda c: (-c["credit"], c["registered_at"]))[:top]
    return [{"rank": k + 1, "client_id": c["client_id"], "name": c["name"] or c["client_id"][:8], "team": c["team"],
             "backend": c["backend"], "platform": c["platform"], "accepted": c["accepted"], "credit": c["credit"],
             "state": c["state"]} for k, c in enumerate(ranked)]


def jobs(store: Store, now: float, limit: int = 200) -> JobsView:
    """Jobs not yet done (open, leased, expired) with their holder and deadline; counts over all jobs."""
    active = store.jobs.active()
    listed: list[JobListing] = []
    for j in active[:limit]:
        listed.append({"job_id": j.view.job_id, "state": job_status(j.view, now), "client_id": j.view.lease_client,
                       "version": j.view.version, "deadline": j.view.lease_deadline,
                       "expires_in_s": None if j.view.lease_deadline is None else j.view.lease_deadline - now,
                       "issue_count": j.issue_count, "reissued": j.issue_count > 1})
    row = store.conn.execute("SELECT COUNT(*) AS done, "
                             "(SELECT COUNT(*) FROM jobs WHERE issue_count > 1) AS reissued, "
                             "(SELECT COALESCE(SUM(issue_count), 0) FROM jobs) AS leases "
                             f"FROM jobs WHERE state='{JobState.DONE}'").fetchone()
    counts = count_by(job_status(j.view, now) for j in active)
    return {
        "counts": {str(s): counts.get(s, 0) for s in JOB_STATES} | {"done": int(row["done"])},  # done: all, not listed
        "reissued": int(row["reissued"]),
        "leases_issued": int(row["leases"]),
        "buffered_results": len(store.results.pending()),
        "jobs": listed,
    }


def jobs_summary(view: JobsView) -> JobsSummary:
    """:func:`jobs`' counts without its listing (the admin status)."""
    return {"counts": view["counts"], "reissued": view["reissued"], "leases_issued": view["leases_issued"],
            "buffered_results": view["buffered_results"]}


def _has_table(store: Store, name: str) -> bool:
    return store.conn.has_table(name)


def audit(store: Store, *, limit: int = 100, client_id: str | None = None, job_id: str | None = None,
          outcome: str | None = None) -> list[AuditEntry]:
    """Every result's outcome, newest first: client, job, version, outcome, reason, content hash — from the
    ``audit`` table, written in the same transaction that makes each outcome durable (coordinator.store.store)."""
    return _audit_log(store, limit, client_id, job_id, outcome)


def _audit_log(store: Store, limit: int, client_id: str | None, job_id: str | None, outcome: str | None
               ) -> list[AuditEntry]:
    where, params = [], []
    for col, val in (("client_id", client_id), ("job_id", job_id), ("outcome", outcome)):
        if val is not None:
            where.append(f"{col} = ?")
            params.append(val)
    cond = (" WHERE " + " AND ".join(where)) if where else ""
    rows = store.conn.execute(f"SELECT * FROM audit{cond} ORDER BY id DESC LIMIT ?", (*params, limit)).fetchall()
    return [{"at": r["at"], "outcome": r["outcome"], "client_id": r["client_id"], "job_id": r["job_id"],
             "version": r["version"], "reason": r["reason"], "detail": r["detail"],
             "content_sha256": r["content_sha256"], "mean_reward": None, "n_tokens": None} for r in rows]


def reporting_by_client(store: Store) -> dict[str, Reporting]:
    """What the keyed sampler cannot see, per client (coordinator.core.reporting): leases granted, how many ended
    without a result from it and that share, its returned rewards against the other volunteers' at the same
    versions (results compared, mean excess per result, z), and against what the jobs it dropped scored in others'
    hands (dropped jobs seen, excess, z). One pass over the results' per-version totals, one over the drops."""
    groups = [VersionGroup(str(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4])) for r in store.conn.execute(
        "SELECT client_id, version, COUNT(*), SUM(mean_reward), SUM(mean_reward*mean_reward) FROM results "
        "GROUP BY client_id, version").fetchall()]
    bias = reward_biases(groups)
    returned: dict[str, Sample] = {}
    for g in groups:
        r = returned.get(g.client_id, Sample())
        returned[g.client_id] = Sample(r.n + g.n, r.total + g.total, r.squares + g.squares)
    dropped = {c: Sample(*x) for c, x in store.trust.dropped_rewards().items()}
    rows = store.conn.execute("SELECT client_id, leased, unreturned FROM clients").fetchall()
    return {c: _reporting(r, bias.get(c), dropped_bias(returned.get(c, Sample()), dropped.get(c, Sample())))
            for r in rows for c in (str(r["client_id"]),)}


def _reporting(row: Row, bias: RewardBias | None, dropped: DroppedBias) -> Reporting:
    leased, unreturned = int(row["leased"]), int(row["unreturned"])
    return {"leased": leased, "unreturned": unreturned, "unreturned_share": unreturned / leased if leased else 0.0,
            "results_compared": bias.results if bias else 0, "reward_excess": bias.excess if bias else 0.0,
            "reward_z": bias.z if bias else 0.0, "dropped_compared": dropped.dropped,
            "dropped_excess": dropped.excess, "dropped_z": dropped.z}


def trust_by_client(store: Store, now: float) -> dict[str, TrustSummary]:
    """Per-client trust standing where the coordinator keeps one (a ``trust`` table with a row per client and
    backend class): valid/invalid totals summed over classes, and whether any class is quarantined now."""
    if not _has_table(store, "trust"):
        return {}
    out: dict[str, TrustSummary] = {}
    for r in store.conn.execute("SELECT * FROM trust").fetchall():
        t = out.setdefault(r["client_id"], {"valid": 0, "invalid": 0, "quarantined": False, "classes": []})
        t["valid"] += int(r["valid_total"])
        t["invalid"] += int(r["invalid_total"])
        t["quarantined"] = t["quarantined"] or float(r["quarantined_until"]) > now
        t["classes"].append({"backend_class": r["backend_class"], "consecutive_valid": r["consecutive_valid"],
                             "consecutive_invalid": r["consecutive_invalid"], "quarantines": r["quarantines"],
                             "quarantined_until": r["quarantined_until"], "valid_total": r["valid_total"],
                             "invalid_total": r["invalid_total"]})
    return out


def versions(store: Store, served: Callable[[int], object], limit: int = 50) -> list[VersionListing]:
    """Published versions, newest first, with the step's mean reward, the held-out accuracy where evaluated,
    and whether the snapshot is still served (older ones are pruned)."""
    steps = {r["step"]: r for r in store.conn.execute(
        "SELECT step, mean_reward, metrics FROM steps ORDER BY step DESC LIMIT ?", (limit,)).fetchall()}
    evals = {r["version"]: r["accuracy"] for r in store.conn.execute("SELECT version, accuracy FROM evals")}
    out: list[VersionListing] = []
    for r in store.conn.execute("SELECT * FROM versions ORDER BY version DESC LIMIT ?", (limit,)).fetchall():
        v = int(r["version"])
        step = steps.get(v)
        metrics = json.loads(step["metrics"]) if step is not None else {}
        out.append({"version": v, "created_at": r["created_at"], "manifest_sha256": r["manifest_sha256"],
                    "mean_reward": step["mean_reward"] if step is not None else None,
                    "heldout_accuracy": evals.get(v), "step_s": metrics.get("step_s"),
                    "samples": metrics.get("samples"), "served": served(v) is not None})
    return out


def throughput(store: Store, start: float, now: float, bins: int = 60) -> list[dict[str, float]]:
    """Tokens/s and results/min of accepted results in ``bins`` buckets from ``start`` (or the first result,
    if earlier) to ``now``; grouped in SQL so a long run costs one indexed-free scan, no Python per row."""
    first = store.conn.execute("SELECT MIN(received_at) FROM results").fetchone()[0]
    if first is not None:
        start = min(start, float(first))
    width = bucket_width(start, now, bins)
    bucket = store.conn.floor_int("(received_at - ?) / ?")
    rows = store.conn.execute(f"SELECT {bucket} AS k, COUNT(*), SUM(n_tokens) FROM results GROUP BY 1",
                              (start, width)).fetchall()
    return throughput_series([(int(r[0]), int(r[1]), int(r[2])) for r in rows], start, now, bins)


def client_states(store: Store, now: float, lease_timeout_s: float) -> list[ClientStateRow]:
    """The few fields the status page and /metrics need per client, without decoding whole profiles."""
    holders = live_lease_holders(store, now)
    window = active_window_s(lease_timeout_s)
    db = store.conn
    rows = db.execute(f"SELECT client_id, banned, last_seen, {db.json_text('profile', 'backend')} AS backend, "
                      f"{db.json_text('profile', 'platform')} AS platform FROM clients").fetchall()
    return [ClientStateRow(backend=r["backend"] or "?", platform=r["platform"] or "?",
                           state=client_state(banned=bool(r["banned"]), holds_live_lease=r["client_id"] in holders,
                                              last_seen=float(r["last_seen"]), now=now, window_s=window))
            for r in rows]


def top_clients(store: Store, now: float, lease_timeout_s: float, top: int = 20) -> list[LeaderEntry]:
    """The credit leaderboard: the top ``top`` clients that are not banned."""
    return leaderboard(clients(store, now, lease_timeout_s, limit=top, exclude_banned=True), top)


def teams(store: Store, top: int = 20) -> list[TeamEntry]:
    """The team leaderboard: volunteers who named a team (`join --team`, their profile's ``team``), grouped by the
    exact name, banned ones left out, the best credit first. A team is a name, not an account: anyone may name any
    team, as in BOINC before team founders; what it counts is still only verified, accepted work."""
    db = store.conn
    team = db.json_text("profile", "team")
    rows = db.execute(f"SELECT {team} AS team, COUNT(*) AS members, COALESCE(SUM(accepted), 0) AS accepted, "
                      f"COALESCE(SUM(credit), 0) AS credit FROM clients WHERE banned = 0 AND "
                      f"COALESCE({team}, '') != '' GROUP BY 1 ORDER BY 4 DESC, 1 LIMIT ?", (top,)).fetchall()
    return [{"rank": k + 1, "team": str(r["team"]), "members": int(r["members"]), "accepted": int(r["accepted"]),
             "credit": float(r["credit"])} for k, r in enumerate(rows)]


def trained_staleness(store: Store) -> dict[int, int]:
    """How many trained results had each staleness (versions between generation and the step using them)."""
    rows = store.conn.execute("SELECT ingested_step - 1 - version AS s, COUNT(*) AS n FROM results "
                              "WHERE ingested_step IS NOT NULL GROUP BY 1").fetchall()
    return {int(r["s"]): int(r["n"]) for r in rows}


def rejection_counts(store: Store) -> dict[str, int]:
    return {str(r[0]): int(r[1]) for r in store.conn.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason")}


def result_totals(store: Store) -> dict[str, int]:
    r = store.conn.execute("SELECT COUNT(*) AS n, COALESCE(SUM(n_tokens), 0) AS tokens, "
                           "COUNT(stale_at) AS stale FROM results").fetchone()
    return {"accepted": int(r["n"]), "tokens": int(r["tokens"]), "too_stale": int(r["stale"])}


def reward_means(store: Store) -> dict[str, list[list[float]]]:
    """Each reward's own mean per step, for a task that combines several rewards (the learner records them in the
    step's metrics): reward name → [[step, mean], ...], for the status page's learning chart."""
    means = store.conn.json_text("metrics", "reward_means")
    rows = store.conn.execute(f"SELECT step, {means} FROM steps WHERE {means} IS NOT NULL ORDER BY step").fetchall()
    out: dict[str, list[list[float]]] = {}
    for step, raw in rows:
        for name, mean in json.loads(raw).items():
            out.setdefault(str(name), []).append([int(step), float(mean)])
    return out


# ---- the status page's per-volunteer view ---------------------------------------------------------------------
VOLUNTEER_MATCHES = 20
VOLUNTEER_RESULTS = 50


def find_volunteers(store: Store, query: str, limit: int = VOLUNTEER_MATCHES) -> list[VolunteerMatch]:
    """Volunteers whose display name contains ``query`` (any case), or whose client id starts with it: the best
    credit first. Banned clients are not listed (they are not on the leaderboard either)."""
    q = query.strip().lower()
    if not q:
        return []
    db = store.conn
    name = db.json_text("profile", "name")
    like = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    prefix = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    rows = db.execute(f"SELECT client_id, {name} AS name, accepted, credit FROM clients WHERE banned = 0 AND "
                      f"(LOWER(COALESCE({name}, '')) LIKE ? ESCAPE '\\' OR client_id LIKE ? ESCAPE '\\') "
                      f"ORDER BY credit DESC, registered_at LIMIT ?", (like, prefix, limit)).fetchall()
    return [{"client_id": r["client_id"], "name": r["name"] or r["client_id"][:8], "accepted": int(r["accepted"]),
             "credit": float(r["credit"])} for r in rows]


def volunteer(store: Store, client_id: str, now: float, lease_timeout_s: float) -> VolunteerPage | None:
    """One volunteer's page: who (name, backend, platform), standing (state, rank, accepted, refused, credit),
    their latest results, the policy versions they generated for, their refusals by reason, and their reporting
    (:func:`reporting_by_client`'s figures for them alone)."""
    db = store.conn
    row = db.execute("SELECT * FROM clients WHERE client_id = ?", (client_id,)).fetchone()
    if row is None or row["banned"]:
        return None
    profile = json.loads(row["profile"])
    rank = 1 + int(db.execute("SELECT COUNT(*) FROM clients WHERE banned = 0 AND (credit > ? OR (credit = ? AND "
                              "registered_at < ?))", (row["credit"], row["credit"], row["registered_at"])
                              ).fetchone()[0])
    results = db.execute("SELECT job_id, version, received_at, n_tokens, mean_reward FROM results WHERE client_id = ? "
                         "ORDER BY received_at DESC LIMIT ?", (client_id, VOLUNTEER_RESULTS)).fetchall()
    by_version = db.execute("SELECT version, COUNT(*) AS n, SUM(n_tokens) AS tokens FROM results WHERE client_id = ? "
                            "GROUP BY version ORDER BY version DESC LIMIT ?", (client_id, VOLUNTEER_RESULTS)).fetchall()
    refusals = db.execute("SELECT reason, COUNT(*) AS n FROM rejections WHERE client_id = ? GROUP BY reason",
                          (client_id,)).fetchall()
    holders = live_lease_holders(store, now)
    return {
        "client_id": client_id, "name": profile.get("name") or client_id[:8], "backend": profile.get("backend", "?"),
        "device": profile.get("device", "?"), "platform": profile.get("platform", "?"),
        "software": profile.get("software", ""), "registered_at": row["registered_at"], "last_seen": row["last_seen"],
        "state": client_state(banned=False, holds_live_lease=client_id in holders, last_seen=float(row["last_seen"]),
                              now=now, window_s=active_window_s(lease_timeout_s)),
        "rank": rank, "accepted": int(row["accepted"]), "rejected": int(row["rejected"]), "credit": float(row["credit"]),
        "results": [{"job_id": r["job_id"], "version": int(r["version"]), "received_at": r["received_at"],
                     "tokens": int(r["n_tokens"]), "mean_reward": r["mean_reward"]} for r in results],
        "versions": [{"version": int(r["version"]), "results": int(r["n"]), "tokens": int(r["tokens"])}
                     for r in by_version],
        "refusals": {str(r["reason"]): int(r["n"]) for r in refusals},
        "reporting": _reporting(row, reward_bias([VersionGroup(*g) for g in store.trust.reward_groups(client_id)],
                                                 client_id),
                                dropped_bias(*(Sample(*x) for x in store.trust.reward_samples(client_id)))),
    }
