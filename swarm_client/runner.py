"""The `join` loop: lease → fetch the job's snapshot → generate → submit, until stopped.

Sequential pull: every job names the policy version it must be generated with, and the client fetches
that version (verified against the signed manifest) before generating. Ctrl-C (or SIGTERM) finishes the
current decoding step, releases the lease so the job is reissued at once, and exits cleanly; a second
Ctrl-C exits immediately.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shared import PROTOCOL_VERSION
from shared.errors import EchoSwarmError, IntegrityError, ProtocolError, Reason
from shared.messages import (
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    ReleaseRequest,
    ReleaseResponse,
    ResultSubmission,
    SubmitResponse,
)
from shared.records import open_job
from swarm_client.api import CoordinatorClient, CoordinatorUnreachable, RetryPolicy
from swarm_client.identity import CoordinatorKeyChanged, load_identity, pin_coordinator
from swarm_client.snapshots import SnapshotCache

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_UNREACHABLE, EXIT_REFUSED = 0, 2, 3


class JoinConfig(BaseModel):
    """Settings of one `echo-swarm join` process."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Coordinator base URL, e.g. http://127.0.0.1:8470")
    home: Path = Field(description="Identity, pinned coordinator keys and snapshot cache live here.")
    backend: str = Field("auto", description="Generation backend: auto (llama where llama-cpp-python is installed) "
                         "| torch | llama.")
    n_gpu_layers: int | None = Field(None, ge=-1, description="llama backend: layers offloaded to the GPU "
                                     "(-1: all; default: all unless --device cpu).")
    device: str = Field("auto", description="auto | cpu | cuda | mps.")
    threads: int | None = Field(None, ge=1, description="CPU threads for generation.")
    name: str = Field("", max_length=64, description="Display name on the leaderboard.")
    max_jobs: int | None = Field(None, ge=1, description="Exit after this many accepted jobs.")
    exit_when_finished: bool = Field(False, description="Exit when the coordinator's run has finished.")
    max_cpu_percent: float = Field(100.0, gt=0, le=100, description="Duty cycle of generation, in percent.")
    retries: int = Field(8, ge=1, le=100, description="Attempts per request before giving up (backoff 0.5 s → 30 s).")
    coordinator_key: str | None = Field(None, description="Expected coordinator public key (hex); else pinned on first use.")


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


class Runner:
    def __init__(self, cfg: JoinConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.stats = ClientStats()
        self.tty = sys.stdout.isatty()

    # -- output -------------------------------------------------------------------------------------------
    def _show(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        else:
            print(text, flush=True)

    def _say(self, text: str) -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)

    def _line(self) -> str:
        s = self.stats
        return (f"[echo-swarm {s.client_id[:8]}] v{s.version} {s.state} {s.last_job} | {s.tokens_per_s:,.0f} tok/s | "
                f"accepted {s.accepted} rejected {s.rejected} | credit {s.credit:,.0f}")

    def _write_status(self) -> None:
        path = self.cfg.home / "status.json"
        tmp = path.with_name("status.json.tmp")
        tmp.write_text(json.dumps(asdict(self.stats)))
        tmp.replace(path)

    # -- main loop ----------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        identity = load_identity(self.cfg.home)
        self.stats.client_id = identity.client_id
        if identity.created:
            self._say(f"created a new identity {identity.client_id} in {self.cfg.home}")
        from swarm_client.backends import make_backend
        from swarm_client.hardware import profile

        try:
            backend = make_backend(self.cfg.backend, device=self.cfg.device, threads=self.cfg.threads,
                                   n_gpu_layers=self.cfg.n_gpu_layers)
        except ValueError as exc:  # unknown backend, or llama-cpp-python not installed: the message says what to do
            self._say(f"error: {exc}")
            return EXIT_REFUSED
        api = CoordinatorClient(self.cfg.url, identity, on_retry=self._say,
                                retry=RetryPolicy(attempts=self.cfg.retries))
        try:
            return await self._serve(api, identity, backend, profile(backend.name, backend.device, self.cfg.name))
        except CoordinatorUnreachable as exc:
            self._say(f"error: {exc}")
            return EXIT_UNREACHABLE
        except CoordinatorKeyChanged as exc:
            self._say(f"error: {exc}")
            return EXIT_REFUSED
        except ProtocolError as exc:
            self._say(f"error: the coordinator refused this client ({exc.reason.value}): {exc.message}")
            return EXIT_REFUSED
        finally:
            self.stats.state = "stopped"
            self._write_status()
            await api.close()

    def _on_signal(self) -> None:
        if self.stop.is_set():
            os._exit(130)
        self._say("stopping: finishing the current step and releasing the lease (Ctrl-C again to quit now)")
        self.stop.set()

    async def _serve(self, api: CoordinatorClient, identity, backend, prof) -> int:  # type: ignore[no-untyped-def]
        info = await api.info()
        if info.protocol != PROTOCOL_VERSION:
            raise ProtocolError(Reason.PROTOCOL_VERSION, f"coordinator speaks protocol {info.protocol}, "
                                                         f"this client {PROTOCOL_VERSION}; upgrade echo-swarm")
        expected = bytes.fromhex(self.cfg.coordinator_key) if self.cfg.coordinator_key else None
        if pin_coordinator(self.cfg.home, self.cfg.url, info.coordinator_public_key, expected=expected):
            self._say(f"pinned coordinator key {info.coordinator_public_key.hex()[:16]}… for {self.cfg.url}")
        reg = await api.post("/v1/register", RegisterRequest(public_key=identity.public_key, profile=prof),
                             RegisterResponse)
        self._say(f"joined run {reg.run_id} at {self.cfg.url} as {reg.client_id[:8]} "
                  f"({backend.name} on {backend.device}, task {info.task}, version {info.current_version})")
        from swarm_client.backends import backend_forms, backend_kind

        kind = backend_kind(backend)
        cache = SnapshotCache(self.cfg.home / "cache", api, info.coordinator_public_key, forms=backend_forms(backend))
        pacer = Pacer(self.cfg.max_cpu_percent, self.stop)
        held = -1
        prefetch: asyncio.Task[object] | None = None
        while not self.stop.is_set():
            self.stats.state = "waiting"
            resp = await api.post("/v1/lease", LeaseRequest(backend=kind, held_version=held), LeaseResponse)
            if resp.current_version > held and (prefetch is None or prefetch.done()):
                # push-pull: the lease reply announces the newest version; fetch it in the background while
                # generating with the one we hold (a failed prefetch is retried by the job that needs it)
                prefetch = asyncio.create_task(self._prefetch(cache, reg.run_id, resp.current_version))
            if resp.job is None:
                if resp.finished and self.cfg.exit_when_finished:
                    self._say(f"the run has finished at version {resp.current_version}")
                    break
                await asyncio.to_thread(self.stop.wait, resp.retry_after_s)
                continue
            job = open_job(resp.job, info.coordinator_public_key)
            if job.client_id != identity.client_id:
                raise ProtocolError(Reason.NOT_LEASE_HOLDER, "coordinator sent a job leased to another client")
            self.stats.last_job, self.stats.state = job.job_id, "fetching"
            try:
                folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
            except (IntegrityError, ProtocolError) as exc:
                self._say(f"could not get a verified snapshot of version {job.version} ({exc}); releasing the job")
                await self._release(api, job.job_id, job.lease_id)
                continue
            try:
                await asyncio.to_thread(backend.load, folder)
            except FileNotFoundError as exc:  # e.g. a llama client and a coordinator that publishes no GGUF
                self._say(f"error: {exc}")
                await self._release(api, job.job_id, job.lease_id)
                return EXIT_REFUSED
            held = self.stats.version = job.version
            self.stats.state = "generating"
            self._show(self._line())
            t0 = time.monotonic()
            pacer.reset()
            samples = await asyncio.to_thread(backend.generate, job, pacer)
            elapsed = time.monotonic() - t0
            if self.stop.is_set():
                await self._release(api, job.job_id, job.lease_id)
                break
            n_tok = sum(len(s.token_ids) for s in samples)
            sub = ResultSubmission(
                job_id=job.job_id, lease_id=job.lease_id, version=job.version, prompt_hash=job.prompt_hash,
                seed=job.seed, group_size=job.group_size, backend=kind, generation_s=elapsed,
                completions=[s.to_completion() for s in samples])
            self.stats.state = "submitting"
            try:
                res = await api.post("/v1/results", sub, SubmitResponse)
                self.stats.accepted += 1
                self.stats.credit = res.total_credit
                self.stats.tokens += n_tok
            except ProtocolError as exc:
                if exc.reason is Reason.BANNED:
                    raise
                self.stats.rejected += 1
                self.stats.rejections[exc.reason.value] = self.stats.rejections.get(exc.reason.value, 0) + 1
                self._say(f"result for {job.job_id} refused ({exc.reason.value}): {exc.message}")
                if exc.reason not in (Reason.JOB_COMPLETED, Reason.LEASE_EXPIRED, Reason.NOT_LEASE_HOLDER):
                    await self._release(api, job.job_id, job.lease_id)
            self.stats.tokens_per_s = n_tok / max(elapsed, 1e-9)
            self.stats.state = "done"
            self._show(self._line())
            self._write_status()
            if self.cfg.max_jobs and self.stats.accepted >= self.cfg.max_jobs:
                break
        self._say(f"stopped: {self.stats.accepted} results accepted, {self.stats.rejected} refused, "
                  f"credit {self.stats.credit:,.0f}")
        return EXIT_OK

    @staticmethod
    async def _prefetch(cache: SnapshotCache, run_id: str, version: int) -> object:
        try:
            return await cache.ensure(run_id, version, None)
        except (EchoSwarmError, OSError) as exc:
            logger.info("prefetch of version %d failed: %s", version, exc)
            return None

    async def _release(self, api: CoordinatorClient, job_id: str, lease_id: str) -> None:
        try:
            await asyncio.wait_for(api.post("/v1/release", ReleaseRequest(job_id=job_id, lease_id=lease_id),
                                            ReleaseResponse), timeout=5)
        except (TimeoutError, EchoSwarmError) as exc:
            self._say(f"could not release job {job_id} ({exc}); it will be reissued after its deadline")


def run(cfg: JoinConfig) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(Runner(cfg).run())
