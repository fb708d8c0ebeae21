"""The volunteer protocol's endpoints, declared once (docs/protocol.md §3-6).

The coordinator's routes (coordinator.api.app), the paths its libp2p peer relays (coordinator.roles.p2p_relay,
through coordinator.limits), the path each signed request is bound to (coordinator.api.service) and the client's
calls (swarm_client.api, runner, snapshots) all read these, so a path or a message type cannot differ between the
two sides: a signed call names its request and reply types, and the client's :meth:`CoordinatorClient.call` takes
the call, not a path and a type it could pair wrongly. tests/unit/test_endpoints.py checks that the server
registers exactly these volunteer routes and that no module spells a path of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.messages import (
    Info,
    LeaseRequest,
    LeaseResponse,
    Message,
    P2PInfo,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
    SignedManifest,
    SignedNotices,
    SubmitResponse,
)

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)


@dataclass(frozen=True, slots=True)
class SignedCall(Generic[Req, Rep]):
    """A POST whose body is a signed envelope (§2) bound to ``path``, carrying ``request``; the reply is ``reply``."""

    path: str
    request: type[Req]
    reply: type[Rep]


@dataclass(frozen=True, slots=True)
class Read:
    """A GET anyone may make. ``path`` may hold ``{name}`` parameters (:meth:`at` fills them); ``reply``: the
    msgpack message it returns, or None for raw bytes (a blob) or JSON (the status)."""

    path: str
    reply: type[Message] | None = None

    @property
    def prefix(self) -> str:
        """The path up to its first parameter (``/v1/blobs/``): what a request's path starts with."""
        return self.path.split("{", 1)[0]

    def at(self, **params: object) -> str:
        """The path with its parameters filled in (``SNAPSHOT.at(version=3)`` → ``/v1/snapshots/3``)."""
        return self.path.format(**params)


REGISTER = SignedCall("/v1/register", RegisterRequest, RegisterResponse)
LEASE = SignedCall("/v1/lease", LeaseRequest, LeaseResponse)
RELEASE = SignedCall("/v1/release", ReleaseRequest, ReleaseResponse)
RESULTS = SignedCall("/v1/results", ResultSubmission, SubmitResponse)
#: The signed calls, in the order of their sections in docs/protocol.md (also the calls relayed over libp2p, §6b).
SIGNED_CALLS: tuple[SignedCall[Any, Any], ...] = (REGISTER, LEASE, RELEASE, RESULTS)

INFO = Read("/v1/info", Info)
SNAPSHOT = Read("/v1/snapshots/{version}", SignedManifest)
BLOB = Read("/v1/blobs/{sha256}")
P2P_INFO = Read("/v1/p2p", P2PInfo)
NOTICES = Read("/v1/notices", SignedNotices)
STATUS = Read("/v1/status")
HEALTHZ = Read("/healthz")
#: The public reads of the volunteer protocol (the status page's own reads are coordinator.api.status_page's).
READS = (INFO, NOTICES, SNAPSHOT, BLOB, P2P_INFO, STATUS, HEALTHZ)
