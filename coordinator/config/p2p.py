"""The ``[p2p]`` section: the p2p role's libp2p peer and its relay of signed calls."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from coordinator.config.base import StrictModel


class P2PConfig(StrictModel):
    """Snapshots between volunteers over libp2p (the optional ``p2p`` extra: hivemind 1.1.12; docs/protocol.md §6a).
    The coordinator runs a DHT node, publishes its newest version there and seeds each blob to a few peers, who
    then serve each other; HTTP stays available to every client."""

    enabled: bool = Field(False, description="Run a libp2p peer: publish versions in a DHT and seed snapshot files to "
                          "volunteers, who then serve each other (needs `pip install 'echo-swarm[p2p]'`).")
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"], min_length=1, max_length=8,
                                   description="libp2p listen addresses, e.g. '/ip4/0.0.0.0/tcp/8471' for remote "
                                   "volunteers (default: loopback only).")
    announce_maddrs: list[str] = Field(default_factory=list, max_length=8, description="Addresses volunteers "
                                       "should dial, e.g. '/ip4/203.0.113.7/tcp/8471' (default: the listen ones).")
    seed_peers: int = Field(2, ge=1, le=1000, description="Peers the coordinator serves each blob to over libp2p "
                            "before leaving it to them (k).")
    record_ttl_s: float = Field(300.0, ge=30, le=86_400, description="Lifetime of the signed 'latest version' DHT "
                                "record; it is republished every fifth of this.")
    # the signed calls over libp2p (coordinator.roles.p2p_relay; docs/protocol.md §6b)
    calls: bool = Field(True, description="Also serve the signed calls (register, lease, release, results) on the "
                        "libp2p peer, relayed to the API over loopback HTTP (`join --p2p-jobs`).")
    calls_at_once: int = Field(32, ge=1, le=4096, description="Signed calls relayed at once, all peers together "
                               "(each holds one loopback connection to the API, so server.max_connections_per_address "
                               "caps it too). Over it: 503 rate_limited.")
    calls_per_peer: int = Field(4, ge=1, le=1024, description="Signed calls one libp2p peer may have in flight at "
                                "once. Over it: 429 rate_limited.")
    peers_per_address: int = Field(16, ge=1, le=100_000, description="libp2p peer ids one IP address (its "
                                   "connection's observed address; a relay circuit's relay) may call from within "
                                   "peer_window_s. A peer id costs nothing to make, so over it a new id's call is "
                                   "refused (429 rate_limited); every call is charged to the IP anyway.")
    peer_window_s: float = Field(600.0, gt=0, le=86_400, description="How long a peer id counts towards its "
                                 "address's peers_per_address after its last call.")
    call_timeout_s: float = Field(60.0, ge=30, le=7200, description="Longest wait of the relay for the API's reply "
                                  "to one call (above jobs.long_poll_s); past it the caller gets 503 unavailable "
                                  "and resends.")

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, v: list[str]) -> list[str]:
        for m in v:
            if not re.fullmatch(r"(/[A-Za-z0-9._-]+)+", m):
                raise ValueError(f"{m!r} is not a multiaddr; write e.g. '/ip4/0.0.0.0/tcp/8471'")
        return v
