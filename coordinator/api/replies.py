"""The shapes of the API's JSON replies that are built as dicts and served as they are: ``/v1/status`` (both
views) and the operator admin API (``echo-swarm admin … --json`` prints them). TypedDicts, not dataclasses: each
is encoded once, right where it is built, and its keys and their order are the reply's (a dataclass would add a
conversion and nothing a reader could use). The read models' own sections are coordinator.store.readmodels';
the store's rows are coordinator.store.records'.
"""

from __future__ import annotations

from typing import TypedDict

from coordinator.api.egress import EgressView
from coordinator.store.readmodels import (
    AuditEntry,
    ClientSummary,
    JobsSummary,
    JobsView,
    LeaderEntry,
    TeamEntry,
    VersionListing,
)


# ---- /v1/status -----------------------------------------------------------------------------------------------
class InFlightJob(TypedDict):
    job_id: str
    client_id: str | None
    deadline: float | None
    version: int | None
    issue_count: int


class StatusJobs(TypedDict):
    open: int
    leased: int
    buffered: int
    replicas: int  # replica leases running (coordinator.core.leases.Replica)
    in_flight: list[InFlightJob]


class TrustView(TypedDict):
    standings: list[dict[str, object]]  # coordinator.store.records.TrustStanding, encoded (records.as_json)


class RunHead(TypedDict):
    """What every status reply opens with: the run, its version and its settings (RunView.status)."""

    run_id: str
    version: int
    max_steps: int
    finished: bool
    sync_mode: str
    max_staleness: int | None
    task: str
    uptime_s: float


class CoordinatorStatus(RunHead):
    """``RunView.status`` (coordinator.api.runstate): every key /v1/status always had. ``learner`` and ``roles``
    are the roles' own reports as they wrote them (coordinator.store.role_status); ``steps``, ``evals`` and
    ``clients`` the store's rows (coordinator.store.records), encoded."""

    learner: dict[str, object]
    roles: dict[str, dict[str, object]]
    jobs: StatusJobs
    totals: dict[str, int]
    reward_curve: list[float]
    steps: list[dict[str, object]]
    evals: list[dict[str, object]]
    clients: list[dict[str, object]]
    trust: TrustView


class PageViews(TypedDict):
    """The views the status page adds to either status (coordinator.api.status_page)."""

    server_time: float
    issuing_paused: bool
    throughput: list[dict[str, float]]
    clients_summary: ClientSummary
    leaderboard: list[LeaderEntry]
    teams: list[TeamEntry]  # the team leaderboard (readmodels.teams)
    recent_versions: list[VersionListing]
    snapshot_egress: EgressView


class PublicStatus(CoordinatorStatus, PageViews):
    """``GET /v1/status``: :class:`CoordinatorStatus` and the page's views."""


class PageJobs(TypedDict):
    open: int
    leased: int
    buffered: int


class PageEval(TypedDict):
    version: int
    accuracy: float
    n: int


class PageBody(RunHead):
    jobs: PageJobs
    totals: dict[str, int]
    reward_curve: list[float]
    reward_means: dict[str, list[list[float]]]
    evals: list[PageEval]


class PageStatus(PageBody, PageViews):
    """``GET /v1/status?view=page``: what the page draws."""


# ---- the admin API --------------------------------------------------------------------------------------------
class AdminLastStep(TypedDict):
    step: int
    mean_reward: float
    at: float


class AdminStatus(RunHead):
    issuing_paused: bool
    registration: str
    run_dir: str
    learner: dict[str, object]  # the learner's own report, as it wrote it
    jobs: JobsSummary
    clients: ClientSummary
    totals: dict[str, int]
    rejections_by_reason: dict[str, int]
    heldout_accuracy: float | None
    last_step: AdminLastStep | None


class AdminClients(TypedDict):
    clients: list[dict[str, object]]  # readmodels.clients: the clients table's columns pass through (open)


class AdminVersions(TypedDict):
    current: int
    versions: list[VersionListing]


class AdminJobs(JobsView):
    lease_timeout_s: float


class AdminAuditReply(TypedDict):
    entries: list[AuditEntry]


class BanReply(TypedDict):
    client_id: str
    banned: bool
    released_jobs: list[str]


class IssuingReply(TypedDict):
    paused: bool
    changed: bool


class InviteReply(TypedDict):
    token: str
    sha256: str
    mode: str


class NoticeReply(TypedDict):
    notice_id: int
    published: bool  # False: withdrawn
    notices: int  # notices in force now


class NoticesReply(TypedDict):
    notices: list[dict[str, object]]  # shared.messages.Notice's fields, oldest first


class RegistrationReply(TypedDict):
    mode: str
    changed: bool
    invites: int


class CheckpointReply(TypedDict):
    version: int
    path: str
    bytes: int
    files: int


class KeysReply(TypedDict):
    admin_keys: list[dict[str, str | bool]]
    coordinator_public_key: str
    coordinator_key_id: str
    keys_file: str


class KeyAdded(TypedDict):
    key_id: str
    added: bool


class KeyRemoved(TypedDict):
    key_id: str
    removed: bool
    remaining: int
