"""SIMULATION of the coordinator's scheduling with 1 to 10,000 heterogeneous clients (no network, no model).

The decisions are the coordinator's own code — its issuer (``coordinator.api.issuer.Issuer``: paces, who waits,
due times, ``decide_lease`` for admission, reissue and version binding, the speed-aware rules of
``coordinator.core.pacing``), ``check_lease`` (is a returned result still wanted) and ``select_batch``
(oldest-first batches within the staleness bound) — driven by a discrete-event clock. What is simulated, by
default (``--mix spread``): clients whose job times are spread log-uniformly over 100× (fastest 1 s); each
client leaves at an exponentially distributed time (mean 3,000 s), mid-job if it holds one, and never comes
back. ``--mix realistic``: GPU, Apple-silicon, laptop-CPU and old-CPU volunteers (:data:`KINDS`, job times
1–1,000× the fastest GPU's) with churn (each client that leaves is replaced by a newcomer), and with
``--vanish`` a share that takes one job and is never heard of again. 80 % of clients declare a self-benchmark
that is off by a log-normal factor (σ = 0.3), the rest are unknown until their first result; a learner step
takes 1 s per batch of B = 2 jobs. Idle clients long-poll: they ask again when a new version is published, a
lease expires or falls overdue, or (as the coordinator wakes its long polls) when a job went to a client of unmeasured
pace while a measured one waits: that one may be given a replica of it (issue 37,
``coordinator.core.scheduling.choose_replica``): the first of the two results is trained, the other credited.

    python bench/swarm_sim.py                          # the sweep: clients × S, speed-aware and plain
    python bench/swarm_sim.py --clients 50 --staleness 2   # one configuration
    python bench/swarm_sim.py --mix realistic --vanish 0.1 --clients 10 20 100 1000 10000 --staleness 2 16 64 \
        --no-plain --lease-timeout-s 3600 --max-sim-s 7200 --fastest-job-s 2
    python bench/swarm_sim.py --decision-cost 100 1000 10000 --staleness 2 16 64   # CPU per lease decision

Reports, per (clients, S, issuance): learner busy fraction, staleness of trained rollouts, results set aside as
too stale (and their share of those returned), the share of clients that ever got work (of all, and of those
that stayed an hour), reissued jobs, the issuer's CPU per lease decision and the run's wall time; writes JSON
and a PNG plot.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.api.issuer import Issuer  # noqa: E402
from coordinator.config.jobs import JobsConfig  # noqa: E402
from coordinator.core.leases import (  # noqa: E402
    JobState,
    LeaseCheck,
    LeaseView,
    Replica,
    check_lease,
    deadline_for,
    held_by,
    holds_lease,
)
from coordinator.core.pacing import due_at  # noqa: E402
from coordinator.core.scheduling import Pending, SyncPolicy, admits, occupies_slot, select_batch  # noqa: E402

#: jobs.max_held_lag as the coordinator runs it unless told otherwise (--max-held-lag): its config's default
HELD_LAG: int = JobsConfig.model_fields["max_held_lag"].default

#: The realistic mix (``--mix realistic``): (kind, share of volunteers, job time relative to the fastest GPU's,
#: lowest and highest; log-uniform in between), so job times spread 1–1,000×.
KINDS = (("gpu", 0.15, 1.0, 3.0), ("apple", 0.25, 3.0, 10.0), ("laptop-cpu", 0.35, 10.0, 100.0),
         ("old-cpu", 0.25, 100.0, 1000.0))


@dataclass
class SimClient:
    cid: str
    job_s: float
    leaves_at: float = float("inf")  # the client disappears at this time, mid-job if it holds one
    kind: str = ""
    joined_at: float = 0.0
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
    replicas: int = 0  # second leases given (coordinator.core.scheduling.choose_replica)
    duplicates: int = 0  # results of a job whose other holder's result was accepted first: credited, not trained
    done: dict[str, tuple[LeaseView, str]] = field(default_factory=dict)  # closed jobs: last view, accepted lease


def simulate(n_clients: int, staleness: int, *, jobs_per_step: int = 2, train_s: float = 1.0,
             fastest_job_s: float = 1.0, spread: float = 100.0, lifetime_s: float = 3000.0, lease_timeout_s: float = 300.0,
             steps: int = 300, seed: int = 0, max_sim_s: float = 20_000.0, speed_aware: bool = True,
             declared: float = 0.8, declared_noise: float = 0.3, mix: str = "spread", vanish: float = 0.0,
             stay_s: float = 3600.0, sybils: int = 0, sybil_every_s: float = 0.0,
             max_held_lag: int = HELD_LAG) -> dict[str, Any]:
    """One run. ``mix``: "spread" (job times log-uniform over ``spread``×, clients leave for good) or "realistic"
    (:data:`KINDS`, and churn: each client that leaves is replaced by a newcomer of a random kind, so the swarm
    keeps its size). ``vanish``: the share of clients that take one job and are never heard of again.
    ``sybils``: that many fresh identities at any time that each declare 10⁷ tokens/s (a pace of 10⁻⁷ s), take
    one job and vanish, each replaced by the next ``sybil_every_s`` after it holds its lease (issue 37's
    claimed-speed attack; 2 s is the default registration budget of one address, 30 a minute)."""
    import time

    rng = random.Random(seed)
    policy = SyncPolicy("sequential-pull" if staleness == 0 else "async-push-pull", max(1, staleness), jobs_per_step,
                        max_held_lag)
    issuer = Issuer(policy, lease_timeout_s=lease_timeout_s, speed_aware=speed_aware)  # the coordinator's own

    def new_client(i: int, now: float) -> SimClient:
        if mix == "realistic":
            kind, _, low, high = rng.choices(KINDS, weights=[k[1] for k in KINDS])[0]
            job_s = fastest_job_s * low * (high / low) ** rng.random()
        else:
            kind, job_s = "", fastest_job_s * spread ** rng.random()
        stays = 0.0 if rng.random() < vanish else rng.expovariate(1.0 / lifetime_s)
        c = SimClient(f"c{i}", job_s, now + stays, kind, now)
        if rng.random() < declared:  # a share of clients declare a self-benchmark, off by a log-normal factor
            c.declared = c.job_s * rng.lognormvariate(0.0, declared_noise)
            issuer.declare(c.cid, c.declared)
        return c

    def new_sybil(now: float) -> SimClient:
        c = SimClient(f"s{len(sybil_ids)}", fastest_job_s, now, "sybil", now)  # leaves at once: never returns
        sybil_ids.append(c.cid)
        c.declared = 1e-7
        issuer.declare(c.cid, c.declared)
        return c

    sybil_ids: list[str] = []
    clients = [new_client(i, 0.0) for i in range(n_clients)]
    got_work: set[str] = set()
    decisions, decide_cpu, returned = 0, 0.0, 0
    st = SimState()
    events: list[tuple[float, int, str, Any]] = []
    tie = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, data))

    waiting: dict[str, SimClient] = {}  # idle clients long-polling for a job (registered with the issuer)

    active: list[list[LeaseView]] = []  # st.jobs in creation order, until st.jobs changes

    def active_jobs() -> list[LeaseView]:
        if not active:
            active.append(sorted(st.jobs.values(), key=lambda j: int(j.job_id[1:])))  # jobs not yet done
        return active[0]

    def queue_full() -> bool:
        """No new job can be admitted, and (when speed-aware) no live unproven lease can be replicated: a waiter
        would be refused."""
        views = [issuer.with_due(j) for j in active_jobs()] if speed_aware else active_jobs()
        queued = sum(1 for j in views if occupies_slot(j, st.now, st.version, policy))
        if speed_aware and any(j.unproven and j.replica is None and occupies_slot(j, st.now, st.version, policy)
                               for j in views):
            return False
        return not admits(queued + len(st.pending) + len(st.training), policy)

    def try_lease(c: SimClient) -> bool:
        # as in the coordinator, results count as queued until the step that trains them has committed; as in
        # the join client, a version announced by an earlier lease reply has been prefetched by now
        nonlocal decisions, decide_cpu
        if c.gone:
            return False
        c.held = max(c.held, c.announced)
        jobs = active_jobs()
        t0 = time.process_time()
        decision = issuer.decide(c.cid, jobs, len(st.pending) + len(st.training), st.now, st.version, c.held)
        decide_cpu += time.process_time() - t0
        decisions += 1
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
        elif decision.replica:
            job_id = decision.job_id
            st.replicas += 1
        else:
            job_id = decision.job_id
            st.reissued += 1
        lease_id = f"{job_id}:{c.cid}:{st.now}"
        deadline = deadline_for(st.now, lease_timeout_s)
        active.clear()
        if decision.replica:  # a second lease on a live job, as the store records it (Jobs.lease_replica)
            st.jobs[job_id] = replace(st.jobs[job_id], replica=Replica(lease_id, c.cid, deadline, decision.version))
        else:
            st.jobs[job_id] = LeaseView(job_id, JobState.LEASED, decision.version, st.jobs[job_id].created_at
                                        if job_id in st.jobs else st.now, lease_id, c.cid, deadline)
            if speed_aware and not issuer.proven(c.cid) and issuer.proven_waiting():
                push(st.now, "recheck", None)  # the coordinator wakes its long polls (api.leasing)
        push(deadline, "expiry", job_id)
        due = due_at(st.now, issuer.pace.get(c.cid), issuer.version_interval)
        if speed_aware and due is not None:
            push(due, "overdue", job_id)
        c.held = decision.version
        got_work.add(c.cid)
        if c.kind == "sybil":  # the next fresh identity asks at once
            push(st.now + sybil_every_s, "poll", new_sybil(st.now + sybil_every_s))
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
        if speed_aware:
            # only the waiters a re-check could give anything (Issuer.waiters.candidates, coordinator.api.waiting:
            # the head of rule 1's order, by core.pacing.rank — a declared pace no faster than the fastest measured
            # one — equals in the order they began waiting), as the coordinator's long polls re-check
            # (api.leasing); every other one would be refused. (Until issue 37's replicas this sorted by raw pace,
            # which served a fresh identity's claimed 10^7 tokens/s ahead of every honest equal; until issue 32 it
            # asked every waiter: docs/benchmarks.md.)
            order = [waiting[cid] for cid in issuer.waiters.candidates()]
        else:
            order = list(waiting.values())
            rng.shuffle(order)  # plain issuance: whoever asks first
        for c in order:  # the reply that wakes a client next in line says prefetch: it pulls the new version
            if issuer.next_in_line(c.cid, st.version):
                c.announced = st.version
        full = queue_full()  # only a lease granted changes it within one wake (same time, same version)
        for c in order:
            if full:
                break  # every slower waiter would be refused too
            if try_lease(c):
                full = queue_full()

    for c in clients:
        push(0.0, "poll", c)
        push(c.leaves_at, "leave", c)
    for _ in range(sybils):
        push(0.0, "poll", new_sybil(0.0))
    while events and st.steps < steps and st.now < max_sim_s:
        st.now, _, kind, data = heapq.heappop(events)
        if kind == "poll":
            try_lease(data)
        elif kind == "leave":  # it stops asking; with churn a newcomer takes its place
            c = data
            c.gone = True
            if waiting.pop(c.cid, None) is not None:
                issuer.end_wait(c.cid)
            if mix == "realistic":
                fresh = new_client(len(clients), st.now)
                clients.append(fresh)
                push(st.now, "poll", fresh)
                push(fresh.leaves_at, "leave", fresh)
        elif kind == "expiry":  # a lease ran out (its client vanished): the job can be reissued now
            job = st.jobs.get(data)
            if job is not None and job.state is JobState.LEASED and job.lease_deadline is not None and job.lease_deadline <= st.now:
                wake()
        elif kind in ("overdue", "recheck"):  # the coordinator's long-poll re-checks every second
            wake()
        elif kind == "done":
            c, job_id, lease_id, version = data
            job = st.jobs.get(job_id)
            mine = None if job is None else held_by(job, c.cid, lease_id)
            closed = st.done.get(job_id)
            if job is not None and mine is not None and check_lease(mine, c.cid, lease_id, st.now) is LeaseCheck.OK:
                returned += 1
                issuer.observe(c.cid, mine, st.now)
                del st.jobs[job_id]  # done: never leased again
                st.done[job_id] = (job, lease_id)
                active.clear()
                st.pending.append(Pending(job_id, version, st.now))
                learner_try()
            elif (closed is not None and closed[1] != lease_id and holds_lease(closed[0], c.cid, lease_id)
                  and st.now < (held_by(closed[0], c.cid, lease_id).lease_deadline or 0.0)):
                st.duplicates += 1  # the other holder's result was first: credited, not trained (api.intake)
                issuer.observe(c.cid, held_by(closed[0], c.cid, lease_id), st.now)
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
    start = clients[:n_clients]
    capacity = sum(1.0 / c.job_s for c in start)  # jobs/s the whole swarm could return at the start
    stayed = [c for c in clients if min(c.leaves_at, st.now) - c.joined_at >= stay_s]
    return {
        "clients": n_clients, "mix": mix, "staleness_bound": staleness, "speed_aware": speed_aware,
        "steps": st.steps, "sim_s": st.now, "departed": sum(1 for c in clients if c.leaves_at <= st.now),
        "identities": len(clients), "got_work_share": len(got_work) / len(clients),
        "stayed": len(stayed), "stayed_got_work_share": (sum(c.cid in got_work for c in stayed) / len(stayed)
                                                         if stayed else None),
        "returned": returned, "returned_per_s": returned / st.now if st.now else 0.0,
        "sybil_leases": sum(1 for cid in sybil_ids if cid in got_work), "set_aside_share": st.too_stale / returned if returned else 0.0,
        "staleness_mean": (sum(k * v for k, v in st.staleness.items()) / trained) if trained else 0.0,
        "decisions": decisions, "issuer_cpu_per_decision_us": decide_cpu / max(1, decisions) * 1e6,
        "learner_busy_fraction": st.busy_s / st.now if st.now else 0.0,
        "capacity_jobs_per_s": capacity, "consumption_jobs_per_s": jobs_per_step / train_s,
        "staleness_histogram": {str(k): v for k, v in sorted(st.staleness.items())},
        "staleness_max": max(st.staleness) if st.staleness else 0,
        "trained": trained, "too_stale": st.too_stale, "reissued": st.reissued, "refused_late": st.refused_late,
        "replicas": st.replicas, "duplicates": st.duplicates,
    }


def decision_cost(waiting: int, *, staleness: int = 2, jobs_per_step: int = 2, decisions: int = 3000,
                  seed: int = 0) -> dict[str, Any]:
    """CPU seconds per lease decision of the coordinator's issuer with ``waiting`` clients long-polling.

    What one long-polling request does when it re-checks (coordinator.api.leasing's lease loop): ``decide`` for
    itself and, on a new version, ``next_in_line``. The waiting clients' paces are spread log-uniformly over
    1–1,000 s; half the queue's B·(S+1) slots are held by live leases, so every decision runs the whole rule set
    (admission, the speed-aware rules, reissue) rather than stopping at a full queue."""
    import time

    rng = random.Random(seed)
    policy = SyncPolicy("async-push-pull", staleness, jobs_per_step)
    issuer = Issuer(policy, lease_timeout_s=300.0)
    ids = [f"c{i}" for i in range(waiting)]
    for cid in ids:
        issuer.declare(cid, 1000.0 ** rng.random())
        issuer.begin_wait(cid)
    for t in (0.0, 1.0, 2.0):
        issuer.new_version(t)
    now, version = 2.0, 2
    slots = jobs_per_step * (staleness + 1)
    views = [LeaseView(f"j{k}", JobState.LEASED, version - k % (staleness + 1), 0.0, f"l{k}", ids[k % waiting],
                       now + 300.0) for k in range(slots // 2)]
    askers = [rng.choice(ids) for _ in range(decisions)]
    granted = 0
    t0 = time.process_time()
    for k, cid in enumerate(askers):
        granted += issuer.decide(cid, views, 0, now, version, version - 1) is not None
        issuer.next_in_line(cid, version + k // 100)  # a new version every 100 re-checks
    cpu = time.process_time() - t0
    return {"waiting": waiting, "decisions": decisions, "granted": granted,
            "cpu_per_decision_us": cpu / decisions * 1e6}


def main() -> int:
    import time

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="*", default=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000])
    ap.add_argument("--staleness", type=int, nargs="*", default=[0, 1, 2, 4], help="S; 0 = sequential pull")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fastest-job-s", type=float, default=1.0, help="job time of the fastest client, seconds")
    ap.add_argument("--no-plain", action="store_true", help="skip the comparison without speed-aware issuance")
    ap.add_argument("--mix", choices=["spread", "realistic"], default="spread",
                    help="spread: job times log-uniform over 100x, clients leave for good; realistic: GPU, Apple, "
                         "laptop-CPU and old-CPU volunteers (job times 1-1,000x), churn")
    ap.add_argument("--vanish", type=float, default=0.0, help="share of clients that take one job and never return")
    ap.add_argument("--sybils", type=int, default=0, help="fresh identities at any time that declare 10^7 tokens/s, "
                    "take one job each and vanish")
    ap.add_argument("--sybil-every-s", type=float, default=0.0, help="seconds before a vanished sybil's successor "
                    "asks (2: one address's default registration budget, 30 a minute)")
    ap.add_argument("--lifetime-s", type=float, default=3000.0, help="mean time a client stays (exponential)")
    ap.add_argument("--lease-timeout-s", type=float, default=300.0)
    ap.add_argument("--max-held-lag", type=int, default=HELD_LAG,
                    help="jobs.max_held_lag: how far behind a client's held version may be and still be named in its "
                         "lease (64: as long as S allows, the rule before issue 32)")
    ap.add_argument("--max-sim-s", type=float, default=20_000.0, help="stop the run at this simulated time")
    ap.add_argument("--decision-cost", type=int, nargs="*", metavar="WAITING",
                    help="instead: the issuer's CPU per lease decision with this many clients waiting")
    ap.add_argument("--out", type=Path, default=Path("bench-out/swarm_sim"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.decision_cost:
        bounds = [s for s in args.staleness if s > 0] if "--staleness" in sys.argv else [2]
        costs = [decision_cost(w, staleness=s) | {"staleness": s} for s in bounds for w in args.decision_cost]
        print("| S | clients waiting | issuer CPU per lease decision | granted |\n|---|---|---|---|")
        for c in costs:
            print(f"| {c['staleness']} | {c['waiting']:,} | {c['cpu_per_decision_us']:.0f} µs | "
                  f"{c['granted']} / {c['decisions']} |")
        (args.out / "decision_cost.json").write_text(json.dumps(costs, indent=2))
        return 0
    modes = [True] if args.no_plain else [True, False]
    rows = []
    for aware in modes:
        for s in args.staleness:
            for n in args.clients:
                t0 = time.monotonic()
                row = simulate(n, s, steps=args.steps, speed_aware=aware, fastest_job_s=args.fastest_job_s,
                               mix=args.mix, vanish=args.vanish, lifetime_s=args.lifetime_s, sybils=args.sybils, sybil_every_s=args.sybil_every_s,
                               lease_timeout_s=args.lease_timeout_s, max_sim_s=args.max_sim_s,
                               max_held_lag=args.max_held_lag)
                row["wall_s"] = time.monotonic() - t0
                rows.append(row)
                print(f"  {n} clients, S = {s}{'' if aware else ' (plain)'}: {row['wall_s']:.1f} s wall",
                      file=sys.stderr, flush=True)
    print("SIMULATION — coordinator scheduling code, simulated clients and learner")
    print("| issuance | clients | S | capacity / consumption | learner busy | staleness mean / max | set aside "
          "(of returned) | clients that got work (all / stayed ≥ 1 h) | reissued | issuer CPU per decision | "
          "wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        stayed = "–" if r["stayed_got_work_share"] is None else f"{r['stayed_got_work_share']:.2f}"
        print(f"| {'speed-aware' if r['speed_aware'] else 'plain'} | {r['clients']:,} | {r['staleness_bound']} | "
              f"{r['capacity_jobs_per_s'] / r['consumption_jobs_per_s']:.2f} | {r['learner_busy_fraction']:.3f} | "
              f"{r['staleness_mean']:.1f} / {r['staleness_max']} | {r['too_stale']} ({r['set_aside_share']:.1%}) | "
              f"{r['got_work_share']:.2f} / {stayed} | {r['reissued']} | {r['issuer_cpu_per_decision_us']:.0f} µs | "
              f"{r['wall_s']:.0f} s |")
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
