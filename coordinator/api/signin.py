"""The first phase of every signed call: the envelope opened and checked, the sender known, fresh and not banned —
and ``POST /v1/register``, where a sender becomes known.

Everything here refuses before anything is written for the sender (a nonce is remembered only once the signature
verified); the trust boundary's counters and rules are :mod:`coordinator.api.guard`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.api.guard import Guard
from coordinator.api.issuer import Issuer
from coordinator.config import CoordinatorConfig
from coordinator.core import pacing
from coordinator.core.auth import check_timestamp, nonce_expiry
from coordinator.limits import MAX_REQUEST_BYTES
from coordinator.run import notices
from coordinator.store.store import Store
from shared import PROTOCOL_VERSION, crypto, wire
from shared.endpoints import REGISTER
from shared.errors import ProtocolError, Reason
from shared.messages import RegisterRequest, RegisterResponse, SignedRequest

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SignIn:
    """Opens signed requests (the volunteers' and, through :mod:`coordinator.api.admin`, the operators') and
    registers new identities."""

    config: CoordinatorConfig
    store: Store
    guard: Guard
    issuer: Issuer
    run_id: str
    clock: Callable[[], float]

    def open_envelope(self, raw: bytes, path: str) -> SignedRequest:
        req = wire.decode(raw, SignedRequest, max_bytes=MAX_REQUEST_BYTES)
        if req.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"this coordinator speaks protocol {PROTOCOL_VERSION}, the "
                                                         f"request uses {req.protocol}; upgrade echo-swarm")
        if req.path != path:
            raise ProtocolError(Reason.BAD_SIGNATURE, f"request was signed for {req.path}, sent to {path}")
        return req

    def check_fresh(self, req: SignedRequest) -> None:
        now = self.clock()
        window = self.config.verification.request_window_s
        check_timestamp(req.timestamp, now, window)
        if not self.store.nonces.remember(req.nonce, nonce_expiry(max(req.timestamp, now), window)):
            raise ProtocolError(Reason.REPLAYED_NONCE, "this request was already received (replayed nonce)")

    def authenticate(self, raw: bytes, path: str) -> SignedRequest:
        """Envelope (protocol, path) → known client → signature → not banned → timestamp → nonce, in that order.

        The ban check follows the signature so that nobody learns whether an id is banned without its key."""
        req = self.open_envelope(raw, path)
        client = self.store.clients.get(req.client_id)
        if client is None:
            raise ProtocolError(Reason.UNKNOWN_CLIENT, "this client is not registered; register first")
        crypto.verify_request(req, bytes(client["public_key"]))
        self.guard.check_identity(req.client_id, self.clock())  # charged from here on, whatever refuses it next
        if client["banned"]:
            raise ProtocolError(Reason.BANNED, notices.ban_message(self.store, req.client_id))
        self.check_fresh(req)
        return req

    def register(self, raw: bytes, peer: str = "") -> RegisterResponse:
        req = self.open_envelope(raw, REGISTER.path)
        body = wire.decode(req.body, RegisterRequest)
        crypto.verify_request(req, body.public_key)
        self.guard.check_identity(req.client_id, self.clock())  # charged from here on, whatever refuses it next
        existing = self.store.clients.get(req.client_id)
        if existing is not None and existing["banned"]:
            raise ProtocolError(Reason.BANNED, notices.ban_message(self.store, req.client_id))
        self.guard.check_registration(peer, body.invite, self.clock(), is_new=existing is None)
        # the class is the coordinator's to establish: one of a fixed set, pinned at the first registration
        bclass = self.guard.class_for_registration(req.client_id, body.profile.backend, body.profile.device,
                                                   is_new=existing is None)
        self.check_fresh(req)
        new = self.store.clients.register(req.client_id, body.public_key, body.profile.model_dump(), self.clock(),
                                          backend_class=bclass, address=peer or None)
        # a declared self-benchmark seeds the pace until a result is seen
        per_job = self.config.jobs.prompts_per_job * self.config.learner.group_size * self.config.sampling.max_tokens
        self.issuer.declare(req.client_id, pacing.declared_pace(body.profile.benchmark_tokens_per_s, per_job))
        if new:
            logger.info("registered client %s (%s, %s)", req.client_id[:8], body.profile.backend, body.profile.device)
            # bounded sign-up (issue 24): the longest-idle never-accepted identities beyond the cap are removed
            self.issuer.forget(self.store.clients.expire_idle(self.config.registration.max_idle_identities,
                                                              self.clock(), spare=req.client_id))
        return RegisterResponse(client_id=req.client_id, new=new, run_id=self.run_id)
