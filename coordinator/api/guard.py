"""The trust boundary's state and gates, next to the Store: each identity's pinned backend class, trust and
quarantine per identity, rate limits and the registration gate.

The rules are pure (:mod:`coordinator.core.trust`, :mod:`coordinator.core.ratelimit`); this module applies them to
the state the Store keeps (the ``trust`` table: its SQL is in coordinator.store.trust_rows) and to buckets in memory,
and turns their decisions into typed refusals.

Rate-limit buckets live in memory on purpose: a restart grants everyone a fresh burst, which is harmless,
and a request refused for its rate writes nothing anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math

from coordinator.config import CoordinatorConfig
from coordinator.core.ratelimit import Limiter, Rate
from coordinator.core.reporting import (
    SELECTIVE_REPORTING,
    Reporting,
    ReportingPolicy,
    Sample,
    VersionGroup,
    dropped_bias,
    reward_bias,
    selective,
    worth_comparing,
)
from coordinator.core.trust import (
    TrustPolicy,
    TrustState,
    backend_class,
    describe_classes,
    known_class,
    on_flag,
    on_invalid,
    on_valid,
    quarantined,
)
from coordinator.store.records import TrustStanding
from coordinator.store.store import Store
from shared.errors import ProtocolError, Reason

logger = logging.getLogger(__name__)

#: Store meta keys of the run's registration setting (coordinator.api.ops_actions writes them).
REGISTRATION_MODE = "registration_mode"
INVITES = "invite_sha256"


class Guard:
    def __init__(self, config: CoordinatorConfig, store: Store) -> None:
        self.config = config
        self.store = store
        t = config.trust
        self.policy = TrustPolicy(t.quarantine_after, t.quarantine_s)
        self.reporting_policy = ReportingPolicy(t.reporting_min_leases, t.reporting_max_unreturned,
                                                t.reporting_min_results, t.reporting_reward_z, t.reporting_dropped_z,
                                                t.reporting_cooldown_s)
        lim = config.limits
        self.per_identity = Limiter(Rate(lim.per_identity_rps, lim.per_identity_burst))
        self.per_address = Limiter(Rate(lim.per_address_rps, lim.per_address_burst))
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
        row = self.store.trust.row(client_id, self.pinned_class(client_id))
        if row is None:
            return TrustState()
        return TrustState(int(row["consecutive_valid"]), int(row["consecutive_invalid"]), int(row["quarantines"]),
                          float(row["quarantined_until"]))

    def _put(self, client_id: str, state: TrustState, valid: bool) -> None:
        self.store.trust.put(client_id, self.pinned_class(client_id), state.consecutive_valid,
                             state.consecutive_invalid, state.quarantines, state.quarantined_until, valid)

    def record_valid(self, client_id: str) -> TrustState:
        """A result of this identity was verified and accepted (every token checked against the keyed sampler)."""
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

    # -- selective reporting (coordinator.core.reporting): what the keyed sampler cannot see ----------------
    def reporting(self, client_id: str) -> Reporting:
        """The identity's leases, how many ended without its result, and how its returned rewards compare with
        the other volunteers' at the same versions and with what the jobs it dropped scored."""
        leased, unreturned = self.store.trust.lease_counts(client_id)
        groups = [VersionGroup(*g) for g in self.store.trust.reward_groups(client_id)]
        returned, dropped = (Sample(*s) for s in self.store.trust.reward_samples(client_id))
        return Reporting(leased, unreturned, reward_bias(groups, client_id), dropped_bias(returned, dropped))

    def check_reporting(self, client_id: str, now: float) -> str | None:
        """After an accepted result: lower the identity's trust if it looks like it keeps or abandons results by
        their rewards (core.trust.on_flag; the audit log records why, outcome 'flagged'). Returns the reason, or
        None. Only an
        identity whose unreturned share is already past its threshold costs the reward comparison's query."""
        leased, unreturned = self.store.trust.lease_counts(client_id)
        if not worth_comparing(leased, unreturned, self.reporting_policy):
            return None
        why = selective(self.reporting(client_id), self.reporting_policy, now,
                        self.store.trust.last_flag(client_id, SELECTIVE_REPORTING))
        if why is not None:
            self.store.trust.record_flag(client_id, now, SELECTIVE_REPORTING, why)
            before = self.trust(client_id)
            state = on_flag(before, self.store.trust.flag_count(client_id, SELECTIVE_REPORTING), now, self.policy)
            self._put(client_id, state, False)
            logger.warning("client %s: trust lowered for selective reporting%s: %s", client_id[:8],
                           " and quarantined" if state.quarantines > before.quarantines else "", why)
        return why

    def _quarantined_until(self, client_id: str) -> float:
        """The end of the identity's quarantine, whichever class the evidence was recorded under (0: none)."""
        return self.store.trust.quarantined_until(client_id)

    def check_quarantine(self, client_id: str, now: float) -> None:
        """Per identity first: a quarantined identity gets nothing, whatever backend it claims."""
        until = self._quarantined_until(client_id)
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
        row = self.store.trust.client_class_row(client_id)
        if row is None:
            return "torch/cpu"
        if row["backend_class"]:
            return str(row["backend_class"])
        profile = json.loads(row["profile"])
        return backend_class(str(profile.get("backend", "torch")), str(profile.get("device", "cpu")))

    def class_for_registration(self, client_id: str, backend: str, device: str, is_new: bool) -> str:
        """The class a registration's (backend, device) claim establishes. Refused (schema_invalid, nothing
        written) when the claim is not one of the fixed classes, or when a known identity claims another class
        than the one pinned at its first registration: its trust, quarantine and tolerance
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

    def standings(self) -> list[TrustStanding]:
        return self.store.trust.standings()

    def leases_held(self, client_id: str, now: float) -> int:
        """Live (unexpired) leases of one client."""
        return self.store.trust.leases_held(client_id, now)
