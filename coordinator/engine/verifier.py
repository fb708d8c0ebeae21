"""The verifier role: recomputes behaviour logprobs of returned rollouts from the *published* snapshots, with its
own model replica on its own worker thread.

Why a separate unit: verification is a forward pass over every result, a third of the training compute for
full fine-tuning and half of it for LoRA (docs/benchmarks.md, "Real model size"). Done on the learner's thread
with the learner's model, it sits on the critical path of every step and pins a second model copy on the
learner's device for stale versions. Here it runs beside the learner, on its own device if configured, and the
learner takes the verifier's recompute as π_b (it is stored with each accepted result).

Verifying against the published snapshot — the exact bytes the clients downloaded — rather than against the
learner's live weights is also the more faithful check: a snapshot published in bf16 is what honest clients
generated from.

Requests that are queued together for the same version are recomputed in one batched forward pass (up to
``MICRO_BATCH`` completions), so a burst of results costs one pass instead of one per result. Nothing waits to
form a batch: a lone request is computed at once.

The model is built once from the first snapshot's config and every version's weights are read into it in place
(shared.adapters.read_model / load_weights_in_place: tensor by tensor with ordinary reads, so loading costs no second
copy and no resident file mapping), keeping at most ``cached_versions`` replicas in memory (least recently used
dropped). The held-out evaluation borrows the replica (:meth:`Verifier.lend`) instead of loading a model of its own:
the role's memory is the replica plus bounded temporaries (issue 23: at most 1.5× the replica while evaluating).

On FSDP ranks (``verification.placement = "fsdp"``, ``ranks`` given): rank 0's Verifier leads, the other ranks'
Verifiers follow (coordinator.engine.fsdp). Each version is loaded whole on every rank and then sharded (fully_shard), so
a version is always a fresh load rather than an in-place one; which version to drop is rank 0's choice, sent with
the load, so every rank keeps the same ones. A recompute batch is split as the learner splits a step's batch
(rank r takes every N-th completion; every rank runs as many forward passes, a rank without a share running a
throw-away one, because each pass is a collective) and the rows are gathered back to rank 0 in their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from coordinator.core.verify import TokenStats
from coordinator.engine import fsdp
from coordinator.engine.weights import load_full_state
from coordinator.errors import VersionGone
from shared.adapters import load_weights_in_place, read_model
from shared.policy import completion_stats
from shared.sampler import Segment

if TYPE_CHECKING:
    from torch import Tensor

    from coordinator.engine.fsdp import Ranks

logger = logging.getLogger(__name__)

MICRO_BATCH = 64  # completions per forward pass, as the learner's

# Loads a version folder's weights as a plain (Hugging Face names) state dict on a device: for layouts that can
# only give whole state dicts (without one, a version is read into the replica tensor by tensor).
StateLoader = Callable[[Path, str], "dict[str, Tensor]"]
T = TypeVar("T")


class VerifierDescription(TypedDict):
    """What a verifier role's report says of its verifier (coordinator.roles.verifier)."""

    device: str
    cached_versions: list[int]
    ranks: int
    rank_pids: list[int]
    recompute_s: float
    load_s: float
    results: int
    batches: int
    loads: int


@dataclass
class _Request:
    version: int
    prompts: list[list[int]]
    completions: list[list[int]]
    future: asyncio.Future[TokenStats]
    segments: list[list[Segment]] | None = None  # keyed draws per completion: their margins are computed too


@dataclass
class VerifierStats:
    """Cumulative figures for the step metrics and the status page."""

    recompute_s: float = 0.0
    load_s: float = 0.0
    results: int = 0
    batches: int = 0
    loads: int = 0
    per_version_loads: dict[int, int] = field(default_factory=dict)


class Verifier:
    """Recompute at any kept version, off the learner.

    ``folder_of(version)`` returns the published snapshot folder of a version, or None when it is not (or no
    longer) published; ``load_state`` reads a folder's weights as a whole state dict (default: none, each version
    is read into the replica tensor by tensor).
    """

    def __init__(self, folder_of: Callable[[int], Path | None], *, device: str, dtype: str, temperature: float,
                 pad_id: int, stop_ids: Sequence[int], cached_versions: int = 1,
                 load_state: StateLoader | None = None,
                 load_first: Callable[[Path, str, str], Any] | None = None,
                 load_into: Callable[[Any, Path], None] | None = None, ranks: Ranks | None = None,
                 mixed_precision: str = "off") -> None:
        """``ranks``: this worker's FSDP group (coordinator.engine.fsdp), None for a single-device replica;
        ``mixed_precision`` "bf16" gathers the shards and computes in bf16 there."""
        self._folder_of = folder_of
        self.device = device
        self.dtype = dtype
        self.temperature = temperature
        self.pad_id = pad_id
        self.stop_ids = list(stop_ids)
        self._cached = max(1, cached_versions)
        self._load_first = load_first
        # rewrites a loaded replica's weights in place from a version folder (a LoRA layout rewrites only the
        # adapted weights); default: read the folder's tensors into it one by one, or load load_state's dict
        if load_into is None and load_state is not None:
            def load_into(model: Any, folder: Path) -> None:
                load_full_state(model, load_state(folder, self.device), folder)
        self._load_into = load_into or load_weights_in_place
        self._ranks = ranks
        self.mixed_precision = mixed_precision
        self._models: OrderedDict[int, Any] = OrderedDict()  # version → model, most recently used last
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier")
        self._queue: list[_Request] = []
        self._lock = threading.Lock()
        self._answering = 0  # requests queued or being answered (recomputes, loads ahead)
        self._quiet = threading.Event()  # set while that is 0: what the evaluator waits for (wait_quiet)
        self._quiet.set()
        self._worker: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self.stats = VerifierStats()

    # -- public, called from the event loop -----------------------------------------------------------------
    async def recompute(self, prompts: list[list[int]], completions: list[list[int]], version: int
                        ) -> list[list[float]]:
        """Per-token logprobs of each completion under ``version`` (raises VersionGone if it is not kept)."""
        return (await self.recompute_stats(prompts, completions, version)).logprobs

    async def recompute_stats(self, prompts: list[list[int]], completions: list[list[int]], version: int,
                              segments: list[list[Segment]] | None = None) -> TokenStats:
        """:meth:`recompute` plus each position's entropy and surprisal variance, from the same forward pass
        (for the sampling test, coordinator.core.verify.check_sampling); with ``segments`` (the keyed draws of
        each completion, shared.sampler.Segment), also each token's keyed-sampler margin
        (coordinator.core.verify.check_choices)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TokenStats] = loop.create_future()
        with self._answering_one():
            self._queue.append(_Request(version, prompts, completions, fut, segments))
            self._ensure_worker()
            assert self._wake is not None
            self._wake.set()
            return await fut

    async def preload(self, version: int) -> bool:
        """Load ``version`` before its first request arrives (a version just published), on the verifier's thread
        and so in turn with recomputes; False if it is no longer kept. Loading is then off the critical path of the
        version's first result."""
        try:
            with self._answering_one():
                await self.run(self._model_at, version)
        except VersionGone:
            return False
        except Exception:  # the first request for the version tries again and reports it to its asker
            logger.exception("loading version %d ahead of its results failed", version)
            return False
        return True

    def lend(self, version: int, fn: Callable[[Any], T]) -> T:
        """``fn(model)`` with the replica holding ``version``, run on the verifier's thread between recomputes; for
        another thread (the held-out evaluator's), which waits for it. The evaluation then needs no model of its
        own: the replica is the policy it would have loaded (the same snapshot, read the same way). A recompute
        queued meanwhile waits for ``fn`` to return, so a borrower keeps each call short (one batch). Raises
        VersionGone when ``version`` is no longer kept. Not on FSDP ranks (there a pass is a collective)."""
        if self._ranks is not None:
            raise ValueError("a verifier on FSDP ranks cannot lend its sharded replica: evaluate with a model of "
                             "the evaluator's own")
        if threading.current_thread().name.startswith("verifier"):
            raise RuntimeError("Verifier.lend called on the verifier's own thread: it would wait for itself")
        return self._executor.submit(self._with_model, version, fn).result()

    def _with_model(self, version: int, fn: Callable[[Any], T]) -> T:
        return fn(self._model_at(version))

    def wait_quiet(self, timeout: float) -> bool:
        """Block (a thread, not the loop) until no request is queued or being answered, at most ``timeout`` s;
        True if quiet. Held-out evaluation waits for this between chunks: a result's verification is on a
        client's and the learner's critical path, an evaluation on nobody's."""
        return self._quiet.wait(timeout)

    @contextlib.contextmanager
    def _answering_one(self) -> Iterator[None]:
        with self._lock:
            self._answering += 1
            self._quiet.clear()
        try:
            yield
        finally:
            with self._lock:
                self._answering -= 1
                if self._answering == 0:
                    self._quiet.set()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the verifier's thread (for work that must not interleave with a recompute)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self._executor.shutdown(wait=True)
        self._models.clear()

    def describe(self) -> VerifierDescription:
        s = self.stats
        ranks = self._ranks
        return {"device": self.device, "cached_versions": list(self._models),
                "ranks": 1 if ranks is None else ranks.world_size,
                "rank_pids": [] if ranks is None else [p.pid for p in ranks.followers], "recompute_s": s.recompute_s,
                "load_s": s.load_s, "results": s.results, "batches": s.batches,
                "loads": s.loads}

    # -- batching worker --------------------------------------------------------------------------------------
    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._drain(), name="verifier")

    async def _drain(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._take_batch()
                try:
                    out = await loop.run_in_executor(self._executor, self._recompute_batch, batch)
                except BaseException as exc:  # every waiter hears the failure; the worker keeps serving
                    for req in batch:
                        if not req.future.done():
                            req.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                for req, rows in zip(batch, out, strict=True):
                    if not req.future.done():
                        req.future.set_result(rows)

    def _take_batch(self) -> list[_Request]:
        """The oldest request plus those queued behind it for the same version, up to MICRO_BATCH completions."""
        first = self._queue.pop(0)
        batch, size = [first], len(first.completions)
        rest: list[_Request] = []
        for req in self._queue:
            if req.version == first.version and size + len(req.completions) <= MICRO_BATCH:
                batch.append(req)
                size += len(req.completions)
            else:
                rest.append(req)
        self._queue = rest
        return batch

    # -- on the verifier thread -------------------------------------------------------------------------------
    def _recompute_batch(self, batch: list[_Request]) -> list[TokenStats]:
        t0 = time.monotonic()
        model = self._model_at(batch[0].version)
        prompts = [p for req in batch for p in req.prompts]
        completions = [c for req in batch for c in req.completions]
        segments = [seg for req in batch for seg in (req.segments or [[] for _ in req.completions])]
        if self._ranks is None:
            rows, ents, vars_, tops, margins = token_rows(model, prompts, completions, segments,
                                                          self.temperature, self.pad_id)
        else:
            rows, ents, vars_, tops, margins = self._in_group("recompute", self._recompute_rows, batch[0].version,
                                                              prompts, completions, segments)
        out: list[TokenStats] = []
        k = 0
        for req in batch:
            n = len(req.completions)
            out.append(TokenStats(rows[k : k + n], ents[k : k + n], vars_[k : k + n], tops[k : k + n],
                                  margins[k : k + n] if req.segments is not None else None))
            k += n
        self.stats.recompute_s += time.monotonic() - t0
        self.stats.results += len(batch)
        self.stats.batches += 1
        return out

    def _recompute_rows(self, version: int, prompts: list[list[int]], completions: list[list[int]],
                        segments: list[list[Segment]]) -> tuple[list[list[float]], ...]:
        """Every rank: its share of the batch (every N-th completion), gathered back to rank 0 in order."""
        ranks = self._ranks
        assert ranks is not None
        fsdp.lead(ranks, "_recompute_rows", version, prompts, completions, segments)
        n, r = ranks.world_size, ranks.rank
        passes = math.ceil(math.ceil(len(completions) / n) / MICRO_BATCH)  # of the largest share
        mine = token_rows(self._models[version], prompts[r::n], completions[r::n], segments[r::n],
                          self.temperature, self.pad_id, ranked=True, passes=passes)
        shares = fsdp.gather(ranks, mine)
        if shares is None:
            return ([], [], [], [], [])
        out: tuple[list[list[float]], ...] = ([], [], [], [], [])
        for i in range(len(completions)):
            for dst, col in zip(out, shares[i % n], strict=True):
                dst.append(col[i // n])
        return out

    def _in_group(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Rank 0: run a led operation; a failure mid-collective breaks the group (coordinator.engine.fsdp.broken)."""
        assert self._ranks is not None
        try:
            return fn(*args)
        except VersionGone:
            raise
        except Exception as exc:
            fsdp.broken(self._ranks, f"{what} on the verifier's ranks failed: {type(exc).__name__}: {exc}")
            raise  # not reached

    def model_at(self, version: int) -> Any:
        """The replica holding ``version``, loaded (or another rewritten in place) if need be, for a caller on a
        verifier's thread that computes with it otherwise (coordinator.engine.torch_replay). Raises VersionGone."""
        return self._model_at(version)

    def _model_at(self, version: int) -> Any:
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        folder = self._folder_of(version)
        if folder is None:
            raise VersionGone(f"policy version {version} is no longer kept for verification")
        t0 = time.monotonic()
        if self._ranks is not None:
            drop = next(iter(self._models)) if len(self._models) >= self._cached else None
            model = self._in_group("load", self._load_version, version, str(folder), drop)
            if model is None:
                raise VersionGone(f"policy version {version} is no longer kept for verification")
            self._count_load(version, t0)
            return model
        try:
            if len(self._models) >= self._cached:  # reuse the least recently used replica's memory
                _, model = self._models.popitem(last=False)
                self._load_into(model, folder)
            elif self._models:
                import copy

                model = copy.deepcopy(next(iter(self._models.values())))
                self._load_into(model, folder)
            else:
                model = self._first_model(folder)
        except FileNotFoundError:  # pruned between the lookup and the read
            raise VersionGone(f"policy version {version} is no longer kept for verification") from None
        model.eval()
        self._models[version] = model
        self._count_load(version, t0)
        return model

    def _count_load(self, version: int, t0: float) -> None:
        self.stats.load_s += time.monotonic() - t0
        self.stats.loads += 1
        self.stats.per_version_loads[version] = self.stats.per_version_loads.get(version, 0) + 1

    def _load_version(self, version: int, folder: str, drop: int | None) -> Any:
        """Every rank: drop version ``drop``'s shards, load ``folder`` whole and shard it; None (on every rank) when
        any rank found the folder gone."""
        ranks = self._ranks
        assert ranks is not None
        fsdp.lead(ranks, "_load_version", version, folder, drop)
        if drop is not None:
            self._models.pop(drop, None)
        try:
            model = self._first_model(Path(folder)).eval()
        except FileNotFoundError:  # pruned since rank 0 looked
            model = None
        (gone,) = fsdp.all_reduce(ranks, [float(model is None)], "max")
        if gone:
            return None
        fsdp.shard(model, ranks, self.mixed_precision)
        self._models[version] = model
        return model

    def _first_model(self, folder: Path) -> Any:
        if self._load_first is not None:
            return self._load_first(folder, self.device, self.dtype)

        return read_model(folder, self.device, self.dtype)


def token_rows(model: Any, prompts: list[list[int]], completions: list[list[int]], segments: list[list[Segment]],
               temperature: float, pad_id: int, *, ranked: bool = False, passes: int = 0
               ) -> tuple[list[list[float]], ...]:
    """Per-token (logprobs, entropy, surprisal variance, top logprob, keyed-sampler margin) of each completion,
    MICRO_BATCH at a time; at least ``passes`` forward passes (those past the completions run on the first one,
    discarded). ``segments``: each completion's keyed draws (none: margins of 0). ``ranked``: on FSDP ranks,
    where every rank must run the same passes, so each GRPO group's prompt is not shared."""
    import torch

    cols: tuple[list[list[float]], ...] = ([], [], [], [], [])
    with torch.no_grad():
        for s in range(0, max(len(completions), passes * MICRO_BATCH), MICRO_BATCH):
            chunk, chunk_prompts = completions[s : s + MICRO_BATCH], prompts[s : s + MICRO_BATCH]
            chunk_segments = segments[s : s + MICRO_BATCH]
            spare = not chunk  # this rank's share is used up: a pass for the collectives only
            if spare:
                chunk, chunk_prompts = completions[:1] or [[pad_id]], prompts[:1] or [[pad_id]]
                chunk_segments = [[]]
            keyed = any(chunk_segments)
            stats = completion_stats(model, chunk_prompts, chunk, temperature=temperature, pad_id=pad_id,
                                     share_prompts=not ranked, segments=chunk_segments if keyed else None)
            margins = stats.margins if stats.margins is not None else torch.zeros_like(stats.logprobs)
            if not spare:
                for dst, t in zip(cols, (*stats[:4], margins), strict=True):
                    dst.extend(r[: len(c)] for r, c in zip(t.tolist(), chunk, strict=True))
    return cols

