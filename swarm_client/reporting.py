"""What the client says and what it reports: its lines (the terminal or the panel, and the log file), its state,
and status.json (read by `echo-swarm client status` and the control page).

One object for both because every line and every state change lands in the same three places (the panel, the log,
the status file) and with several runs in one process each line says which coordinator it is about: the join loop's
other parts (swarm_client/leasing.py, generation.py, gates.py, downloads.py, submissions.py) are each handed this
:class:`Reporter` rather than the whole runner.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field

from swarm_client import logs
from swarm_client.bandwidth import MB, MonthlyMeter, Throttle
from swarm_client.control import write_status
from swarm_client.pacing import Pacer
from swarm_client.panel import Display
from swarm_client.peer_calls import PeerCalls
from swarm_client.peer_fetch import ClientPeer
from swarm_client.settings import JoinConfig
from swarm_client.shares import Shares

#: the join loop's lines keep the logger name they always had in client.log (grep-able across versions)
logger = logging.getLogger("swarm_client.runner")

#: The state of a client holding its job in progress because someone uses the machine (--idle-only).
IN_USE_STATE = "paused: someone is using this machine"
#: The state of a client whose run has finished (the panel, `client status`, the control page).
FINISHED_STATE = "run finished — waiting for the operator's next run"
UNREACHABLE_STATE = "coordinator unreachable — retrying"


@dataclass
class ClientStats:
    pid: int = field(default_factory=os.getpid)
    client_id: str = ""
    version: int = -1
    accepted: int = 0
    rejected: int = 0
    credit: float = 0.0
    tokens: int = 0
    last_job: str = ""
    tokens_per_s: float = 0.0
    state: str = "starting"
    rejections: dict[str, int] = field(default_factory=dict)
    leases: int = 0  # jobs received from the coordinator
    gated_polls: int = 0  # polls spent not fetching work (paused, outside a window, not idle)
    benchmark_tokens_per_s: float | None = None
    download: str = ""  # the snapshot file being downloaded: bytes, rate, time left ("" when none)
    p2p: dict[str, int] = field(default_factory=dict)  # `--p2p`: bytes served to / received from peers, fallbacks
    run_id: str = ""
    url: str = ""
    bandwidth: str = ""  # data used this month, the cap, the rate limit (for the panel and the control page)
    job_steps: int = 0  # decoding steps of the job being generated (its progress)
    job_expected_steps: int = 0  # the most it can take (max_tokens × rollouts decoded one by one)
    job_started_at: float = 0.0  # unix time
    history: list[dict[str, object]] = field(default_factory=list)  # the latest results, newest last
    # why the client stopped, when an error stopped it (a ban, a key change…): kept in status.json after the exit so
    # `client status` and the control page still say it when the panel is gone or a service stopped unseen
    stop_reason: str = ""
    exit_code: int | None = None  # set once the client has stopped
    notices: list[dict[str, object]] = field(default_factory=list)  # the coordinator's notices in force (notices.py)
    # with --attach: every run of this client — its coordinator, share, share of the work (and of the generation
    # time) so far, state, results and credit (swarm_client/multirun.py)
    runs: list[dict[str, object]] = field(default_factory=list)


class Reporter:
    """One run's lines, state and status file. ``shares``: the machine's generation slot when this is one of several
    runs (its lines are then tagged with the coordinator's URL, and its status lists every run's share); ``meter``
    and ``throttle``: the data budget and download cap the status describes."""

    def __init__(self, cfg: JoinConfig, shares: Shares | None, meter: MonthlyMeter, throttle: Throttle) -> None:
        self.cfg = cfg
        self.shares = shares
        self.meter = meter
        self.throttle = throttle
        self.stats = ClientStats()
        self.display = Display(self.stats, live=cfg.panel, url=cfg.url)
        self.accepted_before = self.rejected_before = 0  # this client's totals from earlier sessions
        self.pacer: Pacer | None = None  # the job in hand's pacer: its steps are the job's progress
        self.peer: ClientPeer | None = None  # `--p2p`: the figures status.json shows of this client's peer
        self.calls: PeerCalls | None = None  # `--p2p-jobs`
        self.attached: list[Reporter] = []  # the other runs of this process, on URL's run (swarm_client/multirun.py)
        self.parent: Reporter | None = None  # on an attached run: URL's, whose status lists every run
        self._state_before_outage: str | None = None

    # -- lines --------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        text = self._tagged(text)
        self.display.say(text)
        logger.info("%s", text, extra={logs.SHOWN: True})

    def error(self, text: str) -> None:
        """An error line: on stderr (and in the log file). Every caller then stops the client, so the line is also
        the reason it stopped (status.json: `client status`, the control page)."""
        text = self.stats.stop_reason = self._tagged(text)
        self.display.error(text)
        logger.error("%s", text, extra={logs.SHOWN: True})

    def warn(self, text: str) -> None:
        """A warning or a retry line: on stderr, beside the panel (and in the log file)."""
        text = self._tagged(text)
        self.display.error(text)
        logger.warning("%s", text, extra={logs.SHOWN: True})

    def _tagged(self, text: str) -> str:
        """With several runs in one process, each line says which coordinator it is about."""
        return f"[{self.cfg.url}] {text}" if self.shares is not None else text

    def session(self) -> tuple[int, int]:
        """Results accepted and refused in this session (the totals less those of earlier sessions)."""
        return self.stats.accepted - self.accepted_before, self.stats.rejected - self.rejected_before

    # -- state and status ---------------------------------------------------------------------------------
    def on_outage(self, what: str | None) -> None:
        """The coordinator was lost (``what`` failed) or answers again (None): one line each, not per attempt."""
        if what is not None:
            limit = self.cfg.give_up_after_s
            self.warn(f"lost the coordinator at {self.cfg.url} ({what}); retrying with backoff (at most "
                      f"{self.cfg.retry_max_s:g}s apart) " + ("until it is back" if limit is None else
                                                              f"for up to {limit:g}s"))
            self._state_before_outage = self.stats.state
            self.set_state(UNREACHABLE_STATE)
        else:
            self.say(f"the coordinator at {self.cfg.url} answers again")
            if self.stats.state == UNREACHABLE_STATE:
                self.set_state(self._state_before_outage or "waiting")

    def set_state(self, state: str) -> None:
        if state != self.stats.state:
            self.stats.state = state
            self.display.update()
            self.write_status()

    def current(self) -> dict[str, object]:
        """The counters as they are now, the job in hand's progress included (for the control page)."""
        self._progress()
        return asdict(self.stats)

    def _progress(self) -> None:
        """The job in hand's decoding steps, read from its pacer while it generates (or is held)."""
        if self.pacer is not None and self.stats.state in ("generating", IN_USE_STATE):
            self.stats.job_steps = self.pacer.steps

    def write_status(self) -> None:
        if self.peer is not None:
            self.stats.p2p = {"served_bytes": self.peer.served_bytes, "received_bytes": self.peer.stats.peer_bytes,
                              "wasted_bytes": self.peer.stats.wasted_bytes, "fallbacks": self.peer.stats.fallbacks}
            if self.calls is not None:
                self.stats.p2p |= {"calls": self.calls.sent, "call_fallbacks": self.calls.fallbacks}
        self.stats.bandwidth = self.meter.describe() + (
            f" · limit {self.throttle.rate / MB:g} MB/s" if self.throttle.rate else "")
        self._progress()
        self.meter.flush()
        if self.attached:
            self.stats.runs = self.runs()
        try:
            write_status(self.cfg.home, asdict(self.stats))
        except OSError as exc:  # e.g. disk full: the status file is a convenience, never a reason to stop
            logger.warning("could not write %s: %s", self.cfg.home / "status.json", exc)
        if self.parent is not None:
            self.parent.write_status()

    def runs(self) -> list[dict[str, object]]:
        """Every run of this process with its share (swarm_client/shares.py) and standing."""
        shares = {v["run"]: v for v in self.shares.view()} if self.shares is not None else {}
        return [shares.get(r.cfg.url, {}) | {"url": r.cfg.url, "run_id": r.stats.run_id, "state": r.stats.state,
                                            "accepted": r.stats.accepted, "rejected": r.stats.rejected,
                                            "credit": r.stats.credit} for r in (self, *self.attached)]
