"""Snapshot bytes out of the coordinator, over HTTP and over its libp2p peer, for ``GET /v1/p2p`` and the status
page's egress.

The peer runs in the p2p role (coordinator.roles.p2p): in the process layout the API reads that role's last report
from the store (``remote``); in the one-process layout the launcher hands it the peer itself (``peer``). Either way
the API only reads a report, so it never imports the peer (nor hivemind, nor torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from shared.messages import P2PInfo


class PeerReporter(Protocol):
    """What the API reads of a peer running in its own process: its report (peer id, addresses, bytes served)."""

    def report(self) -> dict[str, Any]: ...


#: The meta counter of snapshot bytes sent over HTTP (the status page's "snapshots out", across restarts).
EGRESS_COUNTER = "counter:snapshot_http_bytes"
EGRESS_FLUSH_S = 10.0


@dataclass
class SnapshotEgress:
    """Snapshot file bytes that left the coordinator (HTTP and libp2p) against bytes volunteers say they served
    each other, for the status page (``snapshot_egress``) and bench/egress.py."""

    http_bytes: int = 0  # since this process started
    http_flushed: int = 0  # of http_bytes, what has been added to the store's counter (EGRESS_COUNTER)
    peer: PeerReporter | None = None  # one-process layout: the peer in this process
    remote: Callable[[], dict[str, Any] | None] | None = None  # process layout: the p2p role's last report

    def report(self) -> dict[str, Any] | None:
        if self.peer is not None:
            return self.peer.report()
        return self.remote() if self.remote is not None else None

    def info(self) -> P2PInfo:
        r = self.report()
        if not r or not r.get("peer_id"):
            return P2PInfo(enabled=False)
        return P2PInfo(enabled=True, peer_id=r["peer_id"], maddrs=list(r.get("maddrs", []))[:16])

    def view(self, stored_http_bytes: int = 0) -> dict[str, Any]:
        """``stored_http_bytes``: the store's counter (every API process, every restart) — the run's total is it
        plus what this process has not added yet."""
        r = self.report() or {}
        p2p = int(r.get("served_bytes", 0))
        http = stored_http_bytes + self.http_bytes - self.http_flushed
        return {"p2p": bool(r.get("peer_id")), "http_bytes": http, "p2p_bytes": p2p,
                "coordinator_bytes": http + p2p, "peer_bytes": int(r.get("peer_served_bytes", 0))}

    def flush(self, add: Callable[[int], None]) -> None:
        """Add the HTTP bytes counted since the last flush to the store (``add``)."""
        delta = self.http_bytes - self.http_flushed
        if delta > 0:
            add(delta)
            self.http_flushed += delta
