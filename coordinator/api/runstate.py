"""What the API role knows of the run now, and the reads of it that every reader shares.

:class:`ApiState` is the little the API's phases share that changes while it serves: the watch
(:mod:`coordinator.api.service`) moves ``version`` and ``finished`` as the learner commits, the operator
(:mod:`coordinator.api.ops_actions`) sets ``issuing_paused``; leasing and intake read them. One object held by
reference, so that no phase reaches through another to learn the version.

:class:`RunView` is the run as it is read (``/v1/info``, the core of ``/v1/status``, the learner's report): what
the status page, the metrics and the admin API are handed instead of the whole API role.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.api.egress import SnapshotEgress
from coordinator.api.guard import Guard
from coordinator.api.replies import CoordinatorStatus
from coordinator.config import CoordinatorConfig
from coordinator.core.leases import lease_live
from coordinator.publish.snapshots import SnapshotStore
from coordinator.run import notices
from coordinator.run.names import LEARNER
from coordinator.run.runfiles import RunFiles
from coordinator.store.records import as_json
from coordinator.store.store import Store
from shared import PROTOCOL_VERSION
from shared.messages import Info, SignedNotices


@dataclass
class ApiState:
    """The API's view of the run's progress and the operator's switch (see the module's docstring)."""

    started_at: float
    version: int = 0
    finished: bool = False
    issuing_paused: bool = False


@dataclass(eq=False)
class RunView:
    """The run's public and operator reads, over the run files the API opened and its :class:`ApiState`."""

    config: CoordinatorConfig
    files: RunFiles
    state: ApiState
    guard: Guard
    egress: SnapshotEgress
    clock: Callable[[], float]
    store: Store = field(init=False)
    snapshots: SnapshotStore = field(init=False)

    def __post_init__(self) -> None:
        self.store, self.snapshots = self.files.store, self.files.snapshots

    def learner_status(self) -> dict[str, object]:
        """The learner's last report (coordinator.roles.learner), or {} before its first: served as it is, the
        role's own JSON (what the API itself reads of it: :class:`coordinator.run.records.LearnerProgress`)."""
        return self.store.role_status.get(LEARNER) or {}

    def info(self) -> Info:
        state = self.state
        return Info(protocol=PROTOCOL_VERSION, run_id=self.files.run_id, coordinator_public_key=self.files.public_key,
                    current_version=state.version, sync_mode=self.config.sync_mode, task=self.files.task.name,
                    finished=state.finished, server_time=self.clock())

    def notices(self) -> SignedNotices:
        """The operator's notices, signed with the run's key (coordinator.run.notices)."""
        return notices.signed_board(self.store, self.files.key, self.files.run_id, self.clock())

    def status(self) -> CoordinatorStatus:
        """Every key ``/v1/status`` always had (coordinator.api.status_page adds the page's views)."""
        now = self.clock()
        jobs = self.store.jobs.active()
        steps = self.store.steps.all()
        live = [j for j in jobs if lease_live(j.view, now)]
        return {
            "run_id": self.files.run_id,
            "version": self.state.version,
            "max_steps": self.config.learner.max_steps,
            "finished": self.state.finished,
            "sync_mode": self.config.sync_mode,
            "max_staleness": self.config.sync_policy.bound,
            "task": self.files.task.name,
            "uptime_s": now - self.state.started_at,
            "learner": self.learner_status(),  # its own report: trained_version runs ahead while publishing
            "roles": self.store.role_status.all(),
            "jobs": {
                "open": len(jobs) - len(live),
                "leased": len(live),
                "buffered": len(self.store.results.pending()),
                "replicas": self.store.jobs.live_replicas(now),  # second leases running (core.leases.Replica)
                "in_flight": [
                    {"job_id": j.view.job_id, "client_id": j.view.lease_client, "deadline": j.view.lease_deadline,
                     "version": j.view.version, "issue_count": j.issue_count}
                    for j in live
                ],
            },
            "totals": self.store.totals(),
            "reward_curve": [s.mean_reward for s in steps],
            "steps": [as_json(s) for s in steps[-200:]],
            "evals": [as_json(e) for e in self.store.evals.all()],
            "clients": [as_json(c) for c in self.store.clients.all()],
            "trust": {"standings": [as_json(t) for t in self.guard.standings()]},
        }
