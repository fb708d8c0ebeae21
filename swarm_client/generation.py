"""The machine's work for one run: a job's model loaded, its rollouts generated at the duty cycle asked for, the
result handed to the submissions — and the self-benchmark, which is the same work timed.

With several runs in one process (swarm_client/multirun.py) the machine is one: every use of the backend happens
inside this run's turn (swarm_client/shares.py), so another run's turn may unload this run's model without racing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

from shared.errors import IntegrityError, ProtocolError, Reason
from shared.messages import Completion, Info, Job, ResultSubmission
from swarm_client.api import CoordinatorClient
from swarm_client.backends import Backend, backend_kind
from swarm_client.benchmark import run_benchmark
from swarm_client.blob_fetch import DownloadStalled
from swarm_client.episodes import play_job
from swarm_client.fitting import Fit
from swarm_client.footprint import DEFAULT_BATCH
from swarm_client.outcomes import EXIT_OK, EXIT_REFUSED, Next
from swarm_client.pacing import Pacer
from swarm_client.reporting import Reporter
from swarm_client.settings import JoinConfig
from swarm_client.shares import Shares, Turn
from swarm_client.snapshots import SnapshotCache
from swarm_client.submissions import Submissions


class Generation:
    """One run's use of the machine. ``shares``: the generation slot it takes turns on with the process's other runs
    (None: the machine is its own); ``submissions``: where a generated result goes; ``stop``: Ctrl-C, which
    releases the job instead of submitting it."""

    def __init__(self, cfg: JoinConfig, reporter: Reporter, submissions: Submissions, shares: Shares | None,
                 stop: threading.Event) -> None:
        self.cfg = cfg
        self.reporter = reporter
        self.submissions = submissions
        self.shares = shares
        self.stop = stop

    def no_job(self) -> None:
        """No job in hand for now: with other runs on this machine, they need not wait for this one."""
        if self.shares is not None:
            self.shares.no_job(self.cfg.url)

    def machine(self) -> contextlib.AbstractAsyncContextManager[Turn]:
        """The machine for one job's generation: this run's turn when it shares the machine with other runs
        (swarm_client/shares.py), at once otherwise."""
        if self.shares is None:
            return contextlib.nullcontext(Turn())
        return self.shares.turn(self.cfg.url)

    async def prepare(self, api: CoordinatorClient, backend: Backend, job: Job, folder: Path) -> int | None:
        """Load ``job``'s model as soon as its snapshot is in hand when the machine is this run's own (EXIT_REFUSED,
        the job released, when the backend cannot run it); with other runs on the machine it is loaded inside this
        run's turn instead (:meth:`generate_and_submit`), as another run's turn frees it."""
        if self.shares is not None:
            return None
        return await self._load(api, backend, job, folder)

    async def _load(self, api: CoordinatorClient, backend: Backend, job: Job, folder: Path) -> int | None:
        """Load ``folder`` for ``job`` (a no-op when it is what the backend holds); EXIT_REFUSED, the job released,
        when the backend cannot run it."""
        try:
            await asyncio.to_thread(backend.load, folder)
        except FileNotFoundError as exc:  # e.g. a llama client and a coordinator that publishes no GGUF
            self.reporter.error(f"error: {exc}")
            await self.submissions.release(api, job.job_id, job.lease_id)
            return EXIT_REFUSED
        return None

    async def generate_and_submit(self, api: CoordinatorClient, backend: Backend, job: Job, folder: Path,
                                  kind: str, pacer: Pacer) -> Next | int:
        """Generate the job's rollouts (paced), then submit the result in the background and go on to the next
        lease: the coordinator's verification overlaps this client's next generation instead of idling it. At most
        one submission is in flight, so a refusal is seen one job later at worst. EXIT_OK when stopped meanwhile
        (the job released) or --max-jobs is reached; EXIT_REFUSED for a multi-turn job this client cannot play."""
        stats = self.reporter.stats
        rollouts = job.group_size * len(job.prompts)
        stats.job_steps, stats.job_started_at = 0, time.time()
        stats.job_expected_steps = job.sampling.max_tokens * (rollouts if kind == "llama" else 1)
        async with self.machine() as turn:  # with other runs on this machine: this run's turn (shares.py)
            if self.shares is not None and await self._load(api, backend, job, folder) is not None:
                return EXIT_REFUSED  # its model was freed while another run had the machine
            self.reporter.set_state("generating")
            t0 = time.monotonic()
            pacer.reset()
            try:
                completions = await asyncio.to_thread(self._generate, backend, job, folder, pacer)
            except ProtocolError as exc:  # a multi-turn job this client cannot play (environment_mismatch)
                self.reporter.error(f"error: {exc.message}; releasing the job")
                await self.submissions.release(api, job.job_id, job.lease_id)
                return EXIT_REFUSED
            elapsed = time.monotonic() - t0
            n_tok = turn.tokens = sum(len(c.token_ids) + sum(len(t.token_ids) for t in c.turns or ())
                                      for c in completions)
            params = backend.parameters()
            turn.per_token = 2.0 * params if params else 1.0  # the turn's work in FLOPs (shares.py)
        stats.job_steps = pacer.steps
        if self.stop.is_set():
            await self.submissions.release(api, job.job_id, job.lease_id)
            return EXIT_OK
        sub = ResultSubmission(
            job_id=job.job_id, lease_id=job.lease_id, version=job.version, prompt_hash=job.prompt_hash,
            seed=job.seed, group_size=job.group_size, backend=kind, generation_s=elapsed,  # type: ignore[arg-type]
            completions=completions)
        await self.submissions.send(api, job, sub, n_tok, elapsed)
        if self.cfg.max_jobs and self.reporter.session()[0] + 1 >= self.cfg.max_jobs:
            await self.submissions.settle()  # the last job needed: know whether it counted before leasing another
            if self.reporter.session()[0] >= self.cfg.max_jobs:
                return EXIT_OK
        return Next.LEASE

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

    async def benchmark(self, cache: SnapshotCache, backend: Backend, info: Info, fit: Fit) -> None:
        """The self-benchmark (`--benchmark`): tokens per second on the run's current version, sent with the
        registration. A model too big for this machine is refused here, before registering."""
        self.reporter.set_state("benchmarking")
        try:
            folder = await cache.ensure(info.run_id, info.current_version, None)
        except (IntegrityError, DownloadStalled, ProtocolError) as exc:  # not fatal: jobs fetch their versions later
            self.reporter.say(f"self-benchmark skipped: no verified snapshot of version {info.current_version} ({exc})")
            return
        fit.check_fits(folder, DEFAULT_BATCH, info.current_version)  # DEFAULT_BATCH: the benchmark's workload
        async with self.machine():  # another run generating meanwhile would halve the figure
            await asyncio.to_thread(backend.load, folder)
            self.reporter.stats.benchmark_tokens_per_s = await asyncio.to_thread(run_benchmark, backend)
        if self.reporter.stats.benchmark_tokens_per_s is not None:
            self.reporter.say(f"self-benchmark: {self.reporter.stats.benchmark_tokens_per_s:,.1f} tokens/s "
                              f"({backend.name} on {backend.device})")
