"""The recompute of a llama.cpp client's result by llama.cpp, on the very GGUF file the client ran.

Why not torch: a llama.cpp client samples from the model in the snapshot's GGUF precision (f16, q8_0, q4_K_M, ...).
Compared with a torch float32 recompute, the honest gap *is* the quantisation — up to 0.47 logit at f16 and 1.5
at q8_0 on trained policies (docs/benchmarks.md) — so the tolerances had to be that wide, an attacker could spend
them, and a torch client that registered as llama got 25× torch's freedom. Recomputed by llama.cpp on the same
file, like is compared with like, and the learner trains on these logprobs as π_b: the behaviour policy the client
actually sampled from, not the float32 policy it approximates.

How: the verifier replays the client's own evaluations, token by token. llama.cpp computes a batch of tokens with
other kernels than one token (a matrix product instead of a matrix-vector one), and they round differently: a
teacher-forced pass over a whole completion differed from the client's decoding by up to 0.05 logit and 0.1 nats
on a sharp 256-wide model, at every quantised precision. So both sides follow one schedule (shared.llama_files.
prefill): a group's first rollout evaluates its prompt from scratch in one batch, the next ones reuse the prompt's
cache and evaluate its last token, and every sampled token is then evaluated alone — as the client generated it.
A multi-turn episode's turns each start from a fresh context (prompt, earlier actions and observations), as the
client's turns do. On the same kind of machine the logits are then the client's bit for bit (measured: margins 0,
docs/benchmarks.md "Quantised volunteers"); what is left for the tolerance is other hardware (a GPU client against a
CPU verifier: unmeasured, docs/security.md §4). The cost is decoding speed instead of a batched pass.

The model is opened as the client opens it (shared.llama_files.open_model: same context window and batch size, f16
KV cache, same LoRA application). Post-processing (tempered log-softmax, entropy, surprisal variance, keyed margins)
is shared.policy's and shared.sampler's own torch code on the llama.cpp logits, so each statistic means exactly what
it means for a torch recompute. Calls run on the verifier's thread (coordinator.engine.verifier.Verifier.run), in
turn with the torch recomputes, so the two never compete for the cores.
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
from coordinator.engine.verifier import VerifierStats
from coordinator.errors import VersionGone
from shared.llama_files import file_id, last_logits, open_model, prefill, set_adapter, version_files
from shared.policy import entropy_variance
from shared.sampler import Segment, margins_torch

logger = logging.getLogger(__name__)


@dataclass
class _Loaded:
    llm: Any
    adapter: Any = None
    adapter_id: tuple[int, int, int] | None = None


class LlamaRecompute:
    """Replays of llama.cpp clients' evaluations over published versions' GGUF files, ``cached_versions`` models
    kept (least recently used dropped; a LoRA run's versions share one base model and swap adapters)."""

    def __init__(self, folder_of: Callable[[int], Path | None], *, temperature: float, threads: int | None,
                 cached_versions: int = 1, base_dir: Path | None = None) -> None:
        """``base_dir``: where a LoRA run keeps its base GGUF (the versions' folders hold only their adapters)."""
        self._folder_of = folder_of
        self._base_dir = base_dir
        self.temperature = temperature
        self.threads = threads
        self._cached = max(1, cached_versions)
        self._models: OrderedDict[tuple[int, int, int], _Loaded] = OrderedDict()  # model file → loaded model
        self._lock = threading.Lock()  # one pass at a time per process: a llama.cpp context is not thread-safe
        self.stats = VerifierStats()  # results, recompute_s, loads, load_s as the torch verifier counts them

    def recompute_stats(self, version: int, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                        segments: Sequence[Sequence[Segment]] | None, group: int = 1,
                        precision: str | None = None) -> TokenStats:
        """Logprobs, entropy, surprisal variance, largest logprob and (with ``segments``) keyed margins of each
        completion token under ``version``'s GGUF, as coordinator.engine.verifier.Verifier computes them from
        torch. ``group``: completions per prompt (each group's first rollout evaluated its prompt from scratch);
        1 for episodes, whose every turn started from a fresh context. A position no segment covers (an episode's
        observation tokens: never sampled, never trained) gets uniform logits. ``precision``: the GGUF file the
        result's lease named (None: the run's default, ``model.gguf``). Raises VersionGone if the version is not (or
        no longer) published in it."""
        import numpy as np
        import torch

        with self._lock:
            t0 = time.monotonic()
            llm = self._model_at(version, precision)
            row = np.empty(llm.n_vocab(), dtype=np.float32)
            out: dict[str, list[list[float]]] = {k: [] for k in ("logprobs", "entropy", "variance", "top", "margins")}
            for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                spans = [(o, n) for _k, _r, o, n in segments[i]] if segments is not None else [(0, len(completion))]
                rows = _replay(llm, list(prompt), list(completion), spans, i % max(1, group) == 0, row)
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

    def _model_at(self, version: int, precision: str | None = None) -> Any:
        folder = self._folder_of(version)
        if folder is None:
            raise VersionGone(f"policy version {version} is no longer kept for verification")
        try:
            model_path, adapter = version_files(folder, self._base_dir, precision)
            ident = file_id(model_path)
        except FileNotFoundError as exc:
            raise VersionGone(str(exc)) from None
        loaded = self._models.get(ident)
        if loaded is None:
            t0 = time.monotonic()
            while len(self._models) >= self._cached:
                self._models.popitem(last=False)
            loaded = _Loaded(open_model(model_path, threads=self.threads))
            self._models[ident] = loaded
            self.stats.loads += 1
            self.stats.load_s += time.monotonic() - t0
            logger.info("llama.cpp verifier loaded %s for version %d", model_path.name, version)
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


def _replay(llm: Any, prompt: list[int], completion: list[int], spans: list[tuple[int, int]], fresh: bool,
            row: Any) -> Any:
    """The float32 logits [len(completion), n_vocab] the client computed for each completion token, by replaying its
    evaluations (module docstring): per span (offset, count) of sampled tokens, the context ``prompt +
    completion[:offset]`` prefilled (the first span: fresh or reusing the group's prompt, as the client did; later
    ones — an episode's turns — fresh), then each token's logits read and the token evaluated, one at a time."""
    import numpy as np

    rows = np.zeros((len(completion), row.shape[0]), dtype=np.float32)
    for k, (offset, count) in enumerate(spans):
        prefill(llm, prompt + completion[:offset], fresh=fresh or k > 0)
        for j in range(count):
            last_logits(llm, row)
            rows[offset + j] = row
            if j < count - 1:
                llm.eval([completion[offset + j]])
    return rows
