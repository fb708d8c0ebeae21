"""The recompute of a llama.cpp client's result by llama.cpp, on the very GGUF file the client ran.

Why not torch: a llama.cpp client samples from the model in the snapshot's GGUF precision (f16, q8_0, q4_K_M, ...).
Compared with a torch float32 recompute, the honest gap *is* the quantisation — up to 0.47 logit at f16 and 1.5
at q8_0 on trained policies (docs/benchmarks.md) — so the tolerances had to be that wide, an attacker could spend
them, and a torch client that registered as llama got 25× torch's freedom. Recomputed by llama.cpp on the same
file, like is compared with like: what is left is the difference between one-token decoding (the client) and one
teacher-forced pass (here), which llama.cpp computes with the same kernels on the same kind of CPU (measured in
docs/benchmarks.md, "Quantised volunteers"). Every check — the logprob check, every token's keyed choice, the
sampling test — reads this one pass, and the learner trains on its logprobs as π_b: the behaviour policy the
client actually sampled from, not the float32 policy it approximates.

The model is opened as the client opens it (shared.llama_files: same batch size, f16 KV cache, same LoRA
application), with every position's logits kept (``logits_all``). The prompt a GRPO group shares is evaluated
once. Post-processing (tempered log-softmax, entropy, surprisal variance, keyed margins) is shared.policy's and
shared.sampler's own torch code on the llama.cpp logits, so each statistic means exactly what it means for a
torch recompute. Calls run on the verifier's thread (coordinator.engine.verifier.Verifier.run), in turn with the
torch recomputes, so the two never compete for the cores.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.core.verify import TokenStats
from coordinator.errors import VersionGone
from shared.llama_files import file_id, keep_prefix, open_model, set_adapter, version_files
from shared.policy import entropy_variance
from shared.sampler import Segment, margins_torch

logger = logging.getLogger(__name__)

#: Context windows are sized to the longest sequence seen, rounded up to this: the logits of every position are
#: kept (n_ctx × n_vocab floats: 0.3 GB at n_ctx 512 and a 152 k vocabulary), so no larger window than needed.
CTX_STEP = 256


@dataclass
class LlamaStats:
    """Cumulative figures for the verifier's report."""

    results: int = 0
    recompute_s: float = 0.0
    loads: int = 0
    load_s: float = 0.0


@dataclass
class _Loaded:
    llm: Any
    base_id: tuple[int, int, int]
    adapter: Any = None
    adapter_id: tuple[int, int, int] | None = None


class LlamaRecompute:
    """Teacher-forced llama.cpp passes over published versions' GGUF files, ``cached_versions`` models kept (least
    recently used dropped; a LoRA run's versions share one base model and swap adapters)."""

    def __init__(self, folder_of: Callable[[int], Path | None], *, temperature: float, threads: int | None,
                 cached_versions: int = 1) -> None:
        self._folder_of = folder_of
        self.temperature = temperature
        self.threads = threads
        self._cached = max(1, cached_versions)
        self._models: OrderedDict[tuple[int, int, int], _Loaded] = OrderedDict()  # model file → loaded model
        self._n_ctx = CTX_STEP
        self._lock = threading.Lock()  # one pass at a time per process: a llama.cpp context is not thread-safe
        self.stats = LlamaStats()

    def recompute_stats(self, version: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                        segments: Sequence[Sequence[Segment]] | None) -> TokenStats:
        """Logprobs, entropy, surprisal variance, largest logprob and (with ``segments``) keyed margins of each
        completion token under ``version``'s GGUF, as coordinator.engine.verifier.Verifier computes them from
        torch. Raises VersionGone if the version is not (or no longer) published."""
        import torch

        with self._lock:
            t0 = time.monotonic()
            longest = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
            llm = self._model_at(version, longest)
            out: dict[str, list[list[float]]] = {k: [] for k in ("logprobs", "entropy", "variance", "top", "margins")}
            for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                rows = _teacher_forced(llm, list(prompt), list(completion))
                tempered = torch.from_numpy(rows) / self.temperature  # float32 l/T, as the client's sampler
                ids = torch.tensor(list(completion), dtype=torch.long)
                logp_all = torch.log_softmax(tempered, -1)
                entropy, variance = entropy_variance(logp_all)
                out["logprobs"].append(logp_all.gather(1, ids[:, None]).squeeze(1).tolist())
                out["entropy"].append(entropy.tolist())
                out["variance"].append(variance.tolist())
                out["top"].append(logp_all.max(-1).values.tolist())
                if segments is not None:  # scores l/T + G from the tempered logits, as completion_stats does
                    out["margins"].append(margins_torch(tempered[None], ids[None], 1.0, [segments[i]])[0].tolist())
            self.stats.results += 1
            self.stats.recompute_s += time.monotonic() - t0
        return TokenStats(out["logprobs"], out["entropy"], out["variance"], out["top"],
                          out["margins"] if segments is not None else None)

    def _model_at(self, version: int, longest: int) -> Any:
        folder = self._folder_of(version)
        if folder is None:
            raise VersionGone(f"policy version {version} is no longer kept for verification")
        try:
            model_path, adapter = version_files(folder)
            ident = file_id(model_path)
        except FileNotFoundError as exc:
            raise VersionGone(str(exc)) from None
        need = -(-(longest + 1) // CTX_STEP) * CTX_STEP
        if need > self._n_ctx:  # a longer sequence than any before: every model is reopened with the larger window
            self._models.clear()
            self._n_ctx = need
        loaded = self._models.get(ident)
        if loaded is None:
            t0 = time.monotonic()
            while len(self._models) >= self._cached:
                self._models.popitem(last=False)
            loaded = _Loaded(open_model(model_path, n_ctx=self._n_ctx, threads=self.threads, logits_all=True), ident)
            self._models[ident] = loaded
            self.stats.loads += 1
            self.stats.load_s += time.monotonic() - t0
            logger.info("llama.cpp verifier loaded %s for version %d (n_ctx %d)", model_path.name, version,
                        self._n_ctx)
        self._models.move_to_end(ident)
        adapter_id = file_id(adapter) if adapter is not None else None
        if adapter_id != loaded.adapter_id:
            loaded.adapter = set_adapter(loaded.llm, adapter, loaded.adapter)
            loaded.adapter_id = adapter_id
        return loaded.llm

    def close(self) -> None:
        with self._lock:
            self._models.clear()

    def describe(self) -> dict[str, float]:
        s = self.stats
        return {"llama_results": s.results, "llama_recompute_s": s.recompute_s, "llama_loads": s.loads,
                "llama_load_s": s.load_s}


def _teacher_forced(llm: Any, prompt: list[int], completion: list[int]) -> Any:
    """The float32 logits [len(completion), n_vocab] that predict each completion token: prompt and completion
    (but its last token) evaluated in batches of up to shared.llama_files.N_BATCH tokens, the KV cache of the
    prompt reused when the previous sequence shared it."""
    import numpy as np

    sequence = prompt + completion[:-1]
    kept = keep_prefix(llm, sequence, len(prompt))
    if kept < len(sequence):
        llm.eval(sequence[kept:])
    start = len(prompt) - 1
    return np.array(llm.scores[start : start + len(completion)], dtype=np.float32, copy=True)
