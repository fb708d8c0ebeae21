"""The API role's sections: ``[server]`` (connections and timeouts), ``[limits]`` (request rates) and
``[registration]`` (who may join)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from coordinator.config.base import StrictModel


class LimitsConfig(StrictModel):
    """Request rate limits (token buckets). A rate of 0 turns that limit off."""

    per_identity_rps: float = Field(20.0, ge=0, description="Signed requests per second per client identity.")
    per_identity_burst: float = Field(60.0, ge=1, description="Requests one identity may send at once.")
    per_address_rps: float = Field(200.0, ge=0, description="Requests per second per remote address (all "
                                   "identities behind one address together; raise it for NATed labs).")
    per_address_burst: float = Field(400.0, ge=1, description="Requests one address may send at once.")
    registrations_per_address_per_min: float = Field(30.0, ge=0, description="New registrations per minute per "
                                                     "remote address (stops identity floods).")
    registration_burst: float = Field(20.0, ge=1, description="Registrations one address may make at once.")
    new_identities_per_min: float = Field(120.0, ge=0, description="New identities per minute, all addresses "
                                          "together (a global sign-up rate: a flood from many addresses is bounded "
                                          "by it). 0: unlimited.")
    new_identity_burst: float = Field(60.0, ge=1, description="New identities the whole swarm may register at "
                                      "once.")
    max_leases_per_client: int = Field(2, ge=1, le=1024, description="Live leases one identity may hold at once; "
                                       "beyond it a lease request gets no job, so "
                                       "nobody can hoard the queue.")


class RegistrationConfig(StrictModel):
    """Who may join: anyone (open), or holders of an invite token (private swarms)."""

    mode: Literal["open", "invite"] = Field("open", description="'invite': registering needs a token whose "
                                            "sha256 is listed in invite_sha256.")
    max_idle_identities: int = Field(10_000, ge=1, le=10_000_000, description="Identities that never had a "
                                     "result accepted the store keeps; past it the longest-idle ones are removed "
                                     "(they re-register if they come back), so sign-ups cannot grow the store "
                                     "without bound. Banned, quarantined and lease-holding ones are kept.")
    invite_sha256: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(
        default_factory=list, description="sha256 (hex) of each valid invite token; only hashes are stored. "
        "Make one with: python -c \"import secrets,hashlib;t=secrets.token_urlsafe(32);print(t, "
        "hashlib.sha256(t.encode()).hexdigest())\"")

    @model_validator(mode="after")
    def _invites_exist(self) -> RegistrationConfig:
        if self.mode == "invite" and not self.invite_sha256:
            raise ValueError("registration.mode is 'invite' but registration.invite_sha256 is empty; add the "
                             "sha256 of at least one token, or set mode = 'open'")
        return self


class ServerConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Listen address. Use 0.0.0.0 to accept volunteers from the network.")
    port: int = Field(8470, ge=0, le=65535, description="Listen port (0: pick a free one).")
    # Bounded connections (coordinator.core.connections, coordinator.api.netguard; docs/operations.md)
    max_connections: int = Field(0, ge=0, le=1_000_000, description="Open connections at most, all clients "
                                 "together. 0: derived from the file limit (raised to its hard limit at start): "
                                 "(limit - reserved_fds - 512 for accepts in flight) / 2. When full, an idle or stalled connection gives up its "
                                 "place to a newcomer; if none can, the newcomer is answered 503.")
    reserved_fds: int = Field(256, ge=32, le=100_000, description="File descriptors kept free of connections for "
                              "the database, snapshots, checkpoints and the learner.")
    max_connections_per_address: int = Field(64, ge=1, le=1_000_000, description="Open connections per remote IPv4 "
                                             "address or IPv6 /64 (raise it when many volunteers share one NAT). "
                                             "Over it, that address's own idle or stalled connection makes room, "
                                             "else the newcomer is answered 429.")
    header_timeout_s: float = Field(10.0, gt=0, le=600, description="Seconds a connection has from connecting (or "
                                    "from the first byte of a request) to deliver the request's headers.")
    body_timeout_s: float = Field(120.0, gt=0, le=3600, description="Seconds a request body may take to arrive in "
                                  "full (8 MiB, the largest result, at 70 KB/s).")
    keepalive_timeout_s: float = Field(30.0, gt=0, le=3600, description="Seconds an idle keep-alive connection is "
                                       "kept open between requests (above the clients' own 15 s).")
    send_timeout_s: float = Field(60.0, gt=0, le=3600, description="Seconds a reply may wait on a client that does "
                                  "not read it before the connection is closed.")
    public_reads_per_address_rps: float = Field(10.0, ge=0, description="GET /v1/status and /metrics per second per "
                                                "address (0: unlimited); over it: 429.")
    public_reads_burst: float = Field(30.0, ge=1, description="Status/metrics reads one address may make at once.")
    public_cache_s: float = Field(1.0, ge=0, le=60, description="Seconds a built /v1/status or /metrics reply is "
                                  "reused for every reader (rebuilt sooner when the policy version changes).")

    @model_validator(mode="after")
    def _address_cap_within_total(self) -> ServerConfig:
        if self.max_connections and self.max_connections_per_address > self.max_connections:
            raise ValueError(f"server.max_connections_per_address ({self.max_connections_per_address}) exceeds "
                             f"server.max_connections ({self.max_connections}); lower it, or raise max_connections "
                             f"(0 derives it from the file limit)")
        return self
