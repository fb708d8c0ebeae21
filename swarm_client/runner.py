"""The `join` loop: lease → fetch the job's snapshot → generate → submit, until stopped.

Sequential pull: every job names the policy version it must be generated with, and the client fetches
that version (verified against the signed manifest) before generating. Ctrl-C (or SIGTERM) finishes the
current decoding step, releases the lease so the job is reissued at once, and exits cleanly; a second
Ctrl-C exits immediately.

A client people leave running for months: the first contact happens before anything is written, so a wrong URL
fails at once with a message of its own (swarm_client/api.py); once joined, an outage is waited out with one line
when the coordinator is lost and one when it is back; when the run finishes the client stops leasing, says so, and
joins the operator's next run at the same URL (``_await_next_run``); `echo-swarm client finish` ends it after the
job in hand.

Before every lease the client asks swarm_client/schedule.py whether it may start work (pause, snooze, battery, the
monthly data budget, time windows, `--idle-only`); before downloading a version it checks memory and disk
(swarm_client/resources.py), and before loading one for a job, memory again from the verified files and the job's
batch (swarm_client/footprint.py). The panel is swarm_client/panel.py, the control and status files
swarm_client/control.py (and the local control page swarm_client/webcontrol.py), the settings
swarm_client/settings.py, the config file swarm_client/config.py, the log swarm_client/logs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp

from shared import PROTOCOL_VERSION, safe_text
from shared.adapters import ADAPTER_WEIGHTS
from shared.endpoints import LEASE, REGISTER, RELEASE, RESULTS, STATUS
from shared.errors import EchoSwarmError, IntegrityError, ProtocolError, Reason
from shared.exit_codes import ExitCode
from shared.messages import (
    Completion,
    Info,
    Job,
    LeaseRequest,
    LeaseResponse,
    Manifest,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ResultSubmission,
)
from shared.records import open_job
from swarm_client import logs
from swarm_client.api import (
    ClientStopping,
    CoordinatorClient,
    CoordinatorUnreachable,
    NotACoordinator,
    RetryPolicy,
    refusal_code,
)
from swarm_client.backends import Backend, backend_forms, backend_kind, make_backend
from swarm_client.bandwidth import GB, MB, USAGE_FILE, MonthlyMeter, Throttle
from swarm_client.benchmark import run_benchmark
from swarm_client.blob_fetch import DownloadStalled, Transfer
from swarm_client.control import Controls, read_controls, update_controls, write_status
from swarm_client.episodes import play_job
from swarm_client.footprint import (
    BF16_BYTES,
    DEFAULT_BATCH,
    TORCH_DTYPE_BYTES,
    Batch,
    Need,
    Weights,
    llama_need,
    llama_need_from,
    read_shape,
    torch_need,
    torch_need_from,
    torch_weights,
)
from swarm_client.hardware import Hardware, detect, free_disk_gb, profile, total_memory_gb
from swarm_client.identity import CoordinatorKeyChanged, Identity, load_identity, pin_coordinator
from swarm_client.lifetime import Lifetime
from swarm_client.notices import NoticeWatch
from swarm_client.panel import Display
from swarm_client.paths import ClientPaths, migrate_cache
from swarm_client.peer_calls import PeerCalls
from swarm_client.peer_fetch import ClientPeer, PeerSettings
from swarm_client.precision import choose_precision, offered_precisions
from swarm_client.presence import input_idle_s, on_battery
from swarm_client.resources import (
    GIB,
    Limits,
    ResourceRefusal,
    check_disk,
    check_gpu_memory,
    check_memory,
    disk_full_message,
)
from swarm_client.schedule import INPUT_CHECK_S, IdleProbe, InputWatch, parse_window, work_gate
from swarm_client.settings import JoinConfig
from swarm_client.shares import Shares, Turn
from swarm_client.snapshots import SnapshotCache, wanted_files
from swarm_client.webcontrol import ControlPage, PageSource

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_REFUSED, EXIT_RESOURCES = ExitCode.OK, ExitCode.REFUSED, ExitCode.RESOURCES
EXIT_UNREACHABLE, EXIT_NOT_A_COORDINATOR = ExitCode.UNREACHABLE, ExitCode.NOT_A_COORDINATOR
STOP_CODES = {"banned", "quarantined"}  # refusals that end the client: retrying cannot help
#: Refusals that say nothing about this client's result (the coordinator's timing or state: a version pruned, a
#: verifier busy, a lease run out or reissued): retried as usual, but after a streak of them the client backs off
#: (:func:`setback_delay`) instead of computing one job after another that meets the same refusal.
SETBACKS = {Reason.VERSION_RETIRED, Reason.UNAVAILABLE, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER,
            Reason.JOB_COMPLETED, Reason.REWARD_FAILED}
SETBACK_GRACE = 2  # setbacks in a row taken without a pause
SETBACK_MAX_S = 300.0


def setback_delay(streak: int) -> float:
    """Seconds to wait before the next lease after ``streak`` setbacks in a row: none for the first SETBACK_GRACE,
    then 5 s doubling up to SETBACK_MAX_S. An accepted result ends the streak."""
    return 0.0 if streak <= SETBACK_GRACE else min(SETBACK_MAX_S, 5.0 * 2 ** (streak - SETBACK_GRACE - 1))


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


class Pacer:
    """Throttles decoding to a duty cycle: after each step that took t seconds, idle t·(100/p − 1). Counts the
    steps of the job in hand (its progress, for the panel and the control page). With ``watch`` (``--idle-only``)
    it also holds the job while someone uses the machine (swarm_client.schedule.InputWatch), telling
    ``on_hold(True)`` then ``on_hold(False)`` (called on the generating thread)."""

    def __init__(self, percent: float, stop: threading.Event, watch: InputWatch | None = None,
                 on_hold: Callable[[bool], None] | None = None) -> None:
        self.factor = 100.0 / percent - 1.0
        self.stop = stop
        self.watch = watch
        self.on_hold = on_hold
        self.last = time.monotonic()
        self.looked = self.last
        self.steps = 0

    def reset(self) -> None:
        self.last = self.looked = time.monotonic()
        self.steps = 0

    def __call__(self) -> bool:
        self.steps += 1
        now = time.monotonic()
        until = now + (now - self.last) * self.factor if self.factor > 0 else now
        while True:  # the duty cycle's rest, in slices short enough to notice someone using the machine
            if self.watch is not None and time.monotonic() - self.looked >= INPUT_CHECK_S:
                self._hold_while_in_use(self.watch)
            left = until - time.monotonic()
            if left <= 0 or self.stop.wait(min(left, INPUT_CHECK_S)):
                break
        self.last = time.monotonic()
        return self.stop.is_set()

    def _hold_while_in_use(self, watch: InputWatch) -> None:
        self.looked = time.monotonic()
        if not watch.touched():
            return
        if self.on_hold is not None:
            self.on_hold(True)
        while not self.stop.wait(INPUT_CHECK_S) and not watch.left_alone():
            pass
        self.looked = time.monotonic()
        if self.on_hold is not None:
            self.on_hold(False)


#: The state of a client holding its job in progress because someone uses the machine (--idle-only).
IN_USE_STATE = "paused: someone is using this machine"
GATE_POLL_S = 1.0  # how often a paused / waiting client re-reads its control file and the clock
PULL_WAIT_S = 30.0  # longest an idle client waits for an announced version to arrive before asking again
FINISHED_POLL_S = 15.0  # a client whose run has finished asks whether a new run has started after this long,
FINISHED_POLL_MAX_S = 300.0  # then twice as long each time up to this: a finished run's swarm costs little
BATTERY_POLL_S = 10.0  # how often the power supply is read (a pmset subprocess on macOS)
HISTORY = 20  # results kept in the status for the control page
#: The state of a client whose run has finished (the panel, `client status`, the control page).
FINISHED_STATE = "run finished — waiting for the operator's next run"
UNREACHABLE_STATE = "coordinator unreachable — retrying"
PAGE_LINGER_S = 3.0  # how long a client stopped by an error waits for an open control page to read the reason
NEW_RUN = -1  # _work's outcome when the coordinator now serves another run: join it


class _Next(enum.Enum):
    """What a step of _work's turn says when it returns no exit code: go on to the turn's next step, or start the
    next turn."""

    LEASE = "lease"
    AGAIN = "again"


class Runner:
    def __init__(self, cfg: JoinConfig, shares: Shares | None = None, control_home: Path | None = None) -> None:
        """``shares``: the machine's generation slot when this is one of several runs (swarm_client/multirun.py);
        ``control_home``: where the pause / snooze / finish controls are read (the client's home: one set of
        controls for all its runs; default ``cfg.home``)."""
        self.cfg = cfg
        self.shares = shares
        self.control_home = control_home or cfg.home
        self.attached: list[Runner] = []  # the other runs of this process, on URL's runner (swarm_client/multirun.py)
        self.parent: Runner | None = None  # on an attached run's runner: URL's, whose status lists every run
        self.stop = threading.Event()
        self.stats = ClientStats()
        self.display = Display(self.stats, live=cfg.panel, url=cfg.url)
        self._download_decile = -1
        self.windows = [parse_window(w) for w in cfg.windows]
        self.hardware: Hardware | None = None
        self.prefetch: asyncio.Task[object] | None = None
        self.calls: PeerCalls | None = None  # `--p2p-jobs`: signed calls over libp2p (swarm_client/peer_calls.py)
        self.peer: ClientPeer | None = None  # `--p2p`: this client's libp2p peer (swarm_client/peer_fetch.py)
        self.device = "cpu"  # the backend's device, once created
        self._forms: frozenset[str] | None = None  # the snapshot file forms the backend needs (None: all)
        # the GGUF precision a llama.cpp client leases in (swarm_client.precision), once chosen from a manifest
        self._precision: str | None = None
        self._precision_chosen = False
        self._file_precision: str | None = None  # the GGUF precision of the job in hand (what the pre-check sizes)
        self._setbacks = 0  # refusals in a row that were not about this client's result (SETBACKS)
        self.accepted_before = self.rejected_before = 0  # this client's totals from earlier sessions
        self.ready_version = -1  # the newest version fetched and verified ahead of need (push-pull prefetch)
        self.prefetch_target = -1  # the newest version a lease reply asked this client to prefetch
        self._submitting: asyncio.Task[None] | None = None  # the previous job's result, submitted in the background
        # called with (monotonic seconds, job, tokens) for each accepted result: bench/client_overhead.py times
        # the real loop with it
        self.on_result: Callable[[float, Job, int], None] | None = None
        self.backend: Backend | None = None
        self._batch = DEFAULT_BATCH  # the batch of the job in hand (or the last one): what the memory checks assume
        self.paths = ClientPaths.of(cfg.home, cfg.cache_dir, cfg.log_dir)
        self.meter = MonthlyMeter(cfg.home / USAGE_FILE,
                                  None if cfg.max_gb_per_month is None else int(cfg.max_gb_per_month * GB))
        self.throttle = Throttle(None if cfg.max_mbps is None else cfg.max_mbps * MB)
        self.controls = Controls()  # the last read of control.json
        self._battery: tuple[float, bool] = (-1e9, False)  # (monotonic time read, on battery)
        self._state_before_outage: str | None = None
        self.next_info: Info | None = None  # the new run _work found (NEW_RUN)
        self.pacer: Pacer | None = None
        self._gated: str | None = None  # the gate holding the client, as last said (None: none)
        self._coordinator_paused = False  # the coordinator's pause, as last said
        self.page: ControlPage | None = None  # the local control page (swarm_client/webcontrol.py)
        self.notices = NoticeWatch(cfg.home, self.display.software, self._say)
        self.lifetime = Lifetime(cfg.home)  # credit and results per run, across runs and restarts
        self.idle_probe = IdleProbe(cfg.idle_min_percent / 100, input_idle=input_idle_s,
                                    min_input_idle_s=cfg.idle_input_minutes * 60) if cfg.idle_only else None

    # -- output -------------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        text = self._tagged(text)
        self.display.say(text)
        logger.info("%s", text, extra={logs.SHOWN: True})

    def _error(self, text: str) -> None:
        """An error line: on stderr (and in the log file). Every caller then stops the client, so the line is also
        the reason it stopped (status.json: `client status`, the control page)."""
        text = self.stats.stop_reason = self._tagged(text)
        self.display.error(text)
        logger.error("%s", text, extra={logs.SHOWN: True})

    def _warn(self, text: str) -> None:
        """A warning or a retry line: on stderr, beside the panel (and in the log file)."""
        text = self._tagged(text)
        self.display.error(text)
        logger.warning("%s", text, extra={logs.SHOWN: True})

    def _tagged(self, text: str) -> str:
        """With several runs in one process, each line says which coordinator it is about."""
        return f"[{self.cfg.url}] {text}" if self.shares is not None else text

    def _on_outage(self, what: str | None) -> None:
        """The coordinator was lost (``what`` failed) or answers again (None): one line each, not per attempt."""
        if what is not None:
            limit = self.cfg.give_up_after_s
            self._warn(f"lost the coordinator at {self.cfg.url} ({what}); retrying with backoff (at most "
                       f"{self.cfg.retry_max_s:g}s apart) " + ("until it is back" if limit is None else
                                                               f"for up to {limit:g}s"))
            self._state_before_outage = self.stats.state
            self._set_state(UNREACHABLE_STATE)
        else:
            self._say(f"the coordinator at {self.cfg.url} answers again")
            if self.stats.state == UNREACHABLE_STATE:
                self._set_state(self._state_before_outage or "waiting")

    def _write_status(self) -> None:
        if self.peer is not None:
            self.stats.p2p = {"served_bytes": self.peer.served_bytes, "received_bytes": self.peer.stats.peer_bytes,
                              "wasted_bytes": self.peer.stats.wasted_bytes, "fallbacks": self.peer.stats.fallbacks}
            if self.calls is not None:
                self.stats.p2p |= {"calls": self.calls.sent, "call_fallbacks": self.calls.fallbacks}
        self.stats.bandwidth = self.meter.describe() + (
            f" · limit {self.throttle.rate / MB:g} MB/s" if self.throttle.rate else "")
        if self.pacer is not None and self.stats.state in ("generating", IN_USE_STATE):
            self.stats.job_steps = self.pacer.steps
        self.meter.flush()
        if self.attached:
            self.stats.runs = self.runs()
        try:
            write_status(self.cfg.home, asdict(self.stats))
        except OSError as exc:  # e.g. disk full: the status file is a convenience, never a reason to stop
            logger.warning("could not write %s: %s", self.cfg.home / "status.json", exc)
        if self.parent is not None:
            self.parent._write_status()

    def runs(self) -> list[dict[str, object]]:
        """Every run of this process with its share (swarm_client/shares.py) and standing."""
        shares = {v["run"]: v for v in self.shares.view()} if self.shares is not None else {}
        return [shares.get(r.cfg.url, {}) | {"url": r.cfg.url, "run_id": r.stats.run_id, "state": r.stats.state,
                                            "accepted": r.stats.accepted, "rejected": r.stats.rejected,
                                            "credit": r.stats.credit} for r in (self, *self.attached)]

    def _set_state(self, state: str) -> None:
        if state != self.stats.state:
            self.stats.state = state
            self.display.update()
            self._write_status()

    # -- main loop ----------------------------------------------------------------------------------------
    async def run(self) -> int:
        """The whole process: signals, the log, then :meth:`work`."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        log_file = logs.setup(self.paths.logs, self.cfg.log_level, self.display.error)
        logger.info("echo-swarm join %s (log %s)", self.cfg.url, log_file)
        try:
            return await self.work()
        finally:
            logs.teardown()

    async def work(self) -> int:
        """Join and work until stopped; the exit code (also written to status.json)."""
        self.stats.url = self.cfg.url
        code: int = ExitCode.FAILED
        try:
            code = await self._run()
            return code
        finally:
            self._no_job()
            if self.stats.client_id:  # joined: what it downloaded counts toward the month's budget
                self.stats.exit_code = int(code)
                self._write_status()

    async def _run(self) -> int:
        cfg = self.cfg
        api = CoordinatorClient(cfg.url, None, on_retry=self._warn, on_outage=self._on_outage,
                                retry=RetryPolicy(attempts=cfg.retries, max_s=cfg.retry_max_s,
                                                  give_up_after_s=cfg.give_up_after_s))
        api.stopping = self.stop.is_set
        try:
            info = None
            if cfg.wait_for_coordinator_s == 0:  # a wrong URL fails here, before anything is printed or written
                info = await api.info()
            backend = self._make_backend()
            if backend is None:  # not installed, or an unknown name: the message says what to install
                return ExitCode.USAGE
            if info is None:  # started with its coordinator: the backend's imports overlapped the wait
                if not await api.up(cfg.wait_for_coordinator_s):
                    self._warn(f"the coordinator at {cfg.url} did not come up within {cfg.wait_for_coordinator_s:g}s; "
                               f"trying with retries")
                info = await api.info()
            identity = await self._settle_in(api)
            return await self._serve(api, identity, backend, info)
        except ClientStopping:  # Ctrl-C while the coordinator was away: a normal stop
            self._say(f"stopped while the coordinator at {cfg.url} was unreachable: {self.stats.accepted - self.accepted_before} "
                      f"results accepted this session")
            return EXIT_OK
        except CoordinatorUnreachable as exc:
            self._error(f"error: {exc}")
            return EXIT_UNREACHABLE
        except NotACoordinator as exc:
            self._error(f"error: {exc}")
            return EXIT_NOT_A_COORDINATOR
        except CoordinatorKeyChanged as exc:
            self._error(f"error: {exc}")
            return EXIT_REFUSED
        except ResourceRefusal as exc:
            self._error(f"error: {exc}")
            return EXIT_RESOURCES
        except ProtocolError as exc:
            self._error(self._refusal_text(exc, self.stats.client_id))
            return EXIT_REFUSED
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            self._error(f"error: {disk_full_message(exc.filename or cfg.home)}")
            return EXIT_RESOURCES
        finally:
            await self._wind_down(api)

    async def _settle_in(self, api: CoordinatorClient) -> Identity:
        """A coordinator answered: from here on the client writes its state (identity, data used, status). Load or
        create the identity, detect the machine, start the panel, move an old cache, read the controls a previous
        run left, open the control page."""
        cfg = self.cfg
        api.count = self.meter.add
        identity = load_identity(cfg.home)
        api.identity = identity
        self.stats.client_id = identity.client_id
        self.hardware = detect(cfg.home)
        self.display.hardware = self.hardware.summary()
        self.display.start()
        if identity.created:
            self._say(f"created a new identity {identity.client_id} in {cfg.home}")
        self._say(f"this machine: {self.hardware.summary()}")
        moved = migrate_cache(cfg.home, self.paths.cache)
        if moved is not None:
            self._say(f"moved the snapshot cache from {moved} to {self.paths.cache} (the platform's cache folder)")
        self.controls = read_controls(self.control_home)
        if self.controls.finish:  # a finish meant for a client that has since stopped
            update_controls(self.control_home, finish=False)
        if self.controls.paused:
            self._say("paused (by `echo-swarm client pause`): no work is fetched until `echo-swarm client resume`")
        await self._start_page()
        return identity

    async def _wind_down(self, api: CoordinatorClient) -> None:
        """However the client stops: deliver a result still on its way if it can (60 s at most), stop the prefetch
        and the peer, write the last status, give an open control page one more look (so it can show why the
        client stopped), stop the panel, close the connection."""
        if self._submitting is not None:
            with contextlib.suppress(EchoSwarmError, OSError, TimeoutError):
                await asyncio.wait_for(self._settle(), timeout=60)
        if self.prefetch is not None and not self.prefetch.done():
            self.prefetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.prefetch
        if self.peer is not None:
            await self.peer.stop()
        if self.stats.client_id:
            self.stats.state = "stopped"
            self._write_status()
        if self.page is not None:
            await self.page.stop(linger_s=PAGE_LINGER_S if self.stats.stop_reason else 0.0)
        self.display.stop()
        await api.close()

    def _make_backend(self) -> Backend | None:
        """The generation backend, with its libraries' logging routed into ours (swarm_client/logs.py)."""
        try:
            backend = make_backend(self.cfg.backend, device=self.cfg.device, threads=self.cfg.threads,
                                   gpu_layers=self.cfg.gpu_layers, torch_dtype=self.cfg.torch_dtype)
        except ValueError as exc:  # unknown backend, or llama-cpp-python not installed: the message says what to do
            self._error(f"error: {exc}")
            return None

        if backend_kind(backend) == "llama":
            logs.route_llama_cpp()
        else:
            logs.quiet_transformers()
        self.backend = backend
        if self.shares is not None:  # another run's turn frees this run's model (shares.py)
            self.shares.holds_model(self.cfg.url, backend.unload)
        self.device = str(backend.device)
        self._forms = backend_forms(backend)
        return backend

    async def _start_page(self) -> None:
        """The local control page (127.0.0.1 only). A port in use is a warning, not a reason to stop working."""
        if not self.cfg.control_page:
            return
        try:
            page = ControlPage(PageSource(self.cfg.home, self._page_state, self._apply_controls))
            url = await page.start(self.cfg.control_port)
        except OSError as exc:
            self._warn(f"the control page could not listen on 127.0.0.1:{self.cfg.control_port} ({exc.strerror}); "
                       f"running without it (pass another --control-port)")
            return
        self.page = page
        self.display.page_url = url
        self._say(f"control page: {url} (open it with `echo-swarm client open`)")

    def _page_state(self) -> dict[str, object]:
        """What the control page shows: the live counters, plus the caps in force."""
        if self.pacer is not None and self.stats.state in ("generating", IN_USE_STATE):
            self.stats.job_steps = self.pacer.steps
        return asdict(self.stats) | {
            "software": self.display.software, "machine": self.display.hardware, "backend": self.device,
            "data_bytes": self.meter.used(), "data_cap_bytes": self.meter.cap_bytes, "lifetime": self.lifetime.view(),
            "runs": self.runs() if self.attached else [],
            "max_mbps": None if not self.throttle.rate else self.throttle.rate / MB,
            "config_max_mbps": self.cfg.max_mbps}

    def _apply_controls(self) -> Controls:
        """Read control.json and apply what takes effect at once (the bandwidth cap, also mid-download)."""
        controls = self.controls = read_controls(self.control_home)
        rate = controls.max_mbps if controls.max_mbps is not None else self.cfg.max_mbps
        self.throttle.set_rate(None if rate is None else rate * MB)
        return controls

    async def _start_p2p(self, cache: SnapshotCache, api: CoordinatorClient, info: Info) -> None:
        cap = self.cfg.p2p_max_upload_gb
        peer = ClientPeer(cache.blobs, PeerSettings(
            serve=self.cfg.p2p_serve, max_upload_bytes=None if cap is None else int(cap * 1e9),
            uploads=self.cfg.p2p_uploads, uploads_per_blob=self.cfg.p2p_uploads_per_blob,
            deadline_s=self.cfg.p2p_deadline_s, listen=self.cfg.p2p_listen, coordinator=self.cfg.p2p_coordinator),
            say=self._say)
        if await peer.start(api, info.run_id, info.coordinator_public_key):
            self.peer = cache.peers = peer
            if self.cfg.p2p_jobs:
                api.calls = self.calls = PeerCalls(peer, api.timeout_s, self._say)
                self._say("p2p jobs on: register, lease, release and results go to the coordinator's libp2p peer")
            self._write_status()
        elif self.cfg.p2p_jobs:
            self._say("p2p jobs off: this client's libp2p peer did not start (said above); jobs go over HTTP")

    @staticmethod
    def _refusal_text(exc: ProtocolError, client_id: str) -> str:
        code = refusal_code(exc)
        if code in STOP_CODES:
            return (f"error: the coordinator has {code} this client ({client_id}): {exc.message}\n"
                    f"It will not accept work from this client, so it stops here; retrying will not help. If you "
                    f"think this is a mistake, contact the coordinator's operator and quote the client id above.")
        return f"error: the coordinator refused this client ({code}): {exc.message}"

    def _on_signal(self) -> None:
        if self.stop.is_set():
            os._exit(130)
        self._say("stopping: finishing the current step and releasing the lease (Ctrl-C again to quit now)")
        self.stop.set()

    def _limits(self) -> Limits:
        return Limits(
            memory_bytes=None if self.cfg.max_memory_gb is None else int(self.cfg.max_memory_gb * GIB),
            total_memory_bytes=int(total_memory_gb() * GIB),
            min_free_disk_bytes=int(self.cfg.min_free_disk_gb * GIB),
            cache_max_bytes=None if self.cfg.cache_max_gb is None else int(self.cfg.cache_max_gb * GIB))

    def _is_llama(self) -> bool:
        return self.backend is not None and backend_kind(self.backend) == "llama"

    def _check_need(self, need: Need, version: int, limits: Limits | None = None) -> None:
        check_memory(need, need.model_bytes, limits or self._limits(), version)
        gpus = self.hardware.gpus if self.hardware else ()
        if self.device.startswith("cuda") and gpus:
            check_gpu_memory(need, int(gpus[0].memory_gb * GIB), gpus[0].name, version)

    def _precheck(self, manifest: Manifest, missing_bytes: int) -> None:
        """Before downloading a version: does it fit this machine's memory ceiling and disk? Only the files'
        sizes are known yet; the model's shape and dtype come from the version the backend holds (the same run,
        so almost always the same architecture), else from the fallbacks of swarm_client/footprint.py. The check
        before loading (``_check_fits``) is exact."""
        limits = self._limits()
        files = wanted_files(manifest, self._forms, self._file_precision)
        held: Path | None = getattr(self.backend, "folder", None)
        shape = like = None
        if held is not None:
            with contextlib.suppress(OSError, ValueError):
                shape = read_shape(held)
                like = None if self._is_llama() else torch_weights(held, self._torch_width())
        if self._is_llama():
            need = llama_need_from(sum(f.size for f in files if f.path.endswith(".gguf")), shape)
        else:
            weight_bytes = sum(f.size for f in files if f.path.endswith(".safetensors") and f.path != ADAPTER_WEIGHTS)
            width = self._torch_width()
            need = torch_need_from(Weights.from_file_bytes(weight_bytes, like, width), shape, self._batch, width)
        self._check_need(need, manifest.version, limits)
        check_disk(missing_bytes, int(free_disk_gb(self.cfg.home) * GIB), limits, manifest.version)

    def _torch_width(self) -> int:
        """Bytes per element the torch backend holds the model in (its compute dtype)."""
        return BF16_BYTES if getattr(self.backend, "precision", "f32") == "bf16" else TORCH_DTYPE_BYTES

    async def _lease_precision(self, cache: SnapshotCache, version: int) -> str | None:
        """The precision this client leases in: a torch backend's compute dtype ("bf16"; None for the default
        float32, what every coordinator accepts); for llama.cpp the one chosen from
        ``version``'s signed manifest (swarm_client.precision: --precision, or the best offered that fits), once
        per run. A manifest that cannot be read now leaves the choice to the next lease (the run's default
        meanwhile)."""
        if not self._is_llama():
            return "bf16" if getattr(self.backend, "precision", "f32") == "bf16" else None
        if self._precision_chosen:
            return self._precision
        try:
            manifest, _ = await cache.manifest(version)
        except ProtocolError as exc:
            logger.info("could not read version %d's manifest to choose a precision: %s", version, exc)
            return None
        offered = offered_precisions(manifest)
        chosen = choose_precision(offered, self.cfg.precision, lambda size: self._fits_gguf(size, version))
        self._precision, self._precision_chosen = chosen, True
        cache.precision = self._file_precision = chosen  # prefetches fetch the same file
        if chosen is not None and len(offered) > 1:
            self._say(f"running the {chosen} GGUF ({offered[chosen] / GIB:.2f} GiB) of the precisions this run "
                      f"offers ({', '.join(offered)})")
        return chosen

    def _fits_gguf(self, size: int, version: int) -> bool:
        """Whether a GGUF of ``size`` bytes fits this machine's memory ceiling (and GPU), as the download's
        pre-check will judge it."""
        held: Path | None = getattr(self.backend, "folder", None)
        shape = None
        if held is not None:
            with contextlib.suppress(OSError, ValueError):
                shape = read_shape(held)
        try:
            self._check_need(llama_need_from(size, shape), version)
        except ResourceRefusal:
            return False
        return True

    def _check_fits(self, folder: Path, batch: Batch, version: int) -> None:
        """Before loading a verified version to generate ``batch``: the estimate from the version's own files
        (safetensors or GGUF headers, config.json) and the batch, so that nothing passes the check to be killed
        by the OOM killer while loading or generating."""
        try:
            need = llama_need(folder) if self._is_llama() else torch_need(folder, batch, self._torch_width())
        except (OSError, ValueError) as exc:  # a verified folder reads; if not, loading it says what is wrong
            logger.info("could not estimate the memory for %s: %s", folder, exc)
            return
        self._check_need(need, version)

    def _on_battery(self) -> bool:
        """Whether this machine runs on battery, read at most every BATTERY_POLL_S (False unless asked to care)."""
        if not self.cfg.pause_on_battery:
            return False
        read_at, value = self._battery
        if time.monotonic() - read_at >= BATTERY_POLL_S:
            value = on_battery()
            self._battery = (time.monotonic(), value)
        return value

    def _held_back(self) -> bool:
        """Paused, snoozed or finishing: a job that arrives now is handed back at once."""
        c = read_controls(self.control_home)
        return c.paused or c.finish or c.snoozed(time.time())

    def _holding_from(self, loop: asyncio.AbstractEventLoop) -> Callable[[bool], None]:
        """The pacer's ``on_hold`` (called on the generating thread): the state, said and shown on the loop."""
        def on_hold(holding: bool) -> None:
            def show() -> None:
                self._say(f"{IN_USE_STATE}: the job in hand waits until nobody has touched keyboard or mouse for "
                          f"{self.cfg.idle_input_minutes:g} min" if holding else "nobody is using this machine "
                          "again: the job goes on")
                self._set_state(IN_USE_STATE if holding else "generating")
            loop.call_soon_threadsafe(show)
        return on_hold

    async def _gate(self) -> str | None:
        """Why no new work may start now (paused, snoozed, on battery, over the data cap, outside the time
        windows, machine busy), or None. Also applies a bandwidth cap set at run time."""
        controls = self._apply_controls()
        now = time.time()
        snoozed = datetime.fromtimestamp(controls.snooze_until) if controls.snoozed(now) and controls.snooze_until \
            else None
        battery = await asyncio.to_thread(self._on_battery)
        blocked = controls.paused or snoozed is not None or battery
        idle = True
        if self.idle_probe is not None and not blocked:
            idle = await asyncio.to_thread(self.idle_probe.measure, GATE_POLL_S, self.stop.wait)
        return work_gate(datetime.fromtimestamp(now), paused=controls.paused, windows=self.windows,
                         idle_only=self.cfg.idle_only, idle=idle, snoozed_until=snoozed, on_battery=battery,
                         data_cap=self.meter.blocked())

    async def _wait_unless_paused(self, seconds: float) -> None:
        """Wait as the coordinator asked, but notice a pause, snooze or finish (or Ctrl-C) within one poll."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self.stop.is_set() and not self._held_back():
            await asyncio.to_thread(self.stop.wait, min(left, GATE_POLL_S))

    def _on_download(self, transfer: Transfer | None) -> None:
        """The panel shows the transfer live; without a panel, a line at every tenth of a file."""
        self.stats.download = "" if transfer is None else transfer.describe()
        if transfer is None or self.display.live or not transfer.total:
            self._download_decile = -1
            return
        decile = 10 * transfer.done // transfer.total
        if decile != self._download_decile:
            self._download_decile = decile
            self._say(f"downloading {self.stats.download}")

    async def _benchmark(self, cache: SnapshotCache, backend: Backend, info: Info) -> None:
        self._set_state("benchmarking")
        try:
            folder = await cache.ensure(info.run_id, info.current_version, None)
        except (IntegrityError, DownloadStalled, ProtocolError) as exc:  # not fatal: jobs fetch their versions later
            self._say(f"self-benchmark skipped: no verified snapshot of version {info.current_version} ({exc})")
            return
        self._check_fits(folder, DEFAULT_BATCH, info.current_version)  # DEFAULT_BATCH: the benchmark's workload
        async with self._machine():  # another run generating meanwhile would halve the figure
            await asyncio.to_thread(backend.load, folder)
            self.stats.benchmark_tokens_per_s = await asyncio.to_thread(run_benchmark, backend)
        if self.stats.benchmark_tokens_per_s is not None:
            self._say(f"self-benchmark: {self.stats.benchmark_tokens_per_s:,.1f} tokens/s ({backend.name} on "
                      f"{backend.device})")

    async def _load_totals(self, api: CoordinatorClient, client_id: str) -> None:
        """Show the credit already earned (from the coordinator's public status), best effort; the lifetime ledger
        notes the run either way."""
        mine = None
        try:
            async with api.session.get(api.base_url + STATUS.path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                data = await r.json() if r.status == 200 else {}
            mine = next((c for c in data.get("clients", []) if c.get("client_id") == client_id), None)
            if mine:
                self.stats.accepted = self.accepted_before = int(mine.get("accepted", 0))
                self.stats.rejected = self.rejected_before = int(mine.get("rejected", 0))
                self.stats.credit = float(mine.get("credit", 0.0))
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError) as exc:
            logger.info("could not read earlier credit: %s", exc)
        known = bool(mine)  # the coordinator's figures for this identity, where its status lists it
        self.lifetime.joined(self.cfg.url, self.stats.run_id, client_id,
                             accepted=self.stats.accepted if known else None,
                             rejected=self.stats.rejected if known else None,
                             credit=self.stats.credit if known else None)

    async def _serve(self, api: CoordinatorClient, identity: Identity, backend: Backend,
                     info: Info | None = None) -> int:
        """Join the coordinator's run and work until stopped; when the run finishes, wait for the operator's next
        run at the same URL and join that (unless --exit-when-finished)."""
        self.backend = backend
        if info is None:
            wait = self.cfg.wait_for_coordinator_s
            if wait > 0 and not await api.up(wait):
                self._warn(f"the coordinator at {self.cfg.url} did not come up within {wait:g}s; trying with retries")
            info = await api.info()
        self._pin(info)
        api.patient = True  # joined: from now on outages are waited out (--give-up-after), one line each way
        cache = SnapshotCache(self.paths.cache, api, info.coordinator_public_key, precheck=self._precheck,
                              max_bytes=None if self.cfg.cache_max_gb is None else int(self.cfg.cache_max_gb * GIB),
                              forms=self._forms, on_progress=self._on_download, throttle=self.throttle,
                              count=self.meter.add)
        if self.cfg.p2p:
            await self._start_p2p(cache, api, info)
        if self.cfg.benchmark:
            await self._benchmark(cache, backend, info)  # also refuses a model too big, before registering
        while True:
            outcome = await self._work(api, identity, backend, info, cache)
            if outcome != NEW_RUN or self.next_info is None:
                break
            info, self.next_info = self.next_info, None
            self._pin(info)
            cache.coordinator_key = info.coordinator_public_key
            self._say(f"a new run ({info.run_id}) has started at {self.cfg.url}: joining it")
        await self._settle()
        if read_controls(self.control_home).finish:
            update_controls(self.control_home, finish=False)  # obeyed: the next start works normally
        self.stats.state = "stopped"
        self.display.stop()
        self._say(f"stopped: {self.stats.accepted - self.accepted_before} results accepted, "
                  f"{self.stats.rejected - self.rejected_before} refused this session; credit {self.stats.credit:,.0f}")
        return EXIT_OK

    async def _poll_notices(self, api: CoordinatorClient, info: Info, run_id: str, *, now: bool = False) -> None:
        """The coordinator's notices (swarm_client/notices.py): when due, new ones shown; the panel, status.json and
        the control page follow what is in force."""
        if await self.notices.poll(api, info.coordinator_public_key, run_id, now=now):
            self.stats.notices = self.notices.shown
            self.display.update()
            self._write_status()

    def _pin(self, info: Info) -> None:
        if info.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"coordinator speaks protocol {info.protocol}, "
                                                         f"this client {PROTOCOL_VERSION}; upgrade echo-swarm")
        expected = bytes.fromhex(self.cfg.coordinator_key) if self.cfg.coordinator_key else None
        if pin_coordinator(self.cfg.home, self.cfg.url, info.coordinator_public_key, expected=expected):
            self._say(f"pinned coordinator key {info.coordinator_public_key.hex()[:16]}… for {self.cfg.url}")

    async def _work(self, api: CoordinatorClient, identity: Identity, backend: Backend, info: Info,
                    cache: SnapshotCache) -> int:
        """Register with ``info``'s run and loop lease → fetch → generate → submit. EXIT_OK when stopped (Ctrl-C,
        `client finish`, --max-jobs, a finished run with --exit-when-finished); NEW_RUN (with ``next_info``) when
        the coordinator now serves another run. Each turn is a table of contents: the gates, the lease, a job's
        fetch and load, its generation and submission — each step its own method, answering _Next.LEASE (go on),
        _Next.AGAIN (start the next turn) or the exit code to return."""
        reg = await self._register(api, identity, backend, info)
        kind = backend_kind(backend)
        watch = InputWatch(input_idle_s, self.cfg.idle_input_minutes * 60) if self.cfg.idle_only else None
        pacer = self.pacer = Pacer(self.cfg.max_cpu_percent, self.stop, watch,
                                   self._holding_from(asyncio.get_running_loop()))
        self._gated, self._coordinator_paused = None, False
        held = -1
        while not self.stop.is_set():
            await self._poll_notices(api, info, reg.run_id)
            turn = await self._pass_gates()
            if isinstance(turn, int):
                return turn
            if turn is _Next.AGAIN:
                continue
            # "held": the newest version this client can generate with without waiting — the one it last used,
            # or a newer one already prefetched. Async push-pull binds the job to it while it is within the
            # staleness bound, so prefetching (when the coordinator asks for it) keeps rollouts as fresh as the
            # swarm allows
            held = max(held, self.ready_version)
            if await self._back_off():
                break
            resp = await self._ask_for_job(api, kind, held, cache, info)
            if isinstance(resp, int):
                return resp
            if resp is _Next.AGAIN:
                continue
            assert isinstance(resp, LeaseResponse)
            pull = self._consider_prefetch(resp, held, cache, reg.run_id)
            self._note_pause(resp.paused)
            if resp.job is None:
                turn = await self._without_job(api, resp, reg.run_id, pull)
                if isinstance(turn, int):
                    return turn
                continue
            job = open_job(resp.job, info.coordinator_public_key)
            if job.client_id != identity.client_id:
                raise ProtocolError(Reason.NOT_LEASE_HOLDER, "coordinator sent a job leased to another client")
            self.stats.leases += 1
            if self._held_back():  # paused (or finishing) while this lease request was in flight: hand the job back
                self._no_job()
                await self._release(api, job.job_id, job.lease_id)
                continue
            folder = await self._fetch_and_load(api, backend, cache, job)
            if isinstance(folder, int):
                return folder
            if not isinstance(folder, Path):
                self._no_job()
                continue
            held = self.stats.version = job.version
            turn = await self._generate_and_submit(api, backend, job, folder, kind, pacer)
            if isinstance(turn, int):
                return turn
        return EXIT_OK

    def _no_job(self) -> None:
        """No job in hand for now: with other runs on this machine, they need not wait for this one."""
        if self.shares is not None:
            self.shares.no_job(self.cfg.url)

    def _machine(self) -> contextlib.AbstractAsyncContextManager[Turn]:
        """The machine for one job's generation: this run's turn when it shares the machine with other runs
        (swarm_client/shares.py), at once otherwise."""
        if self.shares is None:
            return contextlib.nullcontext(Turn())
        return self.shares.turn(self.cfg.url)

    async def _register(self, api: CoordinatorClient, identity: Identity, backend: Backend, info: Info
                        ) -> RegisterResponse:
        """Register (or register again) with ``info``'s run, load this identity's totals there, say so, and read the
        run's notices."""
        prof = profile(backend.name, backend.device, self.cfg.name, self.hardware, self.stats.benchmark_tokens_per_s,
                       self.cfg.team)
        reg = await api.call(REGISTER, RegisterRequest(public_key=identity.public_key, profile=prof,
                                                       invite=self.cfg.invite))
        self.stats.run_id = reg.run_id
        await self._load_totals(api, reg.client_id)
        self._say(f"joined run {reg.run_id} at {self.cfg.url} as {reg.client_id[:8]} "
                  f"({backend.name} on {backend.device}, task {info.task}, version {info.current_version})")
        await self._poll_notices(api, info, reg.run_id, now=True)
        return reg

    async def _pass_gates(self) -> _Next | int:
        """The volunteer's own gates (a schedule, idle-only, battery, a pause) and `client finish`: LEASE when none
        holds the client, AGAIN after waiting a gate's poll interval, EXIT_OK when finishing."""
        gate = await self._gate()
        if self.controls.finish:
            self._say("finishing (`echo-swarm client finish`): no new job; the last result is submitted, then "
                      "the client exits")
            return EXIT_OK
        if gate != self._gated:
            self._say(f"not fetching new work: {gate}" if gate else "fetching work again")
            self._gated = gate
        if gate is not None:
            self.stats.gated_polls += 1
            self._set_state(gate)
            self._write_status()
            await asyncio.to_thread(self.stop.wait, GATE_POLL_S)
            return _Next.AGAIN
        self._set_state("waiting")
        return _Next.LEASE

    async def _back_off(self) -> bool:
        """After a streak of refusals on the coordinator's side, wait before the next job (setback_delay); True if
        the client was stopped meanwhile."""
        if (pause := setback_delay(self._setbacks)) <= 0:
            return False
        self._warn(f"{self._setbacks} results in a row refused for reasons on the coordinator's side; "
                   f"waiting {pause:g}s before the next job")
        self._set_state("backing off")
        await asyncio.to_thread(self.stop.wait, pause)
        return self.stop.is_set()

    async def _ask_for_job(self, api: CoordinatorClient, kind: str, held: int, cache: SnapshotCache, info: Info
                           ) -> LeaseResponse | _Next | int:
        """One lease request at the precision this client runs. AGAIN when the operator stopped offering the
        precision chosen (it chooses again), NEW_RUN (with ``next_info``) when the coordinator no longer knows this
        client (another run at this URL, or a store started afresh)."""
        precision = await self._lease_precision(cache, max(held, info.current_version))
        try:
            resp: LeaseResponse = await api.call(LEASE, LeaseRequest(
                backend=kind, held_version=held, precision=precision))  # type: ignore[arg-type]
            return resp
        except ProtocolError as exc:
            if exc.reason == Reason.PRECISION_NOT_OFFERED and self.cfg.precision == "auto" \
                    and self._precision_chosen:
                self._warn(f"{exc.message}; choosing again from the newest version")  # the operator changed it
                self._precision_chosen = False
                await asyncio.to_thread(self.stop.wait, GATE_POLL_S)
                return _Next.AGAIN
            if exc.reason != Reason.UNKNOWN_CLIENT:
                raise
            self.next_info = await api.info()
            return NEW_RUN

    def _note_pause(self, paused: bool) -> None:
        """Say when the coordinator's operator pauses issuing work, and when it issues again (once each)."""
        if paused != self._coordinator_paused:
            self._coordinator_paused = paused
            self._say("the coordinator's operator has paused issuing work; waiting for it to resume"
                      if paused else "the coordinator issues work again")

    async def _without_job(self, api: CoordinatorClient, resp: LeaseResponse, run_id: str, pull: bool
                           ) -> _Next | int:
        """No job this time: the run finished (EXIT_OK, or NEW_RUN when the operator's next run starts), a version
        to pull while idle (AGAIN at once, with it in hand), or the coordinator's pause or empty queue (AGAIN after
        its retry_after)."""
        self._no_job()  # other runs on this machine need not wait for this one
        if resp.finished and self.cfg.exit_when_finished:
            self._say(f"the run has finished at version {resp.current_version}")
            return EXIT_OK
        if resp.finished:
            self.next_info = await self._await_next_run(api, run_id, resp.current_version)
            return EXIT_OK if self.next_info is None else NEW_RUN
        if not resp.paused and pull and await self._pulled(resp.current_version):
            return _Next.AGAIN  # woken to pull a new version while idle: pulled it, so ask again with it in hand
        self._set_state("coordinator paused" if resp.paused else "waiting")
        await self._wait_unless_paused(resp.retry_after_s)
        return _Next.AGAIN

    async def _fetch_and_load(self, api: CoordinatorClient, backend: Backend, cache: SnapshotCache, job: Job
                              ) -> Path | _Next | int:
        """The job's snapshot, verified, in the precision the job names, loaded into the backend: its folder. A
        snapshot that cannot be had releases the job (AGAIN); one the backend cannot run releases it and stops
        the client (EXIT_REFUSED); a resource refusal or a disk error releases it and propagates."""
        self.stats.last_job = job.job_id
        self._batch = Batch.of_job(job)
        # the file the coordinator will recompute this job's result on
        cache.precision = self._file_precision = job.precision
        self._set_state("fetching")
        try:
            folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
            self._check_fits(folder, self._batch, job.version)
        except (IntegrityError, DownloadStalled, ProtocolError) as exc:
            self._say(f"could not get a verified snapshot of version {job.version} ({exc}); releasing the job")
            await self._release(api, job.job_id, job.lease_id)
            return _Next.AGAIN
        except (ResourceRefusal, OSError):
            await self._release(api, job.job_id, job.lease_id)
            raise
        if self.shares is None:  # with other runs on this machine, the model is loaded in this run's turn
            refused = await self._load(api, backend, job, folder)
            if refused is not None:
                return refused
        return folder

    async def _load(self, api: CoordinatorClient, backend: Backend, job: Job, folder: Path) -> int | None:
        """Load ``folder`` for ``job`` (a no-op when it is what the backend holds); EXIT_REFUSED, the job released,
        when the backend cannot run it."""
        try:
            await asyncio.to_thread(backend.load, folder)
        except FileNotFoundError as exc:  # e.g. a llama client and a coordinator that publishes no GGUF
            self._error(f"error: {exc}")
            await self._release(api, job.job_id, job.lease_id)
            return EXIT_REFUSED
        return None

    async def _generate_and_submit(self, api: CoordinatorClient, backend: Backend, job: Job, folder: Path,
                                   kind: str, pacer: Pacer) -> _Next | int:
        """Generate the job's rollouts (paced), then submit the result in the background and go on to the next
        lease: the coordinator's verification overlaps this client's next generation instead of idling it. At most
        one submission is in flight, so a refusal is seen one job later at worst. EXIT_OK when stopped meanwhile
        (the job released) or --max-jobs is reached; EXIT_REFUSED for a multi-turn job this client cannot play."""
        rollouts = job.group_size * len(job.prompts)
        self.stats.job_steps, self.stats.job_started_at = 0, time.time()
        self.stats.job_expected_steps = job.sampling.max_tokens * (rollouts if kind == "llama" else 1)
        async with self._machine() as turn:  # with other runs on this machine: this run's turn (shares.py)
            if self.shares is not None and await self._load(api, backend, job, folder) is not None:
                return EXIT_REFUSED  # its model was freed while another run had the machine
            self._set_state("generating")
            t0 = time.monotonic()
            pacer.reset()
            try:
                completions = await asyncio.to_thread(self._generate, backend, job, folder, pacer)
            except ProtocolError as exc:  # a multi-turn job this client cannot play (environment_mismatch)
                self._error(f"error: {exc.message}; releasing the job")
                await self._release(api, job.job_id, job.lease_id)
                return EXIT_REFUSED
            elapsed = time.monotonic() - t0
            n_tok = turn.tokens = sum(len(c.token_ids) + sum(len(t.token_ids) for t in c.turns or ())
                                      for c in completions)
            params = backend.parameters()
            turn.per_token = 2.0 * params if params else 1.0  # the turn's work in FLOPs (shares.py)
        self.stats.job_steps = pacer.steps
        if self.stop.is_set():
            await self._release(api, job.job_id, job.lease_id)
            return EXIT_OK
        sub = ResultSubmission(
            job_id=job.job_id, lease_id=job.lease_id, version=job.version, prompt_hash=job.prompt_hash,
            seed=job.seed, group_size=job.group_size, backend=kind, generation_s=elapsed,  # type: ignore[arg-type]
            completions=completions)
        await self._settle()
        self._submitting = asyncio.create_task(self._submit(api, job, sub, n_tok, elapsed))
        if self.cfg.max_jobs and self.stats.accepted - self.accepted_before + 1 >= self.cfg.max_jobs:
            await self._settle()  # the last job needed: know whether it counted before leasing another
            if self.stats.accepted - self.accepted_before >= self.cfg.max_jobs:
                return EXIT_OK
        return _Next.LEASE

    async def _await_next_run(self, api: CoordinatorClient, run_id: str, version: int) -> Info | None:
        """The run has finished: stop generating (no lease is asked for) and look, FINISHED_POLL_S apart and then
        less and less often (up to FINISHED_POLL_MAX_S), for the operator's next run at the same URL. Its Info when one starts; None when stopped (Ctrl-C or `client
        finish`) first. Through a coordinator restart in between, the requests wait it out (patient mode)."""
        self._say(f"the run has finished at version {version}: waiting for the operator's next run at "
                  f"{self.cfg.url} (Ctrl-C or `echo-swarm client finish` to stop)")
        if self.prefetch is not None and not self.prefetch.done():
            self.prefetch.cancel()
        await self._settle()
        self._set_state(FINISHED_STATE)
        polls = 0
        while not self.stop.is_set():
            # spread out (±20 %) so that a large swarm does not ask all at once
            delay = min(FINISHED_POLL_MAX_S, FINISHED_POLL_S * 2 ** min(polls, 16)) * random.uniform(0.8, 1.2)
            polls += 1
            end = time.monotonic() + delay
            while (left := end - time.monotonic()) > 0 and not self.stop.is_set():
                if read_controls(self.control_home).finish:
                    return None
                await asyncio.to_thread(self.stop.wait, min(left, GATE_POLL_S))
            if self.stop.is_set():
                break
            info = await api.info()
            if info.run_id != run_id or not info.finished:
                return info
            logger.debug("run %s still finished; looking again later", run_id)
            if self.stats.state == UNREACHABLE_STATE:
                self._set_state(FINISHED_STATE)
        return None

    @staticmethod
    def _generate(backend: Backend, job: Job, folder: Path, pacer: Pacer) -> list[Completion]:
        """A job's completions: sampled in one batch, or, for a multi-turn job, played as episodes."""
        if job.environment is not None:
            if backend_kind(backend) != "torch":
                raise ProtocolError(Reason.ENVIRONMENT_MISMATCH, "multi-turn jobs need the torch backend (the "
                                    "llama.cpp client does not fetch the tokenizer the observations are encoded "
                                    "with); join with --backend torch")
            return play_job(backend, job, folder, pacer)
        return [s.to_completion() for s in backend.generate(job, pacer)]

    async def _submit(self, api: CoordinatorClient, job: Job, sub: ResultSubmission, n_tok: int,
                      elapsed: float) -> None:
        job_id, lease_id = job.job_id, job.lease_id
        entry: dict[str, object] = {"at": time.time(), "job": job_id, "version": job.version, "tokens": n_tok,
                                    "seconds": round(elapsed, 2)}
        try:
            res = await api.call(RESULTS, sub)
            self._setbacks = 0
            self.stats.accepted += 1
            self.stats.credit = res.total_credit
            self.stats.tokens += n_tok
            self.lifetime.result(self.cfg.url, self.stats.run_id, job.client_id, accepted=True,
                                 total_credit=res.total_credit)
            entry |= {"outcome": "accepted", "credit": res.credit}
            if self.on_result is not None:
                self.on_result(time.monotonic(), job, n_tok)
        except ProtocolError as exc:
            if refusal_code(exc) in STOP_CODES:
                raise
            self.stats.rejected += 1
            self.lifetime.result(self.cfg.url, self.stats.run_id, job.client_id, accepted=False)
            self._setbacks = self._setbacks + 1 if exc.reason in SETBACKS else 0
            code = refusal_code(exc)
            self.stats.rejections[code] = self.stats.rejections.get(code, 0) + 1
            entry |= {"outcome": code, "credit": 0.0}
            self._say(f"result for {job_id} refused ({code}): {exc.message}")
            if exc.reason not in (Reason.JOB_COMPLETED, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER):
                await self._release(api, job_id, lease_id)
        self.stats.history = [*self.stats.history, entry][-HISTORY:]
        self.stats.tokens_per_s = n_tok / max(elapsed, 1e-9)
        self.display.update(line=True)
        self._write_status()

    async def _settle(self) -> None:
        """Wait for the submission in flight, if any; a refusal that ends the client propagates from here."""
        task, self._submitting = self._submitting, None
        if task is not None:
            await task

    async def _pulled(self, version: int) -> bool:
        """Wait (at most ``PULL_WAIT_S``) for the prefetch of an announced version; True once it is in hand.
        An idle client pulls before asking again, so its next job is generated with the newest weights."""
        if self.prefetch is not None and not self.prefetch.done():
            self._set_state("fetching")
            await asyncio.wait([self.prefetch], timeout=PULL_WAIT_S)
        return self.ready_version >= version

    def _consider_prefetch(self, resp: LeaseResponse, held: int, cache: SnapshotCache, run_id: str) -> bool:
        """Prefetch by need: fetch a newer version ahead of a job only when the reply says ``prefetch`` (the
        coordinator expects this client to work on it next); any other client fetches a version when a job needs
        it, so an idle swarm does not download every version. The fetch runs in the background while the client
        generates with the version it holds; one runs at a time, and one asked for while another is running
        follows it. A failed prefetch is only logged (the job that needs the version fetches it again).
        True when the reply asked for a version newer than ``held``: an idle client then waits for it."""
        if not resp.prefetch or resp.current_version <= held:
            return False
        self.prefetch_target = max(self.prefetch_target, resp.current_version)
        if self.prefetch is None or self.prefetch.done():
            self.prefetch = asyncio.create_task(self._prefetch(cache, run_id))
        return True

    async def _prefetch(self, cache: SnapshotCache, run_id: str) -> object:
        """Fetch ``prefetch_target`` (and any newer one asked for meanwhile); the last folder, or None."""
        folder: object = None
        while self.ready_version < self.prefetch_target:
            version = self.prefetch_target
            try:
                folder = await cache.ensure(run_id, version, None)
            except (EchoSwarmError, OSError) as exc:
                logger.info("prefetch of version %d failed: %s", version, exc)
                return None
            self.ready_version = max(self.ready_version, version)
        return folder

    async def _release(self, api: CoordinatorClient, job_id: str, lease_id: str) -> None:
        try:
            await asyncio.wait_for(api.call(RELEASE, ReleaseRequest(job_id=job_id, lease_id=lease_id)), timeout=5)
        except (TimeoutError, EchoSwarmError) as exc:
            self._say(f"could not release job {job_id} ({exc}); it will be reissued after its deadline")


def run(cfg: JoinConfig) -> int:
    safe_text.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")  # escaped, one line each
    return asyncio.run(Runner(cfg).run())
