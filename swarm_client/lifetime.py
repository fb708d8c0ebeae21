"""A volunteer's lifetime statistics: credit and results per run and in total, kept in the client's home across
runs and restarts (BOINC's statistics tab, Folding@home's points history).

The coordinator is the authority on what it accepted and credited, but only for its own run: a new run is a new
database, and its status page lists the top volunteers only. So the client keeps a ledger of its own,
``lifetime.json`` in its home: one entry per run and identity with the latest totals it knows there, and a thinned
series of (time, lifetime credit) points for the control page's plot.

Nothing is counted twice. Credit is the coordinator's own running total for this identity in that run (each
accepted result's ``total_credit``; the status page's figure when the client starts), so a restart that reads it
again overwrites, never adds. The result counts are the client's own tally of the replies it got ("accepted" or a
refusal), raised to the coordinator's figures where its status page shows them — so a result whose reply was lost
is counted when the coordinator says so, and never once per resend.

A damaged file is set aside (``lifetime.json.damaged``) and a new ledger started: statistics are never a reason to
stop working.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE = "lifetime.json"
MAX_POINTS = 512  # the plot's series; beyond it the older half is thinned (every second point dropped)
MAX_RUNS = 1_000  # entries kept; the oldest (by last activity) go first — their credit stays in ``retired``


@dataclass
class RunTotals:
    """What one identity did in one run, as far as this client knows."""

    url: str
    run_id: str
    client_id: str
    first_at: float
    last_at: float
    accepted: int = 0
    rejected: int = 0
    credit: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunTotals:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Lifetime:
    """The ledger in ``home``: read at start, written (atomically) after every change."""

    def __init__(self, home: Path, clock: Callable[[], float] = time.time, *, readonly: bool = False) -> None:
        """``readonly``: a reader beside the running client (`client status`), which neither saves nor moves a
        damaged file aside."""
        self.path = Path(home) / FILE
        self.clock = clock
        self.readonly = readonly
        self.runs: dict[str, RunTotals] = {}
        self.points: list[list[float]] = []  # [unix time, lifetime credit], oldest first
        self.retired = {"runs": 0, "accepted": 0, "rejected": 0, "credit": 0.0}  # entries dropped beyond MAX_RUNS
        self._load()

    # -- what the client tells it -------------------------------------------------------------------------
    def joined(self, url: str, run_id: str, client_id: str, *, accepted: int | None = None,
               rejected: int | None = None, credit: float | None = None) -> None:
        """Registered with ``run_id``; the coordinator's totals for this identity there, where it published them."""
        entry = self._entry(url, run_id, client_id)
        if accepted is not None:
            entry.accepted = max(entry.accepted, accepted)
        if rejected is not None:
            entry.rejected = max(entry.rejected, rejected)
        if credit is not None:
            entry.credit = max(entry.credit, credit)
        self._changed(entry)

    def result(self, url: str, run_id: str, client_id: str, *, accepted: bool,
               total_credit: float | None = None) -> None:
        """A reply to a result: accepted (with the identity's credit in the run now) or refused."""
        entry = self._entry(url, run_id, client_id)
        if accepted:
            entry.accepted += 1
            if total_credit is not None:
                entry.credit = total_credit  # the coordinator's running total: authoritative
        else:
            entry.rejected += 1
        self._changed(entry)

    # -- what it shows ------------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """Runs, results and credit over the client's whole life (this home), and since when."""
        runs = list(self.runs.values())
        return {"runs": len(runs) + int(self.retired["runs"]),
                "accepted": sum(r.accepted for r in runs) + int(self.retired["accepted"]),
                "rejected": sum(r.rejected for r in runs) + int(self.retired["rejected"]),
                "credit": sum(r.credit for r in runs) + float(self.retired["credit"]),
                "since": min((r.first_at for r in runs), default=None)}

    def recent(self, n: int = 20) -> list[dict[str, Any]]:
        """The ``n`` runs with the latest activity, newest first."""
        return [asdict(r) for r in sorted(self.runs.values(), key=lambda r: -r.last_at)[:n]]

    def view(self) -> dict[str, Any]:
        """For the control page: the totals, the recent runs and the credit series."""
        return {"total": self.totals(), "runs": self.recent(), "points": self.points}

    # -- the file -----------------------------------------------------------------------------------------
    def _entry(self, url: str, run_id: str, client_id: str) -> RunTotals:
        key = f"{run_id}/{client_id}"  # a run id is the coordinator's, unique per run; the URL may change
        entry = self.runs.get(key)
        if entry is None:
            now = self.clock()
            entry = self.runs[key] = RunTotals(url=url, run_id=run_id, client_id=client_id, first_at=now, last_at=now)
            self._retire()
        entry.url = url
        return entry

    def _retire(self) -> None:
        while len(self.runs) > MAX_RUNS:
            key = min(self.runs, key=lambda k: self.runs[k].last_at)
            old = self.runs.pop(key)
            for name in ("accepted", "rejected", "credit"):
                self.retired[name] += getattr(old, name)
            self.retired["runs"] += 1

    def _changed(self, entry: RunTotals) -> None:
        now = entry.last_at = self.clock()
        credit = self.totals()["credit"]
        if not self.points or self.points[-1][1] != credit:
            self.points.append([now, credit])
            if len(self.points) > MAX_POINTS:
                half = len(self.points) // 2
                self.points = self.points[:half:2] + self.points[half:]
        self._save()

    def _load(self) -> None:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            logger.warning("could not read %s (%s): lifetime statistics start anew this session", self.path, exc)
            return
        try:
            data = json.loads(raw)
            self.runs = {str(k): RunTotals.from_json(v) for k, v in data.get("runs", {}).items()}
            self.points = [[float(t), float(c)] for t, c in data.get("points", [])]
            self.retired |= {k: data.get("retired", {}).get(k, v) for k, v in self.retired.items()}
        except (ValueError, TypeError, AttributeError) as exc:
            damaged = self.path.with_name(FILE + ".damaged")
            logger.warning("%s is damaged (%s): kept as %s, lifetime statistics start anew", self.path, exc, damaged)
            self.runs, self.points = {}, []
            if not self.readonly:
                with contextlib.suppress(OSError):  # if it cannot be moved aside, the next save overwrites it
                    os.replace(self.path, damaged)

    def _save(self) -> None:
        if self.readonly:
            return
        data = {"runs": {k: asdict(v) for k, v in self.runs.items()}, "points": self.points, "retired": self.retired}
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError as exc:  # e.g. disk full: statistics are a convenience, never a reason to stop
            logger.warning("could not write %s: %s", self.path, exc)
