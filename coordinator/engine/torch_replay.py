"""The recompute of a torch client's result in the dtype the client computed in (bfloat16: a 7 B policy does not fit
a consumer GPU in float32), replaying the client's own evaluations.

Why not the verifier's float32 pass: against it, a bf16 client's honest gap is bf16 rounding — keyed margins up to
0.53 logit and single-token |Δ logprob| up to 0.61 nats on the tiny models (docs/benchmarks.md, "torch clients
computing in bf16"), so its tolerance would have to be 25 times torch's. Why not one bf16 teacher-forced pass
either: bf16 results depend on the schedule (a batched pass rounds otherwise than one-token decoding, and a batch's
rows and width change the kernels: up to 0.047 logit and 0.11 nats on the same CPU). So, as
coordinator.engine.llama_verifier does for llama.cpp, the verifier replays what the client ran —
shared.policy.replay_stats: every generation's rows prefilled together, then one token at a time on the KV cache, in
the same dtype — and on the same kind of CPU has the client's logits bit for bit. What is left for the tolerance is
other hardware (a CUDA or MPS bf16 client against a CPU verifier: unmeasured, docs/security.md §4).

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from coordinator.core.verify import TokenStats
from coordinator.engine.verifier import Verifier, VerifierStats
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
        self.dtype = dtype
        self.temperature = temperature
        self.pad_id = pad_id
        # the replicas at ``dtype``, kept and loaded as the verifier keeps its own (never started: no thread of its
        # own, its replicas are only read here, on the calling verifier's thread)
        self._replicas = Verifier(folder_of, device=device, dtype=dtype, temperature=temperature, pad_id=pad_id,
                                  stop_ids=[], cached_versions=cached_versions, load_first=load_first,
                                  load_into=load_into)
        self._lock = threading.Lock()
        self.stats = VerifierStats()

    def recompute_stats(self, version: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                        segments: Sequence[Sequence[Segment]] | None) -> TokenStats:
        """Logprobs, entropy, surprisal variance, largest logprob and (with ``segments``) keyed margins of each
        completion token under ``version``, as the client computed them (shared.policy.replay_stats: the segments say
        which rows were generated together). Raises VersionGone if the version is not (or no longer) published.
        Call it on the verifier's thread (Verifier.run)."""
        with self._lock:
            t0 = time.monotonic()
            model = self._replicas.model_at(version)
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

    def close(self) -> None:
        with self._lock:
            self._replicas.close()

    def describe(self) -> dict[str, float]:
        s, loads, tag = self.stats, self._replicas.stats, "torch_" + {"float32": "f32", "bfloat16": "bf16"}[self.dtype]
        return {f"{tag}_results": s.results, f"{tag}_recompute_s": s.recompute_s, f"{tag}_loads": loads.loads,
                f"{tag}_load_s": loads.load_s}
