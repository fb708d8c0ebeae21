"""SIMULATION of the coordinator's scheduling with 1 to 1,000 heterogeneous clients (no network, no model).

The decisions are the coordinator's own code — ``decide_lease`` (admission, reissue, version binding),
``check_lease`` (is a returned result still wanted), ``select_batch`` (oldest-first batches within the
staleness bound) from ``coordinator.core`` — driven by a discrete-event clock. What is simulated: clients
whose job times are spread log-uniformly over 100× (fastest 1 s), 5 % of jobs vanish with their client and
never come back; a learner step of 1 s per batch of B = 2 jobs. Idle clients long-poll: they ask again when
a new version is published or a lease expires.

    python bench/swarm_sim.py                          # the sweep: clients × S, writes JSON + PNG
    python bench/swarm_sim.py --clients 50 --staleness 2   # one configuration

Reports, per (clients, S): learner busy fraction, staleness histogram of trained rollouts, results set aside
as too stale, and reissued jobs.
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

from coordinator.core.leases import JobState, LeaseCheck, LeaseView, check_lease, deadline_for  # noqa: E402
from coordinator.core.scheduling import Pending, SyncPolicy, decide_lease, select_batch  # noqa: E402


@dataclass
class SimClient:
    cid: str
    job_s: float
    held: int = -1
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
             fastest_job_s: float = 1.0, spread: float = 100.0, vanish: float = 0.05, lease_timeout_s: float = 300.0,
             steps: int = 300, seed: int = 0, max_sim_s: float = 20_000.0) -> dict[str, Any]:
    rng = random.Random(seed)
    mode = "sequential-pull" if staleness == 0 else "async-push-pull"
    policy = SyncPolicy(mode, max(1, staleness), jobs_per_step)
    clients = [SimClient(f"c{i}", fastest_job_s * spread ** rng.random()) for i in range(n_clients)]
    st = SimState()
    events: list[tuple[float, int, str, Any]] = []
    tie = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, data))

    waiting: list[SimClient] = []  # idle clients long-polling for a job

    def try_lease(c: SimClient) -> None:
        active = [j for j in st.jobs.values() if j.state is not JobState.DONE]
        active.sort(key=lambda j: int(j.job_id[1:]))
        # as in the coordinator, results count as queued until the step that trains them has committed
        decision = decide_lease(active, len(st.pending) + len(st.training), st.now, st.version, c.held, policy)
        if decision is None:
            waiting.append(c)  # long-poll: woken by the next version or lease expiry
            return
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
        c.held = decision.version
        if rng.random() < vanish:
            c.gone = True  # never returns: its lease expires and the job is reissued
            return
        push(st.now + c.job_s, "done", (c, job_id, lease_id, decision.version))

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

    for c in clients:
        push(0.0, "poll", c)
    while events and st.steps < steps and st.now < max_sim_s:
        st.now, _, kind, data = heapq.heappop(events)
        if kind == "poll":
            try_lease(data)
        elif kind == "expiry":  # a lease ran out (its client vanished): the job can be reissued now
            job = st.jobs[data]
            if job.state is JobState.LEASED and job.lease_deadline is not None and job.lease_deadline <= st.now:
                woken, waiting[:] = list(waiting), []
                for c in woken:
                    try_lease(c)
        elif kind == "done":
            c, job_id, lease_id, version = data
            job = st.jobs[job_id]
            if check_lease(job, c.cid, lease_id, st.now) is LeaseCheck.OK:
                st.jobs[job_id] = LeaseView(job_id, JobState.DONE, version, job.created_at, lease_id, c.cid,
                                            job.lease_deadline)
                st.pending.append(Pending(job_id, version, st.now))
                learner_try()
            else:
                st.refused_late += 1
            try_lease(c)
        elif kind == "step":
            st.version += 1
            st.steps += 1
            st.training = []
            learner_try()
            woken, waiting[:] = list(waiting), []  # push: a new version wakes every long-polling client
            for c in woken:
                try_lease(c)
    trained = sum(st.staleness.values())
    capacity = sum(1.0 / c.job_s for c in clients) * (1 - vanish)
    return {
        "clients": n_clients, "staleness_bound": staleness, "steps": st.steps, "sim_s": st.now,
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
    ap.add_argument("--out", type=Path, default=Path("bench-out/swarm_sim"))
    args = ap.parse_args()
    rows = [simulate(n, s, steps=args.steps) for s in args.staleness for n in args.clients]
    print("SIMULATION — coordinator scheduling code, simulated clients and learner")
    print("| clients | S | capacity / consumption | learner busy | staleness histogram | too stale | reissued |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['staleness_bound']} | {r['capacity_jobs_per_s'] / r['consumption_jobs_per_s']:.2f} | "
              f"{r['learner_busy_fraction']:.3f} | {r['staleness_histogram']} | {r['too_stale']} | {r['reissued']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "swarm_sim.json").write_text(json.dumps({"simulation": True, "rows": rows}, indent=2))
    plot(rows, args.out / "swarm_sim.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for s in sorted({r["staleness_bound"] for r in rows}):
        pts = [(r["clients"], r["learner_busy_fraction"]) for r in rows if r["staleness_bound"] == s]
        ax.plot(*zip(*pts, strict=True), "o-", label="sequential pull" if s == 0 else f"async, S = {s}")
    ax.set_xscale("log")
    ax.set_xlabel("simulated clients (job times spread 100×, 5 % vanish mid-job)")
    ax.set_ylabel("learner busy fraction")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SIMULATION: coordinator scheduling vs swarm size")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
