"""The trust boundary's state and gates, next to the Store: each identity's pinned backend class, adaptive
trust and quarantine per identity, spot-check replicas, rate limits and the registration gate.

The rules are pure (:mod:`coordinator.core.trust`, :mod:`coordinator.core.ratelimit`,
:mod:`coordinator.core.replicas`); this module applies them to the state the Store keeps (the ``trust`` and
``replicas`` tables: their SQL is in coordinator.store.store) and to buckets in memory, and turns their decisions into
typed refusals.

Rate-limit buckets live in memory on purpose: a restart grants everyone a fresh burst, which is harmless,
and a request refused for its rate writes nothing anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from coordinator.config import CoordinatorConfig
from coordinator.core.leases import JobState, LeaseView
from coordinator.core.ratelimit import Limiter, Rate
from coordinator.core.replicas import Party, independent
from coordinator.core.trust import (
    TrustPolicy,
    TrustState,
    backend_class,
    describe_classes,
    known_class,
    on_invalid,
    on_valid,
    quarantined,
)
from coordinator.store.db import Row
from coordinator.store.store import Store
from shared.errors import ProtocolError, Reason

logger = logging.getLogger(__name__)

Judge = Literal["arbiter", "peer"]
#: Store meta keys of the run's registration setting (coordinator.api.ops_actions writes them).
REGISTRATION_MODE = "registration_mode"
INVITES = "invite_sha256"
RECENT_PEERS = 1000  # at most this many recently active identities are looked at for an independent replayer


@dataclass(frozen=True)
class ReplicaRow:
    replica_id: str
    job_id: str
    version: int
    original_client: str
    original_class: str
    view: LeaseView
    judge: Judge = "peer"
    tried: frozenset[str] = frozenset()


class Guard:
    def __init__(self, config: CoordinatorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        t = config.trust
        self.policy = TrustPolicy(t.trusted_after, t.min_replication_rate, t.quarantine_after, t.quarantine_s)
        lim = config.limits
        self.per_identity = Limiter(Rate(lim.per_identity_rps, lim.per_identity_burst))
        self.per_address = Limiter(Rate(lim.per_address_rps, lim.per_address_burst))
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.arbitrating: set[str] = set()  # replicas whose coordinator replay is under way (coordinator.api.spotcheck)
        self.registrations = Limiter(Rate(lim.registrations_per_address_per_min / 60.0, lim.registration_burst))
        # one bucket for the whole swarm: sign-ups from any number of addresses together (issue 24)
        self.sign_ups = Limiter(Rate(lim.new_identities_per_min / 60.0, lim.new_identity_burst), max_keys=1)

    # -- rate limits and registration ---------------------------------------------------------------------
    @staticmethod
    def _limited(wait: float, who: str) -> None:
        if wait > 0:
            after = "much later" if math.isinf(wait) else f"in {max(1, math.ceil(wait))}s"
            raise ProtocolError(Reason.RATE_LIMITED, f"too many requests from {who}; slow down and retry {after}")

    def check_address(self, address: str, now: float) -> None:
        self._limited(self.per_address.check(address, now), f"address {address}")

    def check_identity(self, client_id: str, now: float) -> None:
        self._limited(self.per_identity.check(client_id, now), f"client {client_id[:8]}")

    def registration_mode(self) -> str:
        """The run's registration setting: what the operator last set (`echo-swarm admin registration`, kept in
        the store, so every API process and a restart see it), else the config's ``registration.mode``."""
        return self.store.get_meta(REGISTRATION_MODE) or self.config.registration.mode

    def invite_hashes(self) -> list[str]:
        """sha256 of every valid invite token: the config's, and those `echo-swarm admin invite` issued."""
        issued = self.store.get_meta(INVITES)
        return [*self.config.registration.invite_sha256, *(json.loads(issued) if issued else [])]

    def check_registration(self, address: str, invite: str, now: float, is_new: bool) -> None:
        """Invite gate, then the per-address and swarm-wide budgets — all for *new* identities only: an identity
        already registered stays in when a running swarm is made invite-only."""
        if is_new and self.registration_mode() == "invite":
            digest = hashlib.sha256(invite.encode()).hexdigest()
            if not any(hmac.compare_digest(digest, h) for h in self.invite_hashes()):
                raise ProtocolError(Reason.REGISTRATION_CLOSED,
                                    "this swarm is private: registering needs a valid invite token from its "
                                    "operator" + (" (the one given is not valid)" if invite else ""))
        if is_new:
            self._limited(self.registrations.check(address, now), f"address {address} (new identities)")
            self._limited(self.sign_ups.check("*", now), "all addresses together (new identities: the swarm's "
                                                         "sign-up rate)")

    # -- trust --------------------------------------------------------------------------------------------
    def trust(self, client_id: str) -> TrustState:
        """The identity's standing. Kept per identity first: one row, under the class pinned to it (rows of
        other classes exist only in databases from before classes were pinned)."""
        row = self.store.trust_row(client_id, self.pinned_class(client_id))
        if row is None:
            return TrustState()
        return TrustState(int(row["consecutive_valid"]), int(row["consecutive_invalid"]), int(row["quarantines"]),
                          float(row["quarantined_until"]))

    def _put(self, client_id: str, state: TrustState, valid: bool) -> None:
        self.store.put_trust(client_id, self.pinned_class(client_id), state.consecutive_valid,
                             state.consecutive_invalid, state.quarantines, state.quarantined_until, valid)

    def record_valid(self, client_id: str) -> TrustState:
        """A result of this identity was conclusively verified (or its replay decided a spot-check)."""
        state = on_valid(self.trust(client_id))
        self._put(client_id, state, True)
        return state

    def record_invalid(self, client_id: str, now: float) -> TrustState:
        """Evidence against a result of this identity, whatever backend the request claimed."""
        before = self.trust(client_id)
        state = on_invalid(before, now, self.policy)
        self._put(client_id, state, False)
        if state.quarantines > before.quarantines:
            logger.warning("client %s (%s) quarantined until %.0f after %d invalid results in a row",
                           client_id[:8], self.pinned_class(client_id), state.quarantined_until,
                           self.policy.quarantine_after)
        return state

    def quarantined_until(self, client_id: str) -> float:
        """The end of the identity's quarantine, whichever class the evidence was recorded under (0: none)."""
        return self.store.quarantined_until(client_id)

    def check_quarantine(self, client_id: str, now: float) -> None:
        """Per identity first: a quarantined identity gets nothing, whatever backend it claims."""
        until = self.quarantined_until(client_id)
        if quarantined(TrustState(quarantined_until=until), now):
            raise ProtocolError(
                Reason.QUARANTINED,
                f"this client's results were refused {self.policy.quarantine_after} times in a row, so it gets no "
                f"work for {until - now:.0f}s more. Check that echo-swarm is unmodified and up to date and that the "
                f"hardware is healthy (see the refusal reasons it logged)")

    # -- backend class: established by the coordinator, pinned to the identity ------------------------------
    def pinned_class(self, client_id: str) -> str:
        """The backend class the coordinator pinned to ``client_id`` at its first registration. Identities
        registered before classes were pinned (or the co-located learner) get the class of their stored
        profile; an unknown identity, the most common class."""
        row = self.store.client_class_row(client_id)
        if row is None:
            return "torch/cpu"
        if row["backend_class"]:
            return str(row["backend_class"])
        profile = json.loads(row["profile"])
        return backend_class(str(profile.get("backend", "torch")), str(profile.get("device", "cpu")))

    def class_for_registration(self, client_id: str, backend: str, device: str, is_new: bool) -> str:
        """The class a registration's (backend, device) claim establishes. Refused (schema_invalid, nothing
        written) when the claim is not one of the fixed classes, or when a known identity claims another class
        than the one pinned at its first registration: its trust, quarantine, tolerance and replica pairing
        all belong to that class, so switching would escape them. A new identity (another --home) may join
        with another backend — it starts untrusted, which is what a change of class must mean."""
        bclass = known_class(backend, device)
        if bclass is None:
            raise ProtocolError(Reason.SCHEMA,
                                f"backend {backend!r} on device {device[:40]!r} is not a backend class this "
                                f"coordinator verifies ({describe_classes()}); join with one of those "
                                f"(--backend, --device)")
        if not is_new:
            pinned = self.pinned_class(client_id)
            if pinned != bclass:
                raise ProtocolError(Reason.SCHEMA,
                                    f"this identity is pinned to backend class {pinned} since its first "
                                    f"registration and cannot change to {bclass}; join with that backend and "
                                    f"device again, or with a new identity (another --home) for {bclass}")
        return bclass

    def standings(self) -> list[dict[str, Any]]:
        return self.store.standings()

    # -- spot-check replicas ------------------------------------------------------------------------------
    def add_replica(self, job_id: str, version: int, original_client: str, original_class: str, now: float,
                    hold_until: float | None, judge: Judge) -> str:
        """Queue a spot-check of ``job_id``'s accepted result and return the replica's job id.

        The id is the next number of the job stream, in the same form as a fresh job's (core.jobs.plan_job:
        ``j<seq>``), so nothing in it marks a replica or links it to the original. ``hold_until`` (None: not
        held) keeps the original out of training until a conclusive judgement, or until it is dropped."""
        return self.store.add_replica(job_id, version, original_client, original_class, now, hold_until, judge)

    def drop_replica(self, replica_id: str) -> None:
        """Remove a replica written for a result that was then not accepted (spotcheck.drop_hold)."""
        self.store.drop_replica(replica_id)

    @staticmethod
    def _replica(row: Row) -> ReplicaRow:
        view = LeaseView(row["replica_id"], JobState(row["state"]), int(row["version"]), float(row["created_at"]),
                         row["lease_id"], row["lease_client"], row["lease_deadline"])
        judge: Judge = "arbiter" if row["judge"] == "arbiter" else "peer"
        tried = frozenset(t for t in str(row["tried"] or "").split(",") if t)
        return ReplicaRow(row["replica_id"], row["job_id"], int(row["version"]), row["original_client"],
                          row["original_class"], view, judge, tried)

    def get_replica(self, replica_id: str) -> ReplicaRow | None:
        row = self.store.replica_row(replica_id)
        return None if row is None else self._replica(row)

    def awaiting_arbiter(self) -> list[ReplicaRow]:
        """Open replicas the coordinator's own replay must judge (after a restart, none is in progress)."""
        return [self._replica(r) for r in self.store.open_arbiter_replicas()]

    def expire_replicas(self, oldest_version: int, now: float, in_progress: frozenset[str] = frozenset()) -> int:
        """Replicas that can no longer be judged: a held original whose conclusive judgement did not come by its
        ``hold_until`` (and is not being judged right now: ``in_progress``), or whose version was pruned, is
        dropped uncredited — never released to training unverified. An unheld one whose version was pruned is
        closed as 'unverified'. Returns how many replicas changed."""
        due = self.store.due_replicas(oldest_version, now)
        due = [r for r in due if r["replica_id"] not in in_progress or int(r["version"]) < oldest_version]
        if not due:  # the common case, on every lease: no write transaction
            return 0
        self.store.expire_replicas([(r, bool(r["hold"])) for r in due], now,
                                   "no conclusive spot-check before the hold ran out (or its version was pruned): "
                                   "dropped uncredited, the job is done again")
        dropped = sum(1 for r in due if r["hold"])
        if dropped:
            logger.warning("dropped %d held results uncredited: no conclusive spot-check in time", dropped)
        return len(due)

    def established(self, client_id: str) -> bool:
        """Has ``client_id`` had at least trust.replicator_min_valid results conclusively verified, with no
        failure since? Only such an identity replays others' jobs or makes results wait for it."""
        valid, bad = self.store.trust_totals(client_id)
        return valid >= self.config.trust.replicator_min_valid and bad == 0

    def party(self, client_id: str) -> Party | None:
        """What the coordinator observed of an identity (registration addresses and time), for independence."""
        row = self.store.client_party_row(client_id)
        if row is None:
            return None
        addresses = frozenset(a for a in (row["address"], row["last_address"]) if a is not None)
        return Party(client_id, addresses, float(row["registered_at"]))

    def may_judge(self, replayer: str, original: Party, bclass: str, now: float) -> bool:
        """Could ``replayer`` conclusively judge ``original``'s result of class ``bclass``: same pinned class,
        established trust, not quarantined, and independent of it by what the coordinator observed?"""
        me = self.party(replayer)
        if me is None or self.pinned_class(replayer) != bclass or not self.established(replayer):
            return False
        if quarantined(TrustState(quarantined_until=self.quarantined_until(replayer)), now):
            return False
        return independent(original, me, self.config.trust.registration_burst_s)

    def peer_available(self, original_client: str, bclass: str, now: float, window_s: float) -> bool:
        """Is an identity that may judge ``original_client``'s result active now (a signed request within
        ``window_s``)? If not, no replica could be judged in time and holding the result would only drop it.
        Identities without verified work, of another class, or not independent do not count."""
        original = self.party(original_client)
        if original is None:
            return False
        recent: list[str] = []
        for other, at in reversed(self._seen.items()):
            if at < now - window_s or len(recent) >= RECENT_PEERS:
                break
            if other != original_client:
                recent.append(other)
        if not recent:
            return False
        # one query narrows the active identities to those with enough verified work; may_judge decides the rest
        able = self.store.with_verified_work(recent, self.config.trust.replicator_min_valid)
        return any(self.may_judge(c, original, bclass, now) for c in able)

    def lease_replica(self, client_id: str, lease_id: str, deadline: float, now: float) -> ReplicaRow | None:
        """Lease the oldest open (or expired) peer replica that ``client_id`` may judge (coordinator-judged ones
        never leave the coordinator; see may_judge), or None."""
        if not self.store.any_open_peer_replica():
            return None  # the common case on every lease: no write lock taken
        mine = self.pinned_class(client_id)
        rows = self.store.peer_replica_candidates(client_id, mine, now)
        chosen = None
        for row in rows:
            rep = self._replica(row)
            original = self.party(rep.original_client)
            if client_id not in rep.tried and original is not None and \
                    self.may_judge(client_id, original, mine, now):
                chosen = rep
                break
        if chosen is None:
            return None
        if not self.store.lease_replica(chosen.replica_id, lease_id, client_id, deadline, now):
            return None
        return self.get_replica(chosen.replica_id)

    def release_replica(self, replica_id: str, lease_id: str, client_id: str) -> bool:
        return self.store.release_replica(replica_id, lease_id, client_id)

    def close_replica(self, replica: ReplicaRow, lease_id: str, client_id: str, outcome: str, content_sha: str,
                      credit: float, now: float, original_invalid: bool, detail: str, in_training: bool = False
                      ) -> bool:
        """One transaction: a peer's conclusive replay closes the replica with ``outcome``; the replaying client
        is credited; if the original was the outlier it is taken out of training and its credit revoked
        (Store.take_back). False if the replica's lease changed meanwhile."""
        return self.store.close_replica(replica.replica_id, replica.job_id, replica.version, replica.original_client,
                                        lease_id, client_id, outcome, content_sha, credit, now,
                                        Reason.REPLICA_MISMATCH.value if original_invalid else None, detail,
                                        in_training)

    def reopen_replica(self, replica: ReplicaRow, lease_id: str, client_id: str, content_sha: str, now: float,
                       detail: str) -> bool:
        """A peer's replay that settles nothing (it disagrees and no arbiter of the class exists): the replica
        goes back to the queue for another independent identity (never this one again); the original stays
        held. False if the replica's lease changed meanwhile."""
        tried = ",".join(sorted(replica.tried | {client_id}))
        return self.store.reopen_replica(replica.replica_id, replica.version, lease_id, client_id, tried, content_sha,
                                         now, detail)

    def close_arbitrated(self, replica: ReplicaRow, original_invalid: bool, now: float, detail: str,
                         in_training: bool = False) -> bool:
        """One transaction: the coordinator's own replay judged the original (agree, or invalid: taken back).
        False if the replica was closed meanwhile (e.g. dropped because its version was pruned)."""
        return self.store.close_arbitrated(replica.replica_id, replica.job_id, replica.version,
                                           replica.original_client,
                                           Reason.REPLICA_MISMATCH.value if original_invalid else None, now, detail,
                                           in_training)

    def leases_held(self, client_id: str, now: float) -> int:
        """Live (unexpired) leases of one client, on jobs and on replicas."""
        return self.store.leases_held(client_id, now)

    def held_count(self) -> int:
        return self.store.held_count()

    def seen(self, client_id: str, now: float) -> None:
        """Note a client's signed request (in memory): who could take a replica right now."""
        self._seen[client_id] = now
        self._seen.move_to_end(client_id)
        while len(self._seen) > 100_000:
            self._seen.popitem(last=False)

    def replicas_summary(self) -> dict[str, int]:
        return self.store.replicas_summary()
