"""SIMULATION of the coordinator's scheduling with 1 to 1,000 heterogeneous clients (no network, no model).

The decisions are the coordinator's own code — its issuer (``coordinator.api.issuer.Issuer``: paces, who waits,
due times, ``decide_lease`` for admission, reissue and version binding, the speed-aware rules of
``coordinator.core.pacing``), ``check_lease`` (is a returned result still wanted) and ``select_batch``
(oldest-first batches within the staleness bound) — driven by a discrete-event clock. What is simulated: clients whose job times are spread log-uniformly over 100× (fastest 1 s); each
client leaves at an exponentially distributed time (mean 3,000 s), mid-job if it holds one, and never comes
back; 80 % of clients declare a self-benchmark that is off by a log-normal factor (σ = 0.3), the rest are
unknown until their first result; a learner step takes 1 s per batch of B = 2 jobs. Idle clients long-poll:
they ask again when a new version is published, a lease expires or falls overdue.

    python bench/swarm_sim.py                          # the sweep: clients × S, speed-aware and plain
    python bench/swarm_sim.py --clients 50 --staleness 2   # one configuration

Reports, per (clients, S, issuance): learner busy fraction, staleness histogram of trained rollouts, results
set aside as too stale, reissued jobs; writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.api.issuer import Issuer  # noqa: E402
from coordinator.core.leases import JobState, LeaseCheck, LeaseView, check_lease, deadline_for  # noqa: E402
from coordinator.core.pacing import due_at  # noqa: E402
from coordinator.core.scheduling import Pending, SyncPolicy, admits, occupies_slot, select_batch  # noqa: E402


@dataclass
class SimClient:
    cid: str
    job_s: float
    leaves_at: float = float("inf")  # the client disappears at this time, mid-job if it holds one
    declared: float | None = None  # its self-benchmark, as it declares it at registration
    held: int = -1
    announced: int = -1  # the newest version a lease reply told it to prefetch (prefetch=true): held by its next lease
    gone: bool = False


@dataclass
class SimState:
    now: float = 0.0
    version: int = 0
    seq: int = 0
    jobs: dict[str, LeaseView] = field(default_factory=dict)
    pending: list[Pending] = field(default_factory=list)
    training: list[Pending] = field(default_factory=list)  # the batch in the current step: still queued
    learner_busy_until: float = -1.0
    busy_s: float = 0.0
    steps: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    too_stale: int = 0
    reissued: int = 0
    refused_late: int = 0


def simulate(n_clients: int, staleness: int, *, jobs_per_step: int = 2, train_s: float = 1.0,
             fastest_job_s: float = 1.0, spread: float = 100.0, lifetime_s: float = 3000.0, lease_timeout_s: float = 300.0,
             steps: int = 300, seed: int = 0, max_sim_s: float = 20_000.0, speed_aware: bool = True,
             declared: float = 0.8, declared_noise: float = 0.3) -> dict[str, Any]:
    rng = random.Random(seed)
    policy = SyncPolicy("sequential-pull" if staleness == 0 else "async-push-pull", max(1, staleness), jobs_per_step)
    clients = [SimClient(f"c{i}", fastest_job_s * spread ** rng.random(), rng.expovariate(1.0 / lifetime_s))
               for i in range(n_clients)]
    lease_s = lease_timeout_s
    issuer = Issuer(policy, lease_timeout_s=lease_s, speed_aware=speed_aware)  # the coordinator's own issuer
    for c in clients:  # a share of clients declare a self-benchmark, off by a log-normal factor
        if rng.random() < declared:
            c.declared = c.job_s * rng.lognormvariate(0.0, declared_noise)
            issuer.declare(c.cid, c.declared)
    st = SimState()
    events: list[tuple[float, int, str, Any]] = []
    tie = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, data))

    waiting: dict[str, SimClient] = {}  # idle clients long-polling for a job (registered with the issuer)

    def active_jobs() -> list[LeaseView]:
        return sorted(st.jobs.values(), key=lambda j: int(j.job_id[1:]))  # st.jobs holds jobs not yet done

    def queue_full() -> bool:
        views = [issuer.with_due(j) for j in active_jobs()] if speed_aware else active_jobs()
        queued = sum(1 for j in views if occupies_slot(j, st.now, st.version, policy))
        return not admits(queued + len(st.pending) + len(st.training), policy)

    def try_lease(c: SimClient) -> bool:
        # as in the coordinator, results count as queued until the step that trains them has committed; as in
        # the join client, a version announced by an earlier lease reply has been prefetched by now
        c.held = max(c.held, c.announced)
        decision = issuer.decide(c.cid, active_jobs(), len(st.pending) + len(st.training), st.now, st.version,
                                 c.held)
        if decision is None:
            if c.cid not in waiting:  # long-poll: woken by the next version, a lease expiring or falling overdue
                issuer.begin_wait(c.cid)
                waiting[c.cid] = c
            return False
        if waiting.pop(c.cid, None) is not None:
            issuer.end_wait(c.cid)
        if decision.job_id is None:
            job_id = f"j{st.seq}"
            st.seq += 1
        else:
            job_id = decision.job_id
            st.reissued += 1
        lease_id = f"{job_id}:{c.cid}:{st.now}"
        deadline = deadline_for(st.now, lease_timeout_s)
        st.jobs[job_id] = LeaseView(job_id, JobState.LEASED, decision.version, st.jobs[job_id].created_at
                                    if job_id in st.jobs else st.now, lease_id, c.cid, deadline)
        push(deadline, "expiry", job_id)
        due = due_at(st.now, issuer.pace.get(c.cid), issuer.version_interval)
        if speed_aware and due is not None:
            push(due, "overdue", job_id)
        c.held = decision.version
        if c.leaves_at < st.now + c.job_s:
            c.gone = True  # leaves mid-job and never returns: its lease expires and the job is reissued
            return True
        push(st.now + c.job_s, "done", (c, job_id, lease_id, decision.version))
        return True

    def learner_try() -> None:
        if st.learner_busy_until > st.now or st.steps >= steps:
            return
        batch, stale = select_batch(st.pending, st.version, policy)
        st.too_stale += len(stale)
        if stale:
            ids = {p.job_id for p in stale}
            st.pending = [p for p in st.pending if p.job_id not in ids]
        if not batch:
            return
        ids = {p.job_id for p in batch}
        st.pending = [p for p in st.pending if p.job_id not in ids]
        st.training = batch
        for p in batch:
            st.staleness[st.version - p.version] += 1
        st.learner_busy_until = st.now + train_s
        st.busy_s += train_s
        push(st.learner_busy_until, "step", None)

    def wake() -> None:
        # every waiter asks again, fastest first as the coordinator would grant them; each stays registered
        # as waiting until it holds a job, so slower ones see it as a faster competitor
        order = list(waiting.values())
        if speed_aware:
            order.sort(key=lambda w: (issuer.pace.get(w.cid) is None, issuer.pace.get(w.cid) or 0.0))
        else:
            rng.shuffle(order)  # plain issuance: whoever asks first
        for c in order:  # the reply that wakes a client next in line says prefetch: it pulls the new version
            if issuer.next_in_line(c.cid, st.version):
                c.announced = st.version
        for c in order:
            if queue_full():
                break  # every slower waiter would be refused too
            try_lease(c)

    for c in clients:
        push(0.0, "poll", c)
    while events and st.steps < steps and st.now < max_sim_s:
        st.now, _, kind, data = heapq.heappop(events)
        if kind == "poll":
            try_lease(data)
        elif kind == "expiry":  # a lease ran out (its client vanished): the job can be reissued now
            job = st.jobs.get(data)
            if job is not None and job.state is JobState.LEASED and job.lease_deadline is not None and job.lease_deadline <= st.now:
                wake()
        elif kind == "overdue":  # the coordinator's long-poll re-checks every second; here: at the moment
            wake()
        elif kind == "done":
            c, job_id, lease_id, version = data
            job = st.jobs.get(job_id)
            if job is not None and check_lease(job, c.cid, lease_id, st.now) is LeaseCheck.OK:
                issuer.observe(c.cid, job, st.now)
                del st.jobs[job_id]  # done: never leased again
                st.pending.append(Pending(job_id, version, st.now))
                learner_try()
            else:
                st.refused_late += 1
            try_lease(c)
        elif kind == "step":
            st.version += 1
            st.steps += 1
            issuer.new_version(st.now)
            st.training = []
            learner_try()
            wake()  # push: a new version wakes every long-polling client
    trained = sum(st.staleness.values())
    capacity = sum(1.0 / c.job_s for c in clients)  # jobs/s the whole swarm could return at the start
    return {
        "clients": n_clients, "staleness_bound": staleness, "speed_aware": speed_aware, "steps": st.steps,
        "sim_s": st.now, "departed": sum(1 for c in clients if c.leaves_at <= st.now),
        "learner_busy_fraction": st.busy_s / st.now if st.now else 0.0,
        "capacity_jobs_per_s": capacity, "consumption_jobs_per_s": jobs_per_step / train_s,
        "staleness_histogram": {str(k): v for k, v in sorted(st.staleness.items())},
        "staleness_max": max(st.staleness) if st.staleness else 0,
        "trained": trained, "too_stale": st.too_stale, "reissued": st.reissued, "refused_late": st.refused_late,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000])
    ap.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2, 4], help="S; 0 = sequential pull")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fastest-job-s", type=float, default=1.0, help="job time of the fastest client, seconds")
    ap.add_argument("--no-plain", action="store_true", help="skip the comparison without speed-aware issuance")
    ap.add_argument("--out", type=Path, default=Path("bench-out/swarm_sim"))
    args = ap.parse_args()
    modes = [True] if args.no_plain else [True, False]
    rows = [simulate(n, s, steps=args.steps, speed_aware=a, fastest_job_s=args.fastest_job_s)
            for a in modes for s in args.staleness for n in args.clients]
    print("SIMULATION — coordinator scheduling code, simulated clients and learner")
    print("| issuance | clients | S | capacity / consumption | learner busy | staleness histogram | too stale | reissued |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'speed-aware' if r['speed_aware'] else 'plain'} | {r['clients']} | {r['staleness_bound']} | "
              f"{r['capacity_jobs_per_s'] / r['consumption_jobs_per_s']:.2f} | {r['learner_busy_fraction']:.3f} | "
              f"{r['staleness_histogram']} | {r['too_stale']} | {r['reissued']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swarm_sim.json").write_text(json.dumps({"simulation": True, "rows": rows}, indent=2))
    plot(rows, args.out / "swarm_sim.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(sorted({r["staleness_bound"] for r in rows})):
        for aware, style in ((True, "o-"), (False, "x:")):
            pts = [(r["clients"], r["learner_busy_fraction"]) for r in rows
                   if r["staleness_bound"] == s and r["speed_aware"] is aware]
            if pts:
                name = "sequential pull" if s == 0 else f"async, S = {s}"
                ax.plot(*zip(*pts, strict=True), style, color=colours[i % len(colours)],
                        label=name + ("" if aware else " (plain issuance)"))
    ax.set_xscale("log")
    ax.set_xlabel("simulated clients (job times spread 100×, clients leave mid-job)")
    ax.set_ylabel("learner busy fraction")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("SIMULATION: coordinator scheduling vs swarm size")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
