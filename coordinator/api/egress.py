"""Snapshot bytes out of the coordinator, over HTTP and over its libp2p peer, for ``GET /v1/p2p`` and the status
page's egress.

The peer runs in the p2p role (coordinator.roles.p2p): in the process layout the API reads that role's last report
from the store (``remote``); in the one-process layout the launcher hands it the peer itself (``peer``). Either way
the API only reads a report, so it never imports the peer (nor hivemind, nor torch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypedDict

from coordinator.run.records import P2PReport
from shared.messages import P2PInfo


class PeerReporter(Protocol):
    """What the API reads of a peer running in its own process: its report (peer id, addresses, bytes served)."""

    def report(self) -> P2PReport: ...


class EgressView(TypedDict):
    """The status page's ``snapshot_egress``: snapshot bytes out of the coordinator (HTTP, libp2p) and between
    volunteers."""

    p2p: bool
    http_bytes: int
    p2p_bytes: int
    coordinator_bytes: int
    peer_bytes: int


def stored_report(raw: Mapping[str, object] | None) -> P2PReport | None:
    """The p2p role's report as the store keeps it (its role status), or None before its first."""
    return None if raw is None else P2PReport.model_validate(raw)


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
    remote: Callable[[], P2PReport | None] | None = None  # process layout: the p2p role's last report

    def report(self) -> P2PReport | None:
        if self.peer is not None:
            return self.peer.report()
        return self.remote() if self.remote is not None else None

    def info(self) -> P2PInfo:
        r = self.report()
        if r is None or not r.peer_id:
            return P2PInfo(enabled=False)
        return P2PInfo(enabled=True, peer_id=r.peer_id, maddrs=list(r.maddrs)[:16])

    def view(self, stored_http_bytes: int = 0) -> EgressView:
        """``stored_http_bytes``: the store's counter (every API process, every restart) — the run's total is it
        plus what this process has not added yet."""
        r = self.report() or P2PReport()
        p2p = r.served_bytes
        http = stored_http_bytes + self.http_bytes - self.http_flushed
        return {"p2p": bool(r.peer_id), "http_bytes": http, "p2p_bytes": p2p,
                "coordinator_bytes": http + p2p, "peer_bytes": r.peer_served_bytes}

    def flush(self, add: Callable[[int], None]) -> None:
        """Add the HTTP bytes counted since the last flush to the store (``add``)."""
        delta = self.http_bytes - self.http_flushed
        if delta > 0:
            add(delta)
            self.http_flushed += delta
