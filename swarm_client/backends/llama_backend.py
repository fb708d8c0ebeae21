"""llama.cpp backend (llama-cpp-python): generates a job's completions from the version's GGUF snapshot.

A version is either one full GGUF (``model.gguf``) or a base GGUF plus a per-version LoRA adapter
(``base.gguf`` + ``adapter.gguf``). The base is loaded once; a new version's adapter is swapped in with the
low-level adapter API without reloading it, and the context is reset afterwards (otherwise the KV cache built
under the old adapter is reused).

Tokens are chosen by the keyed sampler (shared.sampler) from the logits llama.cpp computes, so the verifier can
check every choice; llama.cpp's sampler (truncating by default, and seeded per instance) is not used. Behaviour
logprobs are computed here as ``log_softmax(logits / T)`` of the sampled token from the logits it was chosen
from, not taken from ``create_completion`` (raw, untempered, and misaligned by BOS).
Prompts arrive as token ids from the signed job, so llama.cpp's tokenizer is never used to encode.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shared.llama_files import N_CTX, file_id, gguf_precision, open_model, prefill, set_adapter, version_files
from shared.messages import Job
from shared.policy import Sampled
from shared.sampler import choose_np

logger = logging.getLogger(__name__)

GGUF_FORMS = frozenset({"gguf", "gguf-base", "gguf-lora"})


def log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: list[int], temperature: float,
                   work: np.ndarray | None = None) -> list[float]:
    """log_softmax(logits / T)[i, tokens[i]] for each row i: ``logit/T − max − log Σ exp(logits/T − max)``, the
    exponentials in float32 summed in float64, the picked logit in float64 (within 1e-6 nats of a float64
    log-softmax, 3.5× faster at a 152 k vocabulary: the whole-row float64 pass was a client's largest per-token
    cost after decoding, bench/choice_cost.py). Each row's result depends on that row alone, whatever the rows
    batched with it. ``work``: a float32 array of at least the logits' shape to compute in (no fresh pages)."""
    n = len(tokens)
    out = None if work is None else work[:n]
    z = np.multiply(logits[:n], np.float32(1.0 / temperature), out=out, dtype=np.float32)
    top = z.max(axis=-1, keepdims=True)
    z -= top
    np.exp(z, out=z)
    lse = np.log(z.sum(axis=-1, dtype=np.float64))
    picked = logits[np.arange(n), tokens].astype(np.float64) / temperature - top[:, 0].astype(np.float64)
    return [float(x) for x in picked - lse]


#: Logits kept between two log-softmax passes. Cache-sized: 6 rows of a 152 k vocabulary stay in the CPU's last-level
#: cache from their copy to their log-softmax, where 110 rows (64 MiB, as before) went to memory and back, and a
#: batch's temporaries were fresh pages each time (0.46 → 0.17 ms a token, one core; a small vocabulary still gets
#: hundreds of rows, so its per-call overhead stays amortised).
LOGIT_BUFFER_BYTES = 4 * 2**20


class LlamaBackend:
    name = "llama"
    kind = "llama"
    forms = GGUF_FORMS

    def __init__(self, device: str = "auto", threads: int | None = None, n_gpu_layers: int | None = None,
                 n_ctx: int = N_CTX, kv_f32: bool = False) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.threads = threads
        # -1 offloads every layer to the GPU llama.cpp was built for (Metal, CUDA); CPU builds ignore it
        if n_gpu_layers is None:
            n_gpu_layers = 0 if device == "cpu" else -1
        self.n_gpu_layers = n_gpu_layers
        self.device = "cpu" if n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload() else "gpu"
        self.n_ctx = n_ctx
        self.kv_f32 = kv_f32
        self.llm: Any = None
        self.precision = "unknown"
        self._base_id: tuple[int, int, int] | None = None
        self._adapter: Any = None
        self._adapter_id: tuple[int, int, int] | None = None
        self.folder: Path | None = None
        self._rows: np.ndarray | None = None  # per-step logits of the rollout being sampled (see sample)
        self._work: np.ndarray | None = None  # the log-softmax's scratch, the shape of _rows

    @property
    def backend_class(self) -> str:
        """What the verifier's tolerance depends on: the library and the GGUF precision, e.g. ``llama-f16``."""
        return f"llama-{self.precision}"

    def load(self, folder: Path) -> None:
        """Load the GGUF form of a version folder; a no-op when its files are those already loaded (by file
        identity, not by the folder's name: a folder reassembled for another precision holds another file)."""
        folder = Path(folder)
        model, adapter = version_files(folder)
        self._load_base(model)
        self._set_adapter(adapter)
        self.folder = folder

    def parameters(self) -> int | None:
        return None if self.llm is None else int(self._lib.llama_model_n_params(self.llm.model))

    def unload(self) -> None:
        self._set_adapter(None)
        if self.llm is not None:
            self.llm.close()  # the model and its context, now (llama_cpp.Llama.close)
        self.llm = self._base_id = self.folder = None
        self._adapter_id = None

    def _load_base(self, path: Path) -> None:
        ident = file_id(path)
        if self.llm is not None and ident == self._base_id:
            return
        self._set_adapter(None)
        self.llm = None
        # logits_all=False: the logits of each sampled step are read from the context right after sampling
        # (llama_get_logits_ith), so no n_ctx × n_vocab score matrix is allocated (1.2 GB for a 150k vocabulary)
        self.llm = open_model(path, n_ctx=self.n_ctx, threads=self.threads, n_gpu_layers=self.n_gpu_layers,
                              kv_f32=self.kv_f32)
        self._base_id = ident
        self.precision = gguf_precision(path)
        logger.info("loaded %s (%s, %s)", path, self.precision, self.device)

    def _set_adapter(self, path: Path | None) -> None:
        """Swap the LoRA adapter (None: the bare base) without reloading the base (shared.llama_files)."""
        if self.llm is None:
            return
        ident = file_id(path) if path is not None else None
        if ident == self._adapter_id and (path is None or self._adapter is not None):
            return
        self._adapter = set_adapter(self.llm, path, self._adapter)
        self._adapter_id = ident

    # -- generation ---------------------------------------------------------------------------------------
    def sample(self, prompt: list[int], *, temperature: float, max_tokens: int, stop_ids: frozenset[int],
               key: int, rollout: int, should_stop: Callable[[], bool] | None = None, fresh: bool = True
               ) -> Sampled:
        """One rollout with the keyed sampler (shared.sampler): llama.cpp computes the logits, we choose the token
        and feed it back. llama.cpp's own sampler is never used — its inverse-CDF draw cannot be replayed by
        the verifier.

        Per token, the logits are copied once into a preallocated row (one memmove); the keyed choice runs on that
        row, and the log-softmax runs vectorised over the steps the row buffer holds (converting and normalising
        each step's logits on its own cost a quarter of a small model's decoding time: bench/client_overhead.py),
        in preallocated scratch: nothing per token is allocated beyond a few scalars.

        ``fresh``: the prompt is evaluated from scratch (a group's first rollout), else its cache is reused
        (shared.llama_files.prefill: the schedule the verifier replays)."""
        llm = self.llm
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the context "
                             f"window n_ctx={self.n_ctx}")
        rows, work = self._logit_rows(max_tokens)
        row_bytes = rows.shape[1] * rows.itemsize
        base, memmove, logits_ith, ctx = rows.ctypes.data, ctypes.memmove, self._lib.llama_get_logits_ith, llm.ctx
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        filled = 0
        prefill(llm, list(prompt), fresh=fresh)
        for position in range(max_tokens):
            memmove(base + filled * row_bytes, logits_ith(ctx, -1), row_bytes)
            tok = choose_np(rows[filled], temperature, key, rollout, position)
            filled += 1
            tokens.append(tok)
            if filled == len(rows):
                logprobs.extend(token_logprobs(rows[:filled], tokens[-filled:], temperature, work))
                filled = 0
            if tok in stop_ids:
                finish = "stop"
                break
            if len(tokens) >= max_tokens or (should_stop is not None and should_stop()):
                break
            llm.eval([tok])
        if filled:
            logprobs.extend(token_logprobs(rows[:filled], tokens[-filled:], temperature, work))
        return Sampled(tokens, logprobs, finish)

    def _logit_rows(self, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """A reusable float32 buffer for up to ``max_tokens`` steps of logits, capped at LOGIT_BUFFER_BYTES (a
        152 k-token vocabulary gets 6 rows, flushed whenever full), and the log-softmax's scratch of its shape."""
        n_vocab = self.llm.n_vocab()
        want = max(1, min(max_tokens, LOGIT_BUFFER_BYTES // (4 * n_vocab)))
        if self._rows is None or self._work is None or self._rows.shape[1] != n_vocab or self._rows.shape[0] < want:
            self._rows = np.empty((want, n_vocab), dtype=np.float32)
            self._work = np.empty((want, n_vocab), dtype=np.float32)
        return self._rows, self._work

    def _last_logits(self) -> np.ndarray:
        out = np.empty((1, self.llm.n_vocab()), dtype=np.float32)
        ctypes.memmove(out.ctypes.data, self._lib.llama_get_logits_ith(self.llm.ctx, -1), out.nbytes)
        return out

    def score(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
        """Logprobs of ``completion`` given ``prompt`` (teacher-forced, one token at a time as in decoding): for
        parity measurements and tests."""
        llm = self.llm
        llm.reset()
        llm.eval(list(prompt))
        out: list[float] = []
        for tok in completion:
            out.append(float(log_softmax(self._last_logits(), temperature)[0, tok]))
            llm.eval([tok])
        return out

    def generate(self, job: Job, should_stop: Callable[[], bool]) -> list[Sampled]:
        if self.llm is None:
            raise RuntimeError("no model loaded")
        stops = frozenset(job.sampling.stop_token_ids)
        out: list[Sampled] = []
        for i, p in enumerate(job.prompts):
            for g in range(job.group_size):
                out.append(self.sample(list(p.token_ids), temperature=job.sampling.temperature,
                                       max_tokens=job.sampling.max_tokens, stop_ids=stops, key=job.seed,
                                       rollout=i * job.group_size + g, should_stop=should_stop, fresh=g == 0))
                if should_stop():
                    return out
        return out
