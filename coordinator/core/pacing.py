"""Speed-aware issuance: who gets a free slot in the work queue (pure rules, no I/O).

The queue of work in flight is small — B·(S+1) jobs for staleness bound S — so *who* holds its slots decides
whether the learner is kept busy. A job handed to a client that needs 50 s while the learner steps every
second is trained many versions later than it was generated (too stale: credited, never trained on), and it
blocks a slot that a fast client could have turned over fifty times. This is BOINC's deadline check ("will
this host finish in time?") with the staleness bound as the deadline:

1. **Fastest first.** When several clients are long-polling for a slot, it goes to the one expected to
   finish soonest: a client declines a slot while at least as many strictly faster clients are waiting as
   there are free slots.
2. **Horizon.** In async push-pull, once the learner's next batch is already covered by work in the queue,
   a client is only given a job it is expected to return while the result is still within S, with a margin
   (``HORIZON_SHARE``: versions come faster than their recent mean as the supply grows). A learner that
   is starving takes work from anyone.
3. **Exploration.** A client whose pace is unknown (no results yet, no self-benchmark) gets a job only while
   no other unknown client holds one, so a crowd of newcomers cannot fill the queue with work of unknown
   duration — and each newcomer is measured in turn.
4. **Just in time.** In async push-pull, a job is not handed out earlier than the learner needs it. The
   supply this client's job would join — results accepted and not yet trained (the batch in training
   included), plus leases in flight whose holders are expected back before this client could be — is
   compared with what the learner takes until then: the batch in training and every batch it starts before
   this job could be back, ``B·(⌈pace/step⌉ + 1)``. If the supply already covers that, the client waits:
   issuing now would not make the learner any busier, the result would only sit in the queue and be trained
   staler than if it were issued later. Only leases expected back at least half a learner step sooner
   count (a slow holder's work does not feed the next batches; the half step absorbs a late arrival), and
   none already past its expected time (its holder may be slow or gone). In bench/swarm_sim.py, counting
   late leases too starved the learner at 1,000 clients (busy 0.68), and counting them with no slack cost
   0.06 busy at 50 clients. When the learner is the bottleneck this keeps staleness near the one version a
   pipeline needs, whatever S allows; when generation is the bottleneck the supply never covers the demand
   and nothing changes.

Paces are estimated per client as an exponentially weighted mean of observed lease-to-result seconds, seeded
by the client's declared self-benchmark (untrusted, corrected by the first observed job). A declaration is a claim:
rule 1 orders clients by :func:`rank`, which believes a declared pace no faster than the fastest measured one, so
a fresh identity declaring 10⁷ tokens/s is not served ahead of the swarm's fastest measured client (issue 37;
what such a flood still costs: docs/benchmarks.md, bench/swarm_sim.py ``--sybils``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

PACE_WEIGHT = 0.3  # weight of the newest observation in the pace average
OVERDUE_FACTOR = 3.0  # a lease is overdue after this many times its holder's expected pace (plus a step)
# ... and never sooner than this: a pace of tens of milliseconds (a tiny model, or an optimistic self-benchmark that
# leaves out the snapshot download) would otherwise declare a lease overdue while its result is on the way, and
# the freed slot would issue a job the learner cannot use (stale on return in sequential pull)
OVERDUE_FLOOR_S = 5.0
SUPPLY_SLACK_STEPS = 0.5  # rule 4: a lease in flight counts as supply if expected back this many steps early
# rule 2: a job is only issued if expected back within this share of the time the horizon allows. The seconds per
# version are a recent mean, and the learner speeds up as the supply grows (a starved learner's slow versions let a
# slow client in; the results that arrive meanwhile speed it up), so a job admitted at the edge comes back stale. In
# bench/swarm_sim.py's realistic swarm of 20 clients at S = 16, 1.0 (the rule before issue 32) set aside 3.3 % of
# the results returned, 0.8 sets aside 0.5 % and keeps the learner as busy (0.60 against 0.57) and gives work to as
# many clients; 0.7 sets aside 0.2 % but costs 0.01–0.04 busy (docs/benchmarks.md). A share, not a number of steps:
# the estimate's error grows with the horizon, and at S = 2 two steps fewer would refuse the fast clients too.
HORIZON_SHARE = 0.8


@dataclass(frozen=True)
class ClientSpeed:
    """What issuance knows about the asking client and the swarm right now.

    ``pace_s``: the client's expected seconds from lease to result (None: unknown).
    ``faster_waiting``: clients long-polling for work right now that are expected to finish sooner.
    ``exploring``: live leases held by clients of unknown pace.
    ``step_s``: recent seconds between policy versions (None: no version yet). This, not the optimisation
    time alone, is how fast results age: a starved learner publishes slowly, and slow clients' work stays
    useful for longer.
    ``proven``: the client's pace comes from its results, not a declaration (only such a client is given a
    replica, core.scheduling.choose_replica). ``faster_proven_waiting``: the measured clients among
    ``faster_waiting`` (a replica goes to the fastest measured ones first; a claim never outranks them).
    """

    pace_s: float | None = None
    faster_waiting: int = 0
    exploring: int = 0
    step_s: float | None = None
    proven: bool = False
    faster_proven_waiting: int = 0


#: A client's place in rule 1's order: (pace, 0) measured, (max(pace, floor), 1) declared only; None (unknown) last.
Rank = tuple[float, int]
_Key = TypeVar("_Key", float, Rank)


def rank(pace_s: float | None, proven: bool, floor: float = 0.0) -> Rank | None:
    """Rule 1's sort key: by pace, a declared one never faster than ``floor`` (the fastest pace results have
    shown), a measured one first among equals; unknown last."""
    return None if pace_s is None else (pace_s, 0) if proven else (max(pace_s, floor), 1)


def update_pace(previous: float | None, observed_s: float) -> float:
    """Exponentially weighted pace; the first observation replaces an unknown (or declared) prior fully
    when there is none, and counts ``PACE_WEIGHT`` otherwise."""
    if not math.isfinite(observed_s) or observed_s < 0:
        return previous if previous is not None else 0.0
    if previous is None:
        return observed_s
    return (1 - PACE_WEIGHT) * previous + PACE_WEIGHT * observed_s


def due_at(leased_at: float, pace_s: float | None, step_s: float | None) -> float | None:
    """When a lease's holder is overdue: ``OVERDUE_FACTOR`` × its pace plus one learner step after the lease, at
    least ``OVERDUE_FLOOR_S``.
    An overdue lease stops holding a queue slot (the client has probably vanished or stalled), but stays
    valid until its hard deadline: an honest late result is still accepted."""
    if pace_s is None:
        return None
    return leased_at + max(OVERDUE_FLOOR_S, OVERDUE_FACTOR * pace_s + (step_s or 0.0))


def expected_back(leased_at: float, pace_s: float | None) -> float | None:
    """When a lease's holder is expected to return its result: ``pace_s`` after the lease (None: unknown)."""
    return None if pace_s is None else leased_at + pace_s


def declared_pace(tokens_per_s: float | None, tokens_per_job: int) -> float | None:
    """A prior pace from a client's self-benchmark: seconds to generate a job's worth of tokens at the
    declared rate. Untrusted and optimistic (no fetch or network time): the first observed result corrects it."""
    if tokens_per_s is None or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
        return None
    return tokens_per_job / tokens_per_s


def faster_count(me: _Key | None, others: Iterable[_Key | None]) -> int:
    """How many of ``others`` are expected to finish strictly sooner than ``me`` (unknown = slowest): paces, or
    :func:`rank` keys (all of one kind)."""
    if me is None:
        return sum(1 for p in others if p is not None)
    return sum(1 for p in others if p is not None and p < me)


def within_horizon(pace_s: float, step_s: float, versions_left: int) -> bool:
    """Will a job of ``pace_s`` seconds come back before the learner has moved ``versions_left`` + 1
    versions past the one it is generated with? Allows half a step of slack for the step in progress, and asks
    the job back within ``HORIZON_SHARE`` of that time: ``step_s`` is the recent mean, and versions come faster
    than it as the supply grows."""
    return pace_s <= HORIZON_SHARE * (versions_left + 0.5) * step_s


def may_take_slot(speed: ClientSpeed, *, free: int, queued: int, jobs_per_step: int, versions_left: int | None,
                  ahead: int | None = None) -> bool:
    """Rules 1–4 for one free slot. ``versions_left`` is how many more versions the job's result may lag
    by and still be trained (None: no horizon applies, as in sequential pull). ``ahead``: the supply rule 4
    weighs — results accepted and not yet trained, plus leases in flight expected back before this client's
    job (None: not known, rule 4 does not apply)."""
    if speed.faster_waiting >= free:
        return False
    if speed.pace_s is None:
        return speed.exploring == 0 or queued < jobs_per_step
    if versions_left is None or speed.step_s is None or queued < jobs_per_step:
        return True
    if not within_horizon(speed.pace_s, speed.step_s, versions_left):
        return False
    return ahead is None or ahead < needed_ahead(speed.pace_s, speed.step_s, jobs_per_step)


def needed_ahead(pace_s: float, step_s: float, jobs_per_step: int) -> int:
    """Results the learner takes until a job of ``pace_s`` seconds could be back: the batch in training plus
    every batch it starts in the meantime (B per step). If the supply already covers this many, the learner
    does not need the job yet."""
    return jobs_per_step * (math.ceil(pace_s / max(step_s, 1e-9)) + 1)
