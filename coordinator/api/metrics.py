"""Prometheus ``GET /metrics``.

Most figures are read from the database at scrape time by a custom collector, so the counters are exact,
survive a coordinator restart, and need no hooks in the request path: jobs leased (the sum of every job's
issue count), results accepted, refusals by reason code, trained staleness, learner step time. Only what
the database does not record — bytes of snapshots served and HTTP requests by route and status — is counted
in-process (reset on restart, which Prometheus' ``rate()`` handles).

Each app gets its own :class:`CollectorRegistry`, so several coordinators in one process (tests) never clash.
A scrape is built at most once per ``server.public_cache_s`` and rate-limited per address like ``/v1/status``
(coordinator.api.public_reads); the connection guard's counters (coordinator.api.netguard) are exported too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.api.intake import Intake
from coordinator.api.netguard import ConnectionGuard
from coordinator.api.public_reads import PUBLIC_READS, ReplyCache
from coordinator.api.runstate import RunView
from coordinator.core.leases import lease_live
from coordinator.core.ops import CLIENT_STATES
from coordinator.store import readmodels
from shared.endpoints import BLOB, SNAPSHOT

logger = logging.getLogger(__name__)

PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StepTimes:
    """Learner step durations as a cumulative histogram, read incrementally (steps are append-only)."""

    def __init__(self) -> None:
        self.last_step = 0
        self.buckets = [0] * len(STEP_BUCKETS)
        self.count = 0
        self.total = 0.0

    def update(self, view: RunView) -> None:
        for step, s in view.store.steps.durations_after(self.last_step):
            self.count += 1
            self.total += s
            for k, edge in enumerate(STEP_BUCKETS):
                if s <= edge:
                    self.buckets[k] += 1
            self.last_step = step

    def family(self) -> HistogramMetricFamily:
        cum = [(str(edge), float(n)) for edge, n in zip(STEP_BUCKETS, self.buckets, strict=True)]
        return HistogramMetricFamily("echo_swarm_learner_step_seconds",
                                     "Wall time of one learner step: load the batch, train, save and publish.",
                                     buckets=cum + [("+Inf", float(self.count))], sum_value=self.total)


class StoreCollector(Collector):
    """Figures derived from the coordinator's database and in-memory state at scrape time: the run's (``view``)
    and this API process's result intake's."""

    def __init__(self, view: RunView, intake: Intake) -> None:
        self.view = view
        self.intake = intake
        self.step_times = _StepTimes()

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs_and_results()
        yield from self._run()
        yield from self._intake()

    def _jobs_and_results(self) -> Iterator[Metric]:
        view = self.view
        now = view.clock()
        jobs = readmodels.jobs(view.store, now, limit=0)
        yield CounterMetricFamily("echo_swarm_jobs_leased", "Leases issued (first issues and reissues).",
                                  value=jobs["leases_issued"])
        yield CounterMetricFamily("echo_swarm_jobs_reissued", "Jobs leased more than once (a lease expired or was "
                                  "released).", value=jobs["reissued"])
        totals = readmodels.result_totals(view.store)
        yield CounterMetricFamily("echo_swarm_results_accepted", "Results verified and accepted.",
                                  value=totals["accepted"])
        yield CounterMetricFamily("echo_swarm_tokens_accepted", "Generated tokens in accepted results.",
                                  value=totals["tokens"])
        yield CounterMetricFamily("echo_swarm_results_too_stale", "Accepted results set aside as older than the "
                                  "staleness bound (credited, never trained on).", value=totals["too_stale"])
        rejected = CounterMetricFamily("echo_swarm_results_rejected", "Results refused, by reason code "
                                       "(shared.errors.Reason).", labels=["reason"])
        for reason, n in sorted(readmodels.rejection_counts(view.store).items()):
            rejected.add_metric([reason], n)
        yield rejected
        state = GaugeMetricFamily("echo_swarm_jobs", "Jobs not yet done, by state (expired: lease deadline passed, "
                                  "waiting to be reissued).", labels=["state"])
        for s in ("open", "leased", "expired"):
            state.add_metric([s], jobs["counts"][s])
        yield state
        yield GaugeMetricFamily("echo_swarm_results_buffered", "Accepted results waiting for a learner step.",
                                value=jobs["buffered_results"])
        by_state = readmodels.client_summary(readmodels.client_states(view.store, now,
                                                                      view.config.jobs.lease_timeout_s))["by_state"]
        clients = GaugeMetricFamily("echo_swarm_clients", "Registered clients by state (working: holds a live "
                                    "lease; active: seen recently; idle; banned).", labels=["state"])
        for s in CLIENT_STATES:
            clients.add_metric([s], by_state.get(s, 0))
        yield clients

    def _run(self) -> Iterator[Metric]:
        view = self.view
        now = view.clock()
        stale = readmodels.trained_staleness(view.store)
        bound = view.config.sync_policy.bound
        edges = list(range(0, max(bound, max(stale, default=0)) + 1))
        cum, acc = [], 0
        for e in edges:
            acc += stale.get(e, 0)
            cum.append((str(e), float(acc)))
        total = sum(stale.values())
        yield HistogramMetricFamily("echo_swarm_rollout_staleness_versions", "Staleness of trained rollouts: "
                                    "policy versions between generation and the step that used them.",
                                    buckets=cum + [("+Inf", float(total))],
                                    sum_value=float(sum(k * n for k, n in stale.items())))
        self.step_times.update(view)
        yield self.step_times.family()
        yield GaugeMetricFamily("echo_swarm_policy_version", "Current published policy version.",
                                value=view.state.version)
        yield GaugeMetricFamily("echo_swarm_issuing_paused", "1 while the operator has paused issuing jobs.",
                                value=float(view.state.issuing_paused))
        yield GaugeMetricFamily("echo_swarm_run_finished", "1 once the run reached learner.max_steps.",
                                value=float(view.state.finished))
        live = sum(1 for j in view.store.jobs.active() if lease_live(j.view, now))
        yield GaugeMetricFamily("echo_swarm_live_leases", "Leases currently held by clients.", value=live)
        evals = view.store.evals.all()
        if evals:
            yield GaugeMetricFamily("echo_swarm_heldout_accuracy", "Held-out greedy accuracy at the last evaluation.",
                                    value=evals[-1].accuracy)
        last = view.store.steps.last()
        if last is not None:
            yield GaugeMetricFamily("echo_swarm_mean_reward", "Mean rollout reward of the last learner step.",
                                    value=last.mean_reward)

    def _intake(self) -> Iterator[Metric]:
        intake = self.intake
        yield CounterMetricFamily("echo_swarm_result_recomputes", "Recomputes this API process asked of the "
                                  "verifiers for results (since it started): one per result, however often "
                                  "it is resent.", value=intake.recomputes)
        yield CounterMetricFamily("echo_swarm_result_resends_joined", "Resends of a result that joined its "
                                  "verification in flight (same client, job and body) instead of starting another "
                                  "(since this process started).", value=intake.verdicts.joined)
        tally = intake.margins  # this API process's results
        if tally.buckets:
            margins = HistogramMetricFamily(
                "echo_swarm_choice_margin_ratio", "Worst keyed-sampler margin of each result that passed the choice "
                "check, as a share of its backend class's tolerance (since this process started): a class drifting "
                "towards 1 is about to refuse honest work.", labels=["backend_class"])
            for cls in sorted(tally.buckets):
                margins.add_metric([cls], tally.cumulative(cls), sum_value=tally.sums[cls])
            yield margins


class ServingCollector(Collector):
    """The listener's own figures: open connections, refusals, evictions, timeouts, reply-cache builds."""

    def __init__(self, guard: ConnectionGuard | None, cache: ReplyCache | None) -> None:
        self.guard = guard
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        if self.guard is not None:
            g, st = self.guard, self.guard.stats
            yield GaugeMetricFamily("echo_swarm_connections_open", "Client connections open now.", value=len(g.open))
            yield GaugeMetricFamily("echo_swarm_connections_limit", "Cap on open connections (server.max_connections "
                                    "or derived from the file limit).", value=g.caps.total)
            yield GaugeMetricFamily("echo_swarm_connections_peak", "Most connections open at once since start.",
                                    value=st.peak)
            yield CounterMetricFamily("echo_swarm_connections_accepted", "Connections admitted.", value=st.accepted)
            refused = CounterMetricFamily("echo_swarm_connections_refused", "Connections refused at accept: their "
                                          "address (per_address) or the server (total) at its cap with nothing "
                                          "idle to evict.", labels=["cap"])
            for cap, n in st.refused.items():
                refused.add_metric([cap], n)
            yield refused
            yield CounterMetricFamily("echo_swarm_connections_evicted", "Idle or stalled connections closed to make "
                                      "room for a newcomer.", value=st.evicted)
            expired = CounterMetricFamily("echo_swarm_connections_timed_out", "Connections closed for exceeding a "
                                          "bound: header, body, idle (keep-alive) or send.", labels=["phase"])
            for phase, n in st.expired.items():
                expired.add_metric([phase], n)
            yield expired
            yield CounterMetricFamily("echo_swarm_http_received_bytes", "Bytes read from client connections.",
                                      value=st.bytes_received)
        if self.cache is not None:
            builds = CounterMetricFamily("echo_swarm_public_reply_builds", "Times a /v1/status or /metrics reply was "
                                         "built (each is shared by every reader for server.public_cache_s).",
                                         labels=["reply"])
            for key, n in sorted(self.cache.builds.items()):
                builds.add_metric([key], n)
            yield builds


class Metrics:
    """The registry of one app plus the in-process counters that the request path feeds. The run's figures join
    once the API role started (:meth:`follow`); until then a scrape has only the listener's."""

    def __init__(self, guard: ConnectionGuard | None = None, cache: ReplyCache | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServingCollector(guard, cache))
        self.view: RunView | None = None
        self.snapshot_bytes = Counter("echo_swarm_snapshot_bytes_served", "Bytes of snapshot files and signed "
                                      "manifests sent to clients (since this process started).", ["kind"],
                                      registry=self.registry)
        self.requests = Counter("echo_swarm_http_requests", "HTTP requests answered, by route and status "
                                "(since this process started).", ["route", "status"], registry=self.registry)

    def follow(self, view: RunView, intake: Intake) -> None:
        """Export the run's figures and this process's intake's from now on."""
        self.view = view
        self.registry.register(StoreCollector(view, intake))


METRICS = web.AppKey("metrics", Metrics)


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    metrics = request.app[METRICS]
    info = request.match_info
    route = info.route.resource.canonical if info.route.resource is not None else "unmatched"
    metrics.requests.labels(route, str(response.status)).inc()
    if response.status in (200, 206) and response.content_length:
        if route == BLOB.path:
            metrics.snapshot_bytes.labels("blob").inc(response.content_length)
        elif route == SNAPSHOT.path:
            metrics.snapshot_bytes.labels("manifest").inc(response.content_length)


async def metrics_handler(request: web.Request) -> web.Response:
    public = request.app[PUBLIC_READS]
    public.check(request)
    metrics = request.app[METRICS]
    view = metrics.view
    version, changes = (0, 0) if view is None else (view.state.version, view.store.changes)
    data = public.cache.get("metrics", version, changes, lambda: generate_latest(metrics.registry))
    return web.Response(body=data, headers={"Content-Type": PROM_CONTENT_TYPE})


def install(app: web.Application, guard: ConnectionGuard | None = None) -> None:
    """Add ``GET /metrics`` and the response hook that counts requests and snapshot bytes."""
    app[METRICS] = Metrics(guard, app[PUBLIC_READS].cache)
    app.on_response_prepare.append(_on_prepare)
    app.router.add_get("/metrics", metrics_handler)
