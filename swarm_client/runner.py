"""The `join` loop: lease → fetch the job's snapshot → generate → submit, until stopped.

Sequential pull: every job names the policy version it must be generated with, and the client fetches
that version (verified against the signed manifest) before generating. Ctrl-C (or SIGTERM) finishes the
current decoding step, releases the lease so the job is reissued at once, and exits cleanly; a second
Ctrl-C exits immediately.

Before every lease the client asks swarm_client/schedule.py whether it may start work (pause, time windows,
`--idle-only`); before downloading a version it checks memory and disk (swarm_client/resources.py), and before
loading one for a job, memory again from the verified files and the job's batch (swarm_client/footprint.py).
The panel is swarm_client/panel.py, the pause/status files swarm_client/control.py, the config file
swarm_client/config.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared import PROTOCOL_VERSION
from shared.errors import EchoSwarmError, IntegrityError, ProtocolError, Reason
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
    ReleaseResponse,
    ResultSubmission,
    SubmitResponse,
)
from shared.records import open_job
from swarm_client.api import CoordinatorClient, CoordinatorUnreachable, RetryPolicy, refusal_code
from swarm_client.backends import Backend
from swarm_client.benchmark import run_benchmark
from swarm_client.control import is_paused, write_status

if TYPE_CHECKING:
    from swarm_client.peer_calls import PeerCalls
    from swarm_client.peer_fetch import ClientPeer
from swarm_client.footprint import (
    DEFAULT_BATCH,
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
from swarm_client.panel import Display
from swarm_client.resources import (
    GIB,
    Limits,
    ResourceRefusal,
    check_disk,
    check_gpu_memory,
    check_memory,
    disk_full_message,
)
from swarm_client.schedule import work_gate
from swarm_client.snapshots import DownloadStalled, SnapshotCache, Transfer

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_UNREACHABLE, EXIT_REFUSED, EXIT_RESOURCES = 0, 2, 3, 4
STOP_CODES = {"banned", "quarantined"}  # refusals that end the client: retrying cannot help


class JoinConfig(BaseModel):
    """Settings of one `echo-swarm join` process."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Coordinator base URL, e.g. http://127.0.0.1:8470")
    home: Path = Field(description="Identity, pinned coordinator keys and snapshot cache live here.")
    backend: str = Field("auto", description="Generation backend: auto (llama where llama-cpp-python is installed) "
                         "| torch | llama.")
    device: str = Field("auto", description="auto | cpu | cuda | mps.")
    threads: int | None = Field(None, ge=1, description="CPU threads for generation.")
    name: str = Field("", max_length=64, description="Display name on the leaderboard.")
    max_jobs: int | None = Field(None, ge=1, description="Exit after this many accepted jobs.")
    exit_when_finished: bool = Field(False, description="Exit when the coordinator's run has finished.")
    max_cpu_percent: float = Field(100.0, gt=0, le=100, description="Duty cycle of generation, in percent.")
    retries: int = Field(8, ge=1, le=100, description="Attempts per request before giving up (backoff 0.5 s → 30 s).")
    wait_for_coordinator_s: float = Field(0.0, ge=0, le=86_400, description="Seconds to keep looking (every half "
                                          "second) for a coordinator that is not up yet before the first request; "
                                          "0 = only the usual retries.")
    coordinator_key: str | None = Field(None, description="Expected coordinator public key (hex); else pinned on first use.")
    invite: str = Field("", max_length=128, description="Invite token for a private swarm (registration.mode = "
                        "'invite' on the coordinator); empty for open swarms.")
    # volunteer experience: resource caps, when to work, cache, benchmark (see swarm_client/schedule.py)
    gpu_layers: int | None = Field(None, ge=0, le=10_000, description="Layers to put on the GPU; 0 = GPU off "
                                   "(CPU only), None = the backend's default (all layers when a GPU is found).")
    max_memory_gb: float | None = Field(None, gt=0, le=1e6, description="Memory ceiling in GiB checked against "
                                        "each model before download; None = 80 % of RAM.")
    min_free_disk_gb: float = Field(1.0, ge=0, le=1e6, description="GiB of disk that must stay free after a download.")
    cache_max_gb: float | None = Field(None, gt=0, le=1e6, description="Snapshot cache cap in GiB (least recently "
                                       "used versions are pruned); None = no cap beyond the newest two versions.")
    idle_only: bool = Field(False, description="Start jobs only while the machine is otherwise idle.")
    idle_min_percent: float = Field(80.0, gt=0, le=100, description="CPU idle share, in percent, that counts as "
                                    "idle for --idle-only.")
    windows: list[str] = Field(default_factory=list, max_length=16, description="Daily local-time windows "
                               "HH:MM-HH:MM in which new jobs may start; empty = any time.")
    benchmark: bool = Field(True, description="Run a short self-benchmark at startup and report it at registration.")
    panel: bool | None = Field(None, description="Live terminal panel; None = when stdout is a terminal.")
    # snapshots from other volunteers over libp2p (the p2p extra; swarm_client/peer_fetch.py)
    p2p: bool = Field(False, description="Fetch snapshot files from peers over libp2p when the coordinator runs a "
                      "peer (every piece checked against the signed manifest; HTTP is the fallback).")
    p2p_serve: bool = Field(True, description="With p2p: serve verified files to other volunteers (--no-serve).")
    p2p_max_upload_gb: float | None = Field(None, gt=0, le=1e6, description="With p2p: stop serving after this many "
                                            "GB uploaded in this session; None = no cap.")
    p2p_uploads: int = Field(2, ge=1, le=64, description="With p2p: uploads served at once (U).")
    p2p_uploads_per_blob: int = Field(3, ge=1, le=1000, description="With p2p: uploads of one file in this session (T).")
    p2p_deadline_s: float = Field(20.0, gt=0, le=3600, description="With p2p: how long to look for a peer holding a "
                                  "file before fetching it over HTTP.")
    p2p_listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], min_length=1, max_length=8,
                                  description="With p2p: libp2p listen addresses (multiaddrs).")
    p2p_coordinator: list[str] = Field(default_factory=list, max_length=16, description="With p2p: the "
                                       "coordinator peer's multiaddrs, each ending in /p2p/<peer id> (default: "
                                       "what its GET /v1/p2p says).")
    p2p_jobs: bool = Field(False, description="With p2p: send register, lease, release and results to the "
                           "coordinator's libp2p peer (HTTP is the fallback; docs/protocol.md §6b).")

    @field_validator("name")
    @classmethod
    def _printable_name(cls, v: str) -> str:
        from shared.safe_text import check_printable

        return check_printable(v)  # the coordinator refuses control characters in a profile; say so up front

    @field_validator("p2p_coordinator")
    @classmethod
    def _coordinator_maddrs(cls, v: list[str]) -> list[str]:
        from swarm_client.peer_fetch import coordinator_info

        if v:
            coordinator_info(v)  # ValueError says the expected form
        return v

    @model_validator(mode="after")
    def _jobs_need_p2p(self) -> JoinConfig:
        if self.p2p_jobs and not self.p2p:
            raise ValueError("p2p_jobs sends jobs through this client's libp2p peer, which only p2p starts: add --p2p "
                             "(p2p = true), or drop --p2p-jobs")
        return self

    @field_validator("windows")
    @classmethod
    def _windows_parse(cls, v: list[str]) -> list[str]:
        from swarm_client.schedule import parse_window

        for w in v:
            parse_window(w)  # ValueError says the expected form
        return v


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


class Pacer:
    """Throttles decoding to a duty cycle: after each step that took t seconds, idle t·(100/p − 1)."""

    def __init__(self, percent: float, stop: threading.Event) -> None:
        self.factor = 100.0 / percent - 1.0
        self.stop = stop
        self.last = time.monotonic()

    def reset(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> bool:
        if self.factor > 0:
            busy = time.monotonic() - self.last
            self.stop.wait(busy * self.factor)
        self.last = time.monotonic()
        return self.stop.is_set()


GATE_POLL_S = 1.0  # how often a paused / waiting client re-reads its control file and the clock
PULL_WAIT_S = 30.0  # longest an idle client waits for an announced version to arrive before asking again


class Runner:
    def __init__(self, cfg: JoinConfig) -> None:
        from swarm_client.schedule import IdleProbe, parse_window

        self.cfg = cfg
        self.stop = threading.Event()
        self.stats = ClientStats()
        self.display = Display(self.stats, live=cfg.panel, url=cfg.url)
        self._download_decile = -1
        self.windows = [parse_window(w) for w in cfg.windows]
        self.idle_probe = IdleProbe(cfg.idle_min_percent / 100) if cfg.idle_only else None
        self.hardware: Hardware | None = None
        self.prefetch: asyncio.Task[object] | None = None
        self.calls: PeerCalls | None = None  # `--p2p-jobs`: signed calls over libp2p (swarm_client/peer_calls.py)
        self.peer: ClientPeer | None = None  # `--p2p`: this client's libp2p peer (swarm_client/peer_fetch.py)
        self.device = "cpu"  # the backend's device, once created
        self._forms: frozenset[str] | None = None  # the snapshot file forms the backend needs (None: all)
        self.accepted_before = self.rejected_before = 0  # this client's totals from earlier sessions
        self.ready_version = -1  # the newest version fetched and verified ahead of need (push-pull prefetch)
        self.prefetch_target = -1  # the newest version a lease reply asked this client to prefetch
        self._submitting: asyncio.Task[None] | None = None  # the previous job's result, submitted in the background
        # called with (monotonic seconds, job, tokens) for each accepted result: bench/client_overhead.py times
        # the real loop with it
        self.on_result: Callable[[float, Job, int], None] | None = None
        self.backend: Backend | None = None
        self._batch = DEFAULT_BATCH  # the batch of the job in hand (or the last one): what the memory checks assume

    # -- output -------------------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        self.display.say(text)

    def _write_status(self) -> None:
        if self.peer is not None:
            self.stats.p2p = {"served_bytes": self.peer.served_bytes, "received_bytes": self.peer.stats.peer_bytes,
                              "wasted_bytes": self.peer.stats.wasted_bytes, "fallbacks": self.peer.stats.fallbacks}
            if self.calls is not None:
                self.stats.p2p |= {"calls": self.calls.sent, "call_fallbacks": self.calls.fallbacks}
        try:
            write_status(self.cfg.home, asdict(self.stats))
        except OSError as exc:  # e.g. disk full: the status file is a convenience, never a reason to stop
            logger.warning("could not write %s: %s", self.cfg.home / "status.json", exc)

    def _set_state(self, state: str) -> None:
        if state != self.stats.state:
            self.stats.state = state
            self.display.update()
            self._write_status()

    # -- main loop ----------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        identity = load_identity(self.cfg.home)
        self.stats.client_id = identity.client_id
        self.hardware = detect(self.cfg.home)
        self.display.hardware = self.hardware.summary()
        self.display.start()
        if identity.created:
            self._say(f"created a new identity {identity.client_id} in {self.cfg.home}")
        self._say(f"this machine: {self.hardware.summary()}")
        if is_paused(self.cfg.home):
            self._say("paused (by `echo-swarm client pause`): no work is fetched until `echo-swarm client resume`")
        from swarm_client.backends import make_backend

        try:
            backend = make_backend(self.cfg.backend, device=self.cfg.device, threads=self.cfg.threads,
                                   gpu_layers=self.cfg.gpu_layers)
        except ValueError as exc:  # unknown backend, or llama-cpp-python not installed: the message says what to do
            self._say(f"error: {exc}")
            return EXIT_REFUSED
        self.backend = backend
        self.device = str(backend.device)
        from swarm_client.backends import backend_forms

        self._forms = backend_forms(backend)
        api = CoordinatorClient(self.cfg.url, identity, on_retry=self._say,
                                retry=RetryPolicy(attempts=self.cfg.retries))
        try:
            return await self._serve(api, identity, backend)
        except CoordinatorUnreachable as exc:
            self._say(f"error: {exc}")
            return EXIT_UNREACHABLE
        except CoordinatorKeyChanged as exc:
            self._say(f"error: {exc}")
            return EXIT_REFUSED
        except ResourceRefusal as exc:
            self._say(f"error: {exc}")
            return EXIT_RESOURCES
        except ProtocolError as exc:
            self._say(self._refusal_text(exc, identity.client_id))
            return EXIT_REFUSED
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            self._say(f"error: {disk_full_message(exc.filename or self.cfg.home)}")
            return EXIT_RESOURCES
        finally:
            if self._submitting is not None:  # a finished job's result is still on its way: deliver it if it can
                with contextlib.suppress(EchoSwarmError, OSError, TimeoutError):
                    await asyncio.wait_for(self._settle(), timeout=60)
            if self.prefetch is not None and not self.prefetch.done():
                self.prefetch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.prefetch
            if self.peer is not None:
                await self.peer.stop()
            self.stats.state = "stopped"
            self._write_status()
            self.display.stop()
            await api.close()

    async def _start_p2p(self, cache: SnapshotCache, api: CoordinatorClient, info: Info) -> None:
        from swarm_client.peer_fetch import ClientPeer, PeerSettings

        cap = self.cfg.p2p_max_upload_gb
        peer = ClientPeer(cache.blobs, PeerSettings(
            serve=self.cfg.p2p_serve, max_upload_bytes=None if cap is None else int(cap * 1e9),
            uploads=self.cfg.p2p_uploads, uploads_per_blob=self.cfg.p2p_uploads_per_blob,
            deadline_s=self.cfg.p2p_deadline_s, listen=self.cfg.p2p_listen, coordinator=self.cfg.p2p_coordinator),
            say=self._say)
        if await peer.start(api, info.run_id, info.coordinator_public_key):
            self.peer = cache.peers = peer
            if self.cfg.p2p_jobs:
                from swarm_client.peer_calls import PeerCalls

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
        from swarm_client.backends import backend_kind

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
        files = [f for f in manifest.files if self._forms is None or f.form in self._forms]
        held: Path | None = getattr(self.backend, "folder", None)
        shape = like = None
        if held is not None:
            with contextlib.suppress(OSError, ValueError):
                shape = read_shape(held)
                like = None if self._is_llama() else torch_weights(held)
        if self._is_llama():
            need = llama_need_from(sum(f.size for f in files if f.path.endswith(".gguf")), shape)
        else:
            from shared.adapters import ADAPTER_WEIGHTS

            weight_bytes = sum(f.size for f in files if f.path.endswith(".safetensors") and f.path != ADAPTER_WEIGHTS)
            need = torch_need_from(Weights.from_file_bytes(weight_bytes, like), shape, self._batch)
        self._check_need(need, manifest.version, limits)
        check_disk(missing_bytes, int(free_disk_gb(self.cfg.home) * GIB), limits, manifest.version)

    def _check_fits(self, folder: Path, batch: Batch, version: int) -> None:
        """Before loading a verified version to generate ``batch``: the estimate from the version's own files
        (safetensors or GGUF headers, config.json) and the batch, so that nothing passes the check to be killed
        by the OOM killer while loading or generating."""
        try:
            need = llama_need(folder) if self._is_llama() else torch_need(folder, batch)
        except (OSError, ValueError) as exc:  # a verified folder reads; if not, loading it says what is wrong
            logger.info("could not estimate the memory for %s: %s", folder, exc)
            return
        self._check_need(need, version)

    async def _gate(self) -> str | None:
        """Why no new work may start now (paused, outside the time windows, machine busy), or None."""
        paused = is_paused(self.cfg.home)
        idle = True
        if self.idle_probe is not None and not paused:
            idle = await asyncio.to_thread(self.idle_probe.measure, GATE_POLL_S, self.stop.wait)
        return work_gate(datetime.now(), paused=paused, windows=self.windows, idle_only=self.cfg.idle_only,
                         idle=idle)

    async def _wait_unless_paused(self, seconds: float) -> None:
        """Wait as the coordinator asked, but notice a pause (or Ctrl-C) within one poll."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not self.stop.is_set() and not is_paused(self.cfg.home):
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
        await asyncio.to_thread(backend.load, folder)
        self.stats.benchmark_tokens_per_s = await asyncio.to_thread(run_benchmark, backend)
        if self.stats.benchmark_tokens_per_s is not None:
            self._say(f"self-benchmark: {self.stats.benchmark_tokens_per_s:,.1f} tokens/s ({backend.name} on "
                      f"{backend.device})")

    async def _load_totals(self, api: CoordinatorClient, client_id: str) -> None:
        """Show the credit already earned (from the coordinator's public status), best effort."""
        try:
            async with api.session.get(f"{api.base_url}/v1/status", timeout=aiohttp.ClientTimeout(total=10)) as r:
                data = await r.json() if r.status == 200 else {}
            mine = next((c for c in data.get("clients", []) if c.get("client_id") == client_id), None)
            if mine:
                self.stats.accepted = self.accepted_before = int(mine.get("accepted", 0))
                self.stats.rejected = self.rejected_before = int(mine.get("rejected", 0))
                self.stats.credit = float(mine.get("credit", 0.0))
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError) as exc:
            logger.info("could not read earlier credit: %s", exc)

    async def _serve(self, api: CoordinatorClient, identity: Identity, backend: Backend) -> int:
        self.backend = backend
        wait = self.cfg.wait_for_coordinator_s
        if wait > 0 and not await api.up(wait):
            self._say(f"the coordinator at {self.cfg.url} did not come up within {wait:g}s; trying with retries")
        info = await api.info()
        if info.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"coordinator speaks protocol {info.protocol}, "
                                                         f"this client {PROTOCOL_VERSION}; upgrade echo-swarm")
        expected = bytes.fromhex(self.cfg.coordinator_key) if self.cfg.coordinator_key else None
        if pin_coordinator(self.cfg.home, self.cfg.url, info.coordinator_public_key, expected=expected):
            self._say(f"pinned coordinator key {info.coordinator_public_key.hex()[:16]}… for {self.cfg.url}")
        cache = SnapshotCache(self.cfg.home / "cache", api, info.coordinator_public_key, precheck=self._precheck,
                              max_bytes=None if self.cfg.cache_max_gb is None else int(self.cfg.cache_max_gb * GIB),
                              forms=self._forms, on_progress=self._on_download)
        if self.cfg.p2p:
            await self._start_p2p(cache, api, info)
        if self.cfg.benchmark:
            await self._benchmark(cache, backend, info)  # also refuses a model too big, before registering
        prof = profile(backend.name, backend.device, self.cfg.name, self.hardware, self.stats.benchmark_tokens_per_s)
        reg = await api.post("/v1/register", RegisterRequest(public_key=identity.public_key, profile=prof,
                                                             invite=self.cfg.invite),
                             RegisterResponse)
        await self._load_totals(api, reg.client_id)
        self._say(f"joined run {reg.run_id} at {self.cfg.url} as {reg.client_id[:8]} "
                  f"({backend.name} on {backend.device}, task {info.task}, version {info.current_version})")
        from swarm_client.backends import backend_kind

        kind = backend_kind(backend)
        pacer = Pacer(self.cfg.max_cpu_percent, self.stop)
        held = -1
        gated: str | None = None
        coordinator_paused = False
        while not self.stop.is_set():
            gate = await self._gate()
            if gate != gated:
                self._say(f"not fetching new work: {gate}" if gate else "fetching work again")
                gated = gate
            if gate is not None:
                self.stats.gated_polls += 1
                self._set_state(gate)
                self._write_status()
                await asyncio.to_thread(self.stop.wait, GATE_POLL_S)
                continue
            self._set_state("waiting")
            # "held": the newest version this client can generate with without waiting — the one it last used,
            # or a newer one already prefetched. Async push-pull binds the job to it while it is within the
            # staleness bound, so prefetching (when the coordinator asks for it) keeps rollouts as fresh as the
            # swarm allows
            held = max(held, self.ready_version)
            resp = await api.post("/v1/lease", LeaseRequest(backend=kind, held_version=held), LeaseResponse)
            pull = self._consider_prefetch(resp, held, cache, reg.run_id)
            if resp.paused != coordinator_paused:
                coordinator_paused = resp.paused
                self._say("the coordinator's operator has paused issuing work; waiting for it to resume"
                          if resp.paused else "the coordinator issues work again")
            if resp.job is None:
                if resp.finished and self.cfg.exit_when_finished:
                    self._say(f"the run has finished at version {resp.current_version}")
                    break
                if not resp.paused and pull and await self._pulled(resp.current_version):
                    continue  # woken to pull a new version while idle: pulled it, so ask again with it in hand
                self._set_state("coordinator paused" if resp.paused else "waiting")
                await self._wait_unless_paused(resp.retry_after_s)
                continue
            job = open_job(resp.job, info.coordinator_public_key)
            if job.client_id != identity.client_id:
                raise ProtocolError(Reason.NOT_LEASE_HOLDER, "coordinator sent a job leased to another client")
            self.stats.leases += 1
            if is_paused(self.cfg.home):  # paused while this lease request was in flight: hand the job back
                await self._release(api, job.job_id, job.lease_id)
                continue
            self.stats.last_job = job.job_id
            self._batch = Batch.of_job(job)
            self._set_state("fetching")
            try:
                folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
                self._check_fits(folder, self._batch, job.version)
            except (IntegrityError, DownloadStalled, ProtocolError) as exc:
                self._say(f"could not get a verified snapshot of version {job.version} ({exc}); releasing the job")
                await self._release(api, job.job_id, job.lease_id)
                continue
            except (ResourceRefusal, OSError):
                await self._release(api, job.job_id, job.lease_id)
                raise
            try:
                await asyncio.to_thread(backend.load, folder)
            except FileNotFoundError as exc:  # e.g. a llama client and a coordinator that publishes no GGUF
                self._say(f"error: {exc}")
                await self._release(api, job.job_id, job.lease_id)
                return EXIT_REFUSED
            held = self.stats.version = job.version
            self._set_state("generating")
            t0 = time.monotonic()
            pacer.reset()
            try:
                completions = await asyncio.to_thread(self._generate, backend, job, folder, pacer)
            except ProtocolError as exc:  # a multi-turn job this client cannot play (environment_mismatch)
                self._say(f"error: {exc.message}; releasing the job")
                await self._release(api, job.job_id, job.lease_id)
                return EXIT_REFUSED
            elapsed = time.monotonic() - t0
            if self.stop.is_set():
                await self._release(api, job.job_id, job.lease_id)
                break
            n_tok = sum(len(c.token_ids) + sum(len(t.token_ids) for t in c.turns or ()) for c in completions)
            sub = ResultSubmission(
                job_id=job.job_id, lease_id=job.lease_id, version=job.version, prompt_hash=job.prompt_hash,
                seed=job.seed, group_size=job.group_size, backend=kind, generation_s=elapsed,
                completions=completions)
            # Submit in the background and go on to the next lease: the coordinator's verification (a forward
            # pass over every completion) overlaps this client's next generation instead of idling it. At most
            # one submission is in flight, so a refusal is seen one job later at worst.
            await self._settle()
            self._submitting = asyncio.create_task(self._submit(api, job, sub, n_tok, elapsed))
            if self.cfg.max_jobs and self.stats.accepted - self.accepted_before + 1 >= self.cfg.max_jobs:
                await self._settle()  # the last job needed: know whether it counted before leasing another
                if self.stats.accepted - self.accepted_before >= self.cfg.max_jobs:
                    break
        await self._settle()
        self.stats.state = "stopped"
        self.display.stop()
        self._say(f"stopped: {self.stats.accepted - self.accepted_before} results accepted, "
                  f"{self.stats.rejected - self.rejected_before} refused this session; credit {self.stats.credit:,.0f}")
        return EXIT_OK

    @staticmethod
    def _generate(backend: Backend, job: Job, folder: Path, pacer: Pacer) -> list[Completion]:
        """A job's completions: sampled in one batch, or, for a multi-turn job, played as episodes."""
        if job.environment is not None:
            from swarm_client.backends import backend_kind
            from swarm_client.episodes import play_job

            if backend_kind(backend) != "torch":
                raise ProtocolError(Reason.ENVIRONMENT_MISMATCH, "multi-turn jobs need the torch backend (the "
                                    "llama.cpp client does not fetch the tokenizer the observations are encoded "
                                    "with); join with --backend torch")
            return play_job(backend, job, folder, pacer)
        return [s.to_completion() for s in backend.generate(job, pacer)]

    async def _submit(self, api: CoordinatorClient, job: Job, sub: ResultSubmission, n_tok: int,
                      elapsed: float) -> None:
        job_id, lease_id = job.job_id, job.lease_id
        try:
            res = await api.post("/v1/results", sub, SubmitResponse)
            self.stats.accepted += 1
            self.stats.credit = res.total_credit
            self.stats.tokens += n_tok
            if self.on_result is not None:
                self.on_result(time.monotonic(), job, n_tok)
        except ProtocolError as exc:
            if refusal_code(exc) in STOP_CODES:
                raise
            self.stats.rejected += 1
            code = refusal_code(exc)
            self.stats.rejections[code] = self.stats.rejections.get(code, 0) + 1
            self._say(f"result for {job_id} refused ({code}): {exc.message}")
            if exc.reason not in (Reason.JOB_COMPLETED, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER):
                await self._release(api, job_id, lease_id)
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
            await asyncio.wait_for(api.post("/v1/release", ReleaseRequest(job_id=job_id, lease_id=lease_id),
                                            ReleaseResponse), timeout=5)
        except (TimeoutError, EchoSwarmError) as exc:
            self._say(f"could not release job {job_id} ({exc}); it will be reissued after its deadline")


def run(cfg: JoinConfig) -> int:
    from shared import safe_text

    safe_text.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")  # escaped, one line each
    return asyncio.run(Runner(cfg).run())
