"""The `join` loop: lease → fetch the job's snapshot → generate → submit, until stopped.

Sequential pull: every job names the policy version it must be generated with, and the client fetches
that version (verified against the signed manifest) before generating. Ctrl-C (or SIGTERM) finishes the
current decoding step, releases the lease so the job is reissued at once, and exits cleanly; a second
Ctrl-C exits immediately.

A client people leave running for months: the first contact happens before anything is written, so a wrong URL
fails at once with a message of its own (swarm_client/api.py); once joined, an outage is waited out with one line
when the coordinator is lost and one when it is back; when the run finishes the client stops leasing, says so, and
joins the operator's next run at the same URL (swarm_client/leasing.py); `echo-swarm client finish` ends it after
the job in hand.

:class:`Runner` is the composition and the process's life around the loop: it makes the parts, each handed the
collaborators it uses, starts and stops what the client runs beside them (the panel, the control page, the libp2p
peer), and maps what stopped the client to its line and exit code. The parts:

- swarm_client/reporting.py — the client's lines, state and status.json (the panel is swarm_client/panel.py);
- swarm_client/gates.py — the volunteer's controls before every lease (pause, snooze, finish, battery, the monthly
  data budget, time windows, `--idle-only`: swarm_client/schedule.py, control.py);
- swarm_client/leasing.py — the leasing loop: register, lease, a job's snapshot, the run finished or replaced;
- swarm_client/downloads.py — the prefetch a lease reply asks for, and a download's progress;
- swarm_client/fitting.py — memory and disk before downloading a version (swarm_client/resources.py) and before
  loading one for a job (swarm_client/footprint.py), and the GGUF precision a llama.cpp client leases in;
- swarm_client/generation.py — a job's generation on this run's turn of the machine (swarm_client/shares.py), paced
  (swarm_client/pacing.py), and the self-benchmark;
- swarm_client/submissions.py — a result submitted in the background, a lease released, the back-off.

The local control page is swarm_client/webcontrol.py, the settings swarm_client/settings.py, the config file
swarm_client/config.py, the log swarm_client/logs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from shared import PROTOCOL_VERSION, safe_text
from shared.errors import EchoSwarmError, ProtocolError, Reason
from shared.exit_codes import ExitCode
from shared.messages import Info
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
from swarm_client.downloads import Downloads
from swarm_client.fitting import Fit
from swarm_client.gates import Gates
from swarm_client.generation import Generation
from swarm_client.hardware import Hardware, detect
from swarm_client.identity import CoordinatorKeyChanged, Identity, load_identity, pin_coordinator
from swarm_client.leasing import Joined, Leasing
from swarm_client.lifetime import Lifetime
from swarm_client.notices import NoticeWatch
from swarm_client.outcomes import (
    EXIT_NOT_A_COORDINATOR,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_RESOURCES,
    EXIT_UNREACHABLE,
    NEW_RUN,
)
from swarm_client.paths import ClientPaths, migrate_cache
from swarm_client.peer_calls import PeerCalls
from swarm_client.peer_fetch import ClientPeer, PeerSettings
from swarm_client.reporting import Reporter
from swarm_client.resources import GIB, ResourceRefusal, disk_full_message
from swarm_client.settings import JoinConfig
from swarm_client.shares import Shares
from swarm_client.snapshots import SnapshotCache
from swarm_client.submissions import STOP_CODES, Submissions
from swarm_client.webcontrol import ControlPage, PageSource

logger = logging.getLogger(__name__)

PAGE_LINGER_S = 3.0  # how long a client stopped by an error waits for an open control page to read the reason


@dataclass(frozen=True)
class Household:
    """What every run of one client process shares (swarm_client/multirun.py): the volunteer's controls, read from
    one home; one monthly data budget and one download cap; one lifetime ledger; one stop event (Ctrl-C stops every
    run). A single run has a household of its own."""

    control_home: Path
    stop: threading.Event
    meter: MonthlyMeter
    throttle: Throttle
    lifetime: Lifetime

    @classmethod
    def of(cls, cfg: JoinConfig, stop: threading.Event | None = None) -> Household:
        return cls(control_home=cfg.home, stop=stop or threading.Event(),
                   meter=MonthlyMeter(cfg.home / USAGE_FILE,
                                      None if cfg.max_gb_per_month is None else int(cfg.max_gb_per_month * GB)),
                   throttle=Throttle(None if cfg.max_mbps is None else cfg.max_mbps * MB),
                   lifetime=Lifetime(cfg.home))  # credit and results per run, across runs and restarts


def refusal_text(exc: ProtocolError, client_id: str) -> str:
    """The line a refusal of this client (not of one result) stops it with."""
    code = refusal_code(exc)
    if code in STOP_CODES:
        return (f"error: the coordinator has {code} this client ({client_id}): {exc.message}\n"
                f"It will not accept work from this client, so it stops here; retrying will not help. If you "
                f"think this is a mistake, contact the coordinator's operator and quote the client id above.")
    return f"error: the coordinator refused this client ({code}): {exc.message}"


def pin(cfg: JoinConfig, info: Info, reporter: Reporter) -> None:
    """Check the coordinator's protocol and pin its key (or check it against the one pinned or given)."""
    if info.protocol != PROTOCOL_VERSION:
        raise ProtocolError(Reason.PROTOCOL_VERSION, f"coordinator speaks protocol {info.protocol}, "
                                                     f"this client {PROTOCOL_VERSION}; upgrade echo-swarm")
    expected = bytes.fromhex(cfg.coordinator_key) if cfg.coordinator_key else None
    if pin_coordinator(cfg.home, cfg.url, info.coordinator_public_key, expected=expected):
        reporter.say(f"pinned coordinator key {info.coordinator_public_key.hex()[:16]}… for {cfg.url}")


class Runner:
    """One run of `echo-swarm join`: its parts, and the process's life around its leasing loop."""

    def __init__(self, cfg: JoinConfig, shares: Shares | None = None, household: Household | None = None) -> None:
        """``shares``: the machine's generation slot when this is one of several runs (swarm_client/multirun.py);
        ``household``: what it shares with the process's other runs (default: a household of its own, its controls
        read from ``cfg.home``)."""
        self.cfg = cfg
        self.shares = shares
        self.household = household or Household.of(cfg)
        self.stop, self.meter, self.throttle = self.household.stop, self.household.meter, self.household.throttle
        self.lifetime = self.household.lifetime
        self.paths = ClientPaths.of(cfg.home, cfg.cache_dir, cfg.log_dir)
        self.reporter = Reporter(cfg, shares, self.meter, self.throttle)
        self.stats, self.display = self.reporter.stats, self.reporter.display
        self.gates = Gates(cfg, self.household.control_home, self.stop, self.throttle, self.meter, self.reporter)
        self.downloads = Downloads(self.reporter)
        self.submissions = Submissions(cfg.url, self.reporter, self.lifetime, self.stop)
        self.generation = Generation(cfg, self.reporter, self.submissions, shares, self.stop)
        self.notices = NoticeWatch(cfg.home, self.display.software, self.reporter.say)
        self.leasing = Leasing(cfg, self.reporter, self.gates, self.downloads, self.generation, self.submissions,
                               self.notices, self.lifetime, self.stop)
        self.hardware: Hardware | None = None
        self.backend: Backend | None = None
        self.device = "cpu"  # the backend's device, once created
        self._forms: frozenset[str] | None = None  # the snapshot file forms the backend needs (None: all)
        self.peer: ClientPeer | None = None  # `--p2p`: this client's libp2p peer (swarm_client/peer_fetch.py)
        self.page: ControlPage | None = None  # the local control page (swarm_client/webcontrol.py)

    def attach(self, others: list[Runner]) -> None:
        """``others`` are this process's other runs (swarm_client/multirun.py): this run's status and control page
        list them, and each one's status change rewrites this run's status; on a terminal this run's panel lists
        them, and their lines and redraws go through it (swarm_client/panel.py)."""
        self.reporter.attached = [o.reporter for o in others]
        self.display.runs = self.reporter.runs
        for other in others:
            other.reporter.parent = self.reporter
            other.display.relay(self.display)

    def runs(self) -> list[dict[str, object]]:
        """Every run of this process with its share (swarm_client/shares.py) and standing."""
        return self.reporter.runs()

    # -- the process --------------------------------------------------------------------------------------
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
            self.generation.no_job()
            if self.stats.client_id:  # joined: what it downloaded counts toward the month's budget
                self.stats.exit_code = int(code)
                self.reporter.write_status()

    async def _run(self) -> int:
        cfg, reporter = self.cfg, self.reporter
        api = CoordinatorClient(cfg.url, None, on_retry=reporter.warn, on_outage=reporter.on_outage,
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
                    reporter.warn(f"the coordinator at {cfg.url} did not come up within "
                                  f"{cfg.wait_for_coordinator_s:g}s; trying with retries")
                info = await api.info()
            identity = await self._settle_in(api)
            return await self._serve(api, identity, backend, info)
        except ClientStopping:  # Ctrl-C while the coordinator was away: a normal stop
            reporter.say(f"stopped while the coordinator at {cfg.url} was unreachable: {reporter.session()[0]} "
                         f"results accepted this session")
            return EXIT_OK
        except CoordinatorUnreachable as exc:
            reporter.error(f"error: {exc}")
            return EXIT_UNREACHABLE
        except NotACoordinator as exc:
            reporter.error(f"error: {exc}")
            return EXIT_NOT_A_COORDINATOR
        except CoordinatorKeyChanged as exc:
            reporter.error(f"error: {exc}")
            return EXIT_REFUSED
        except ResourceRefusal as exc:
            reporter.error(f"error: {exc}")
            return EXIT_RESOURCES
        except ProtocolError as exc:
            reporter.error(refusal_text(exc, self.stats.client_id))
            return EXIT_REFUSED
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            reporter.error(f"error: {disk_full_message(exc.filename or cfg.home)}")
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
            self.reporter.say(f"created a new identity {identity.client_id} in {cfg.home}")
        self.reporter.say(f"this machine: {self.hardware.summary()}")
        moved = migrate_cache(cfg.home, self.paths.cache)
        if moved is not None:
            self.reporter.say(f"moved the snapshot cache from {moved} to {self.paths.cache} (the platform's cache "
                              f"folder)")
        self.gates.start()
        await self._start_page()
        return identity

    async def _wind_down(self, api: CoordinatorClient) -> None:
        """However the client stops: deliver a result still on its way if it can (60 s at most), stop the prefetch
        and the peer, write the last status, give an open control page one more look (so it can show why the
        client stopped), stop the panel, close the connection."""
        if self.submissions.in_flight:
            with contextlib.suppress(EchoSwarmError, OSError, TimeoutError):
                await asyncio.wait_for(self.submissions.settle(), timeout=60)
        await self.downloads.stop()
        if self.peer is not None:
            await self.peer.stop()
        if self.stats.client_id:
            self.stats.state = "stopped"
            self.reporter.write_status()
        if self.page is not None:
            await self.page.stop(linger_s=PAGE_LINGER_S if self.stats.stop_reason else 0.0)
        self.display.stop()
        await api.close()

    def _on_signal(self) -> None:
        if self.stop.is_set():
            os._exit(130)
        self.reporter.say("stopping: finishing the current step and releasing the lease (Ctrl-C again to quit now)")
        self.stop.set()

    # -- what runs beside the loop ------------------------------------------------------------------------
    def _make_backend(self) -> Backend | None:
        """The generation backend, with its libraries' logging routed into ours (swarm_client/logs.py)."""
        try:
            backend = make_backend(self.cfg.backend, device=self.cfg.device, threads=self.cfg.threads,
                                   gpu_layers=self.cfg.gpu_layers, torch_dtype=self.cfg.torch_dtype)
        except ValueError as exc:  # unknown backend, or llama-cpp-python not installed: the message says what to do
            self.reporter.error(f"error: {exc}")
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
            page = ControlPage(PageSource(self.cfg.home, self._page_state, self.gates.apply))
            url = await page.start(self.cfg.control_port)
        except OSError as exc:
            self.reporter.warn(f"the control page could not listen on 127.0.0.1:{self.cfg.control_port} "
                               f"({exc.strerror}); running without it (pass another --control-port)")
            return
        self.page = page
        self.display.page_url = url
        self.reporter.say(f"control page: {url} (open it with `echo-swarm client open`)")

    def _page_state(self) -> dict[str, object]:
        """What the control page shows: the live counters, plus the caps in force."""
        return self.reporter.current() | {
            "software": self.display.software, "machine": self.display.hardware, "backend": self.device,
            "data_bytes": self.meter.used(), "data_cap_bytes": self.meter.cap_bytes, "lifetime": self.lifetime.view(),
            "runs": self.runs() if self.reporter.attached else [],
            "max_mbps": None if not self.throttle.rate else self.throttle.rate / MB,
            "config_max_mbps": self.cfg.max_mbps}

    async def _start_p2p(self, cache: SnapshotCache, api: CoordinatorClient, info: Info) -> None:
        cfg, say = self.cfg, self.reporter.say
        cap = cfg.p2p_max_upload_gb
        peer = ClientPeer(cache.blobs, PeerSettings(
            serve=cfg.p2p_serve, max_upload_bytes=None if cap is None else int(cap * 1e9),
            uploads=cfg.p2p_uploads, uploads_per_blob=cfg.p2p_uploads_per_blob,
            deadline_s=cfg.p2p_deadline_s, listen=cfg.p2p_listen, coordinator=cfg.p2p_coordinator), say=say)
        if await peer.start(api, info.run_id, info.coordinator_public_key):
            self.peer = self.reporter.peer = cache.peers = peer
            if cfg.p2p_jobs:
                api.calls = self.reporter.calls = PeerCalls(peer, api.timeout_s, say)
                say("p2p jobs on: register, lease, release and results go to the coordinator's libp2p peer")
            self.reporter.write_status()
        elif cfg.p2p_jobs:
            say("p2p jobs off: this client's libp2p peer did not start (said above); jobs go over HTTP")

    # -- the loop -----------------------------------------------------------------------------------------
    async def _serve(self, api: CoordinatorClient, identity: Identity, backend: Backend,
                     info: Info | None = None) -> int:
        """Join the coordinator's run and work until stopped; when the run finishes, wait for the operator's next
        run at the same URL and join that (unless --exit-when-finished)."""
        cfg, reporter = self.cfg, self.reporter
        self.backend = backend
        if info is None:
            wait = cfg.wait_for_coordinator_s
            if wait > 0 and not await api.up(wait):
                reporter.warn(f"the coordinator at {cfg.url} did not come up within {wait:g}s; trying with retries")
            info = await api.info()
        pin(cfg, info, reporter)
        api.patient = True  # joined: from now on outages are waited out (--give-up-after), one line each way
        fit = Fit(cfg, backend, self.hardware, self.device, self._forms, reporter.say)
        cache = SnapshotCache(self.paths.cache, api, info.coordinator_public_key, precheck=fit.precheck,
                              max_bytes=None if cfg.cache_max_gb is None else int(cfg.cache_max_gb * GIB),
                              forms=self._forms, on_progress=self.downloads.on_progress, throttle=self.throttle,
                              count=self.meter.add)
        if cfg.p2p:
            await self._start_p2p(cache, api, info)
        if cfg.benchmark:
            await self.generation.benchmark(cache, backend, info, fit)  # also refuses a model too big, before registering
        joined = Joined(api, identity, backend, self.hardware, cache, fit)
        while await self.leasing.work(joined, info) == NEW_RUN and (new := self.leasing.next_run()) is not None:
            info = new
            pin(cfg, info, reporter)
            cache.coordinator_key = info.coordinator_public_key
            reporter.say(f"a new run ({info.run_id}) has started at {cfg.url}: joining it")
        await self.submissions.settle()
        self.gates.clear_finish()  # obeyed: the next start works normally
        self.stats.state = "stopped"
        self.display.stop()
        accepted, refused = reporter.session()
        reporter.say(f"stopped: {accepted} results accepted, {refused} refused this session; credit "
                     f"{self.stats.credit:,.0f}")
        return EXIT_OK


def run(cfg: JoinConfig) -> int:
    safe_text.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")  # escaped, one line each
    return asyncio.run(Runner(cfg).run())
