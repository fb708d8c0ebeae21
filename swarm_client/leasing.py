"""The leasing loop of one joined run: register, then turn after turn — the gates, the lease, a job's snapshot
fetched and loaded, its generation and submission — until stopped, the run finished, or another run started.

Each turn is a table of contents (:meth:`Leasing.work`): each step is a method of a few lines, here or in the
collaborator it belongs to (swarm_client/gates.py, downloads.py, generation.py, submissions.py), that answers go on
(``Next.LEASE``), start the next turn (``Next.AGAIN``) or the exit code to stop with (swarm_client/outcomes.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from shared.endpoints import LEASE, REGISTER, STATUS
from shared.errors import IntegrityError, ProtocolError, Reason
from shared.messages import Info, Job, LeaseRequest, LeaseResponse, RegisterRequest, RegisterResponse
from shared.records import open_job
from swarm_client.api import CoordinatorClient
from swarm_client.backends import Backend, backend_kind
from swarm_client.blob_fetch import DownloadStalled
from swarm_client.downloads import Downloads
from swarm_client.fitting import Fit
from swarm_client.gates import GATE_POLL_S, Gates
from swarm_client.generation import Generation
from swarm_client.hardware import Hardware, profile
from swarm_client.identity import Identity
from swarm_client.lifetime import Lifetime
from swarm_client.notices import NoticeWatch
from swarm_client.outcomes import EXIT_OK, NEW_RUN, Next
from swarm_client.pacing import Pacer
from swarm_client.presence import input_idle_s
from swarm_client.reporting import FINISHED_STATE, UNREACHABLE_STATE, Reporter
from swarm_client.resources import ResourceRefusal
from swarm_client.schedule import InputWatch
from swarm_client.settings import JoinConfig
from swarm_client.snapshots import SnapshotCache
from swarm_client.submissions import Submissions

#: the join loop's lines keep the logger name they always had in client.log (grep-able across versions)
logger = logging.getLogger("swarm_client.runner")

FINISHED_POLL_S = 15.0  # a client whose run has finished asks whether a new run has started after this long,
FINISHED_POLL_MAX_S = 300.0  # then twice as long each time up to this: a finished run's swarm costs little


@dataclass(frozen=True)
class Joined:
    """What a joined client works with: the coordinator's connection, this client's identity, its backend, the
    machine it runs on, the snapshot cache and the judge of what fits."""

    api: CoordinatorClient
    identity: Identity
    backend: Backend
    hardware: Hardware | None
    cache: SnapshotCache
    fit: Fit


class Leasing:
    """One run's leasing loop. ``gates``: whether work may start; ``downloads``: the prefetch the replies ask for;
    ``generation`` and ``submissions``: a job's work and its end; ``notices``: the coordinator's notices, polled each
    turn; ``lifetime``: the ledger a registration is noted in; ``stop``: Ctrl-C or `client finish`."""

    def __init__(self, cfg: JoinConfig, reporter: Reporter, gates: Gates, downloads: Downloads,
                 generation: Generation, submissions: Submissions, notices: NoticeWatch, lifetime: Lifetime,
                 stop: threading.Event) -> None:
        self.cfg = cfg
        self.reporter = reporter
        self.gates = gates
        self.downloads = downloads
        self.generation = generation
        self.submissions = submissions
        self.notices = notices
        self.lifetime = lifetime
        self.stop = stop
        self.next_info: Info | None = None  # the new run work() found (NEW_RUN)
        self._coordinator_paused = False  # the coordinator's pause, as last said

    async def work(self, joined: Joined, info: Info) -> int:
        """Register with ``info``'s run and loop lease → fetch → generate → submit. EXIT_OK when stopped (Ctrl-C,
        `client finish`, --max-jobs, a finished run with --exit-when-finished); NEW_RUN (with ``next_info``) when
        the coordinator now serves another run. Each turn is a table of contents: the gates, the lease, a job's
        fetch and load, its generation and submission — each step its own method, answering Next.LEASE (go on),
        Next.AGAIN (start the next turn) or the exit code to return."""
        api, cache = joined.api, joined.cache
        reg = await self._register(joined, info)
        kind = backend_kind(joined.backend)
        watch = InputWatch(input_idle_s, self.cfg.idle_input_minutes * 60) if self.cfg.idle_only else None
        pacer = self.reporter.pacer = Pacer(self.cfg.max_cpu_percent, self.stop, watch,
                                            self.gates.holding_from(asyncio.get_running_loop()))
        self.gates.joined()
        held, self._coordinator_paused = -1, False
        while not self.stop.is_set():
            await self._poll_notices(api, info, reg.run_id)
            turn = await self.gates.admit()
            if isinstance(turn, int):
                return turn
            if turn is Next.AGAIN:
                continue
            # "held": the newest version this client can generate with without waiting — the one it last used,
            # or a newer one already prefetched. Async push-pull binds the job to it while it is within the
            # staleness bound, so prefetching (when the coordinator asks for it) keeps rollouts as fresh as the
            # swarm allows
            held = max(held, self.downloads.ready_version)
            if await self.submissions.back_off():
                break
            resp = await self._ask_for_job(joined, kind, held, info)
            if isinstance(resp, int):
                return resp
            if resp is Next.AGAIN:
                continue
            assert isinstance(resp, LeaseResponse)
            pull = self.downloads.consider(resp, held, cache, reg.run_id)
            self._note_pause(resp.paused)
            if resp.job is None:
                turn = await self._without_job(api, resp, reg.run_id, pull)
                if isinstance(turn, int):
                    return turn
                continue
            job = open_job(resp.job, info.coordinator_public_key)
            if job.client_id != joined.identity.client_id:
                raise ProtocolError(Reason.NOT_LEASE_HOLDER, "coordinator sent a job leased to another client")
            self.reporter.stats.leases += 1
            if self.gates.held_back():  # paused (or finishing) while this lease request was in flight: hand it back
                self.generation.no_job()
                await self.submissions.release(api, job.job_id, job.lease_id)
                continue
            folder = await self._fetch_and_load(joined, job)
            if isinstance(folder, int):
                return folder
            if not isinstance(folder, Path):
                self.generation.no_job()
                continue
            held = self.reporter.stats.version = job.version
            turn = await self.generation.generate_and_submit(api, joined.backend, job, folder, kind, pacer)
            if isinstance(turn, int):
                return turn
        return EXIT_OK

    def next_run(self) -> Info | None:
        """The run :meth:`work` found when it answered NEW_RUN (handed over once)."""
        info, self.next_info = self.next_info, None
        return info

    async def _register(self, joined: Joined, info: Info) -> RegisterResponse:
        """Register (or register again) with ``info``'s run, load this identity's totals there, say so, and read the
        run's notices."""
        api, backend, stats = joined.api, joined.backend, self.reporter.stats
        prof = profile(backend.name, backend.device, self.cfg.name, joined.hardware, stats.benchmark_tokens_per_s,
                       self.cfg.team)
        reg = await api.call(REGISTER, RegisterRequest(public_key=joined.identity.public_key, profile=prof,
                                                       invite=self.cfg.invite))
        stats.run_id = reg.run_id
        await self._load_totals(api, reg.client_id)
        self.reporter.say(f"joined run {reg.run_id} at {self.cfg.url} as {reg.client_id[:8]} "
                          f"({backend.name} on {backend.device}, task {info.task}, version {info.current_version})")
        await self._poll_notices(api, info, reg.run_id, now=True)
        return reg

    async def _load_totals(self, api: CoordinatorClient, client_id: str) -> None:
        """Show the credit already earned (from the coordinator's public status), best effort; the lifetime ledger
        notes the run either way."""
        stats, reporter = self.reporter.stats, self.reporter
        mine = None
        try:
            async with api.session.get(api.base_url + STATUS.path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                data = await r.json() if r.status == 200 else {}
            mine = next((c for c in data.get("clients", []) if c.get("client_id") == client_id), None)
            if mine:
                stats.accepted = reporter.accepted_before = int(mine.get("accepted", 0))
                stats.rejected = reporter.rejected_before = int(mine.get("rejected", 0))
                stats.credit = float(mine.get("credit", 0.0))
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError) as exc:
            logger.info("could not read earlier credit: %s", exc)
        known = bool(mine)  # the coordinator's figures for this identity, where its status lists it
        self.lifetime.joined(self.cfg.url, stats.run_id, client_id,
                             accepted=stats.accepted if known else None,
                             rejected=stats.rejected if known else None,
                             credit=stats.credit if known else None)

    async def _poll_notices(self, api: CoordinatorClient, info: Info, run_id: str, *, now: bool = False) -> None:
        """The coordinator's notices (swarm_client/notices.py): when due, new ones shown; the panel, status.json and
        the control page follow what is in force."""
        if await self.notices.poll(api, info.coordinator_public_key, run_id, now=now):
            self.reporter.stats.notices = self.notices.shown
            self.reporter.display.update()
            self.reporter.write_status()

    async def _ask_for_job(self, joined: Joined, kind: str, held: int, info: Info) -> LeaseResponse | Next | int:
        """One lease request at the precision this client runs. AGAIN when the operator stopped offering the
        precision chosen (it chooses again), NEW_RUN (with ``next_info``) when the coordinator no longer knows this
        client (another run at this URL, or a store started afresh)."""
        api, fit = joined.api, joined.fit
        precision = await fit.lease_precision(joined.cache, max(held, info.current_version))
        try:
            resp: LeaseResponse = await api.call(LEASE, LeaseRequest(
                backend=kind, held_version=held, precision=precision))  # type: ignore[arg-type]
            return resp
        except ProtocolError as exc:
            if exc.reason == Reason.PRECISION_NOT_OFFERED and self.cfg.precision == "auto" and fit.chosen:
                self.reporter.warn(f"{exc.message}; choosing again from the newest version")  # the operator changed it
                fit.choose_again()
                await asyncio.to_thread(self.stop.wait, GATE_POLL_S)
                return Next.AGAIN
            if exc.reason != Reason.UNKNOWN_CLIENT:
                raise
            self.next_info = await api.info()
            return NEW_RUN

    def _note_pause(self, paused: bool) -> None:
        """Say when the coordinator's operator pauses issuing work, and when it issues again (once each)."""
        if paused != self._coordinator_paused:
            self._coordinator_paused = paused
            self.reporter.say("the coordinator's operator has paused issuing work; waiting for it to resume"
                              if paused else "the coordinator issues work again")

    async def _without_job(self, api: CoordinatorClient, resp: LeaseResponse, run_id: str, pull: bool
                           ) -> Next | int:
        """No job this time: the run finished (EXIT_OK, or NEW_RUN when the operator's next run starts), a version
        to pull while idle (AGAIN at once, with it in hand), or the coordinator's pause or empty queue (AGAIN after
        its retry_after)."""
        self.generation.no_job()  # other runs on this machine need not wait for this one
        if resp.finished and self.cfg.exit_when_finished:
            self.reporter.say(f"the run has finished at version {resp.current_version}")
            return EXIT_OK
        if resp.finished:
            self.next_info = await self._await_next_run(api, run_id, resp.current_version)
            return EXIT_OK if self.next_info is None else NEW_RUN
        if not resp.paused and pull and await self.downloads.pulled(resp.current_version):
            return Next.AGAIN  # woken to pull a new version while idle: pulled it, so ask again with it in hand
        self.reporter.set_state("coordinator paused" if resp.paused else "waiting")
        await self.gates.wait_unless_held(resp.retry_after_s)
        return Next.AGAIN

    async def _fetch_and_load(self, joined: Joined, job: Job) -> Path | Next | int:
        """The job's snapshot, verified, in the precision the job names, loaded into the backend: its folder. A
        snapshot that cannot be had releases the job (AGAIN); one the backend cannot run releases it and stops
        the client (EXIT_REFUSED); a resource refusal or a disk error releases it and propagates."""
        api, cache, fit = joined.api, joined.cache, joined.fit
        self.reporter.stats.last_job = job.job_id
        fit.take(job)
        cache.precision = job.precision  # the file the coordinator will recompute this job's result on
        self.reporter.set_state("fetching")
        try:
            folder = await cache.ensure(job.run_id, job.version, job.manifest_sha256)
            fit.check_fits(folder, fit.batch, job.version)
        except (IntegrityError, DownloadStalled, ProtocolError) as exc:
            self.reporter.say(f"could not get a verified snapshot of version {job.version} ({exc}); releasing the job")
            await self.submissions.release(api, job.job_id, job.lease_id)
            return Next.AGAIN
        except (ResourceRefusal, OSError):
            await self.submissions.release(api, job.job_id, job.lease_id)
            raise
        refused = await self.generation.prepare(api, joined.backend, job, folder)
        return folder if refused is None else refused

    async def _await_next_run(self, api: CoordinatorClient, run_id: str, version: int) -> Info | None:
        """The run has finished: stop generating (no lease is asked for) and look, FINISHED_POLL_S apart and then
        less and less often (up to FINISHED_POLL_MAX_S), for the operator's next run at the same URL. Its Info when
        one starts; None when stopped (Ctrl-C or `client finish`) first. Through a coordinator restart in between,
        the requests wait it out (patient mode)."""
        self.reporter.say(f"the run has finished at version {version}: waiting for the operator's next run at "
                          f"{self.cfg.url} (Ctrl-C or `echo-swarm client finish` to stop)")
        self.downloads.cancel()
        await self.submissions.settle()
        self.reporter.set_state(FINISHED_STATE)
        polls = 0
        while not self.stop.is_set():
            # spread out (±20 %) so that a large swarm does not ask all at once
            delay = min(FINISHED_POLL_MAX_S, FINISHED_POLL_S * 2 ** min(polls, 16)) * random.uniform(0.8, 1.2)
            polls += 1
            end = time.monotonic() + delay
            while (left := end - time.monotonic()) > 0 and not self.stop.is_set():
                if self.gates.finishing():
                    return None
                await asyncio.to_thread(self.stop.wait, min(left, GATE_POLL_S))
            if self.stop.is_set():
                break
            info = await api.info()
            if info.run_id != run_id or not info.finished:
                return info
            logger.debug("run %s still finished; looking again later", run_id)
            if self.reporter.stats.state == UNREACHABLE_STATE:
                self.reporter.set_state(FINISHED_STATE)
        return None
