"""The recompute of a torch client's result in the dtype the client computed in (bfloat16: a 7 B policy does not fit
a consumer GPU in float32), replaying the client's own evaluations.

Why not the verifier's float32 pass: against it, a bf16 client's honest gap is bf16 rounding — keyed margins up to
0.18 logit and single-token |Δ logprob| up to 0.52 nats on the tiny model (docs/benchmarks.md, "torch in bf16"), so
its tolerance would have to be ten times torch's. Why not one bf16 teacher-forced pass either: bf16 results depend on
the schedule (a batched pass rounds otherwise than one-token decoding, and a batch's rows and width change the
kernels: up to 0.047 logit and 0.11 nats on the same CPU). So, as coordinator.engine.llama_verifier does for
llama.cpp, the verifier replays what the client ran — shared.policy.replay_stats: every generation's rows prefilled
together, then one token at a time on the KV cache, in the same dtype — and on the same kind of CPU has the client's
logits bit for bit. What is left for the tolerance is other hardware (a CUDA or MPS bf16 client against a CPU
verifier: unmeasured, docs/security.md §4).

The replica is loaded as the client loads it (a float32 or bf16 snapshot rounded to ``dtype`` when read, the same
tensors and buffers as transformers' ``from_pretrained(dtype=...)``; a LoRA version through the role's loaders).
Calls run on the verifier's thread (coordinator.engine.verifier.Verifier.run), in turn with the other recomputes.
The cost is decoding speed, a request at a time (a replay cannot be batched with other results: the batch's rows are
part of the arithmetic).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from coordinator.core.verify import TokenStats
from coordinator.engine.verifier import VerifierStats
from coordinator.errors import VersionGone
from shared.adapters import load_weights_in_place, read_model
from shared.policy import replay_stats
from shared.sampler import Segment

logger = logging.getLogger(__name__)

#: The compute dtypes a torch client may report, each with its replay's class ("torch-bf16"; float32 results are
#: recomputed by the verifier's one batched pass, class "torch").
ComputeDtype = Literal["float32", "bfloat16"]


class TorchReplay:
    """Replays of torch clients' generations at ``dtype``, ``cached_versions`` replicas kept (least recently used
    reloaded in place). ``load_first(folder, device, dtype)`` / ``load_into(model, folder)``: the role's loaders for a
    LoRA run (coordinator.engine.lora.VersionLoader); default: the folder's whole weights."""

    def __init__(self, folder_of: Callable[[int], Path | None], *, dtype: ComputeDtype = "float32", device: str,
                 temperature: float, pad_id: int, cached_versions: int = 1,
                 load_first: Callable[[Path, str, str], Any] | None = None,
                 load_into: Callable[[Any, Path], None] | None = None) -> None:
        self._folder_of = folder_of
        self.dtype = dtype
        self.device = device
        self.temperature = temperature
        self.pad_id = pad_id
        self._cached = max(1, cached_versions)
        self._load_first = load_first or read_model
        self._load_into = load_into or load_weights_in_place
        self._models: OrderedDict[int, Any] = OrderedDict()  # version → replica, most recently used last
        self._lock = threading.Lock()
        self.stats = VerifierStats()

    def recompute_stats(self, version: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                        segments: Sequence[Sequence[Segment]] | None) -> TokenStats:
        """Logprobs, entropy, surprisal variance, largest logprob and (with ``segments``) keyed margins of each
        completion token under ``version``, as the client computed them (shared.policy.replay_stats: the segments say
        which rows were generated together). Raises VersionGone if the version is not (or no longer) published."""
        with self._lock:
            t0 = time.monotonic()
            model = self._model_at(version)
            stats = replay_stats(model, prompts, completions, temperature=self.temperature, pad_id=self.pad_id,
                                 segments=segments)
            logprobs, entropy, variance, top = ([row[: len(c)] for row, c in zip(t.tolist(), completions, strict=True)]
                                                for t in stats[:4])
            margins = None
            if stats.margins is not None:
                margins = [row[: len(c)] for row, c in zip(stats.margins.tolist(), completions, strict=True)]
            self.stats.results += 1
            self.stats.recompute_s += time.monotonic() - t0
        return TokenStats(logprobs, entropy, variance, top, margins)

    def _model_at(self, version: int) -> Any:
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        folder = self._folder_of(version)
        if folder is None:
            raise VersionGone(f"policy version {version} is no longer kept for verification")
        t0 = time.monotonic()
        try:
            if len(self._models) >= self._cached:  # the least recently used replica's memory, rewritten in place
                _, model = self._models.popitem(last=False)
                self._load_into(model, folder)
            else:
                model = self._load_first(folder, self.device, self.dtype)
        except FileNotFoundError:  # pruned between the lookup and the read
            raise VersionGone(f"policy version {version} is no longer kept for verification") from None
        self._models[version] = model.eval()
        self.stats.loads += 1
        self.stats.load_s += time.monotonic() - t0
        logger.info("torch %s replay loaded version %d", self.dtype, version)
        return model

    def close(self) -> None:
        with self._lock:
            self._models.clear()

    def describe(self) -> dict[str, float]:
        s, tag = self.stats, "torch_" + {"float32": "f32", "bfloat16": "bf16"}[self.dtype]
        return {f"{tag}_results": s.results, f"{tag}_recompute_s": s.recompute_s, f"{tag}_loads": s.loads,
                f"{tag}_load_s": s.load_s}
