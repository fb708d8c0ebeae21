"""How much memory a backend needs for a model and a job: the estimate behind the memory pre-check.

Each backend's real peak, measured by bench/client_memory.py (figures in docs/benchmarks.md), is the sum of:

- **torch** (``TorchBackend``): the runtime (Python, torch, transformers, the tokenizer) + the weights as the
  model holds them (float32: a 16-bit file takes twice its size in memory) + loading: a new version is read into
  the model in place, tensor by tensor, so a swap adds at most the largest tensor (a tensor whose stored dtype
  differs goes through one temporary, ``shared.adapters.SafetensorsFile.read_into``), but the first load
  (transformers ``from_pretrained``) of a 16-bit file keeps the whole file mapped while it converts, which adds
  the file's size + what one generation of the job's batch allocates: the KV cache of every sequence at its full
  length, and the prefill pass's transients — the logits of every prompt position (``shared.policy.generate``
  asks for the last position's only where the model's forward takes ``logits_to_keep``, as Qwen2 and Llama do; the
  estimate keeps every position's, the peak of a model without it and an upper bound for the others), the MLP's
  intermediate activations and the attention scores — with ``TRANSIENT_SLACK`` for the allocator.
- **llama.cpp** (``LlamaBackend``): the runtime + the GGUF file (memory-mapped and read whole) + the KV cache
  of its context window (``n_ctx`` tokens, f16) + llama.cpp's compute buffers (proportional to the batch of
  ``n_batch`` tokens it evaluates at once) + the logits buffers of ``LlamaBackend._logit_rows``.

The facts come from the model itself where the client has it (``config.json``, the safetensors headers, the GGUF
header); before a first download only the manifest's file sizes are known, and the fallbacks below are used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.adapters import SafetensorsFile, base_weight_files

GIB = 2**30
MIB = 2**20

# ---- the constants of the estimate (each measured or derived once; see the module docstring) -----------------
# the runtimes, without weights (bench/client_memory.py, tiny model: torch 0.35 GiB with the model's code and
# tokenizer loaded, llama-cpp-python 0.05 GiB), rounded up
TORCH_RUNTIME_BYTES = 400 * MIB
LLAMA_RUNTIME_BYTES = 128 * MIB
TORCH_DTYPE_BYTES = 4  # the torch backend holds and computes in float32 (shared.policy.load_model's default)
BF16_BYTES = 2  # ... or in bfloat16 (`join --torch-dtype bfloat16`): every figure below takes the width as ``width``
LLAMA_KV_DTYPE_BYTES = 2  # llama.cpp's default KV cache type: f16
LLAMA_N_CTX = 2048  # LlamaBackend's context window (n_ctx) and the tokens its KV cache holds
LLAMA_N_BATCH = 512  # tokens llama.cpp evaluates at once (LlamaBackend: n_batch = min(512, n_ctx))
LLAMA_LOGIT_BUFFER_BYTES = 2 * 4 * MIB  # LlamaBackend.LOGIT_BUFFER_BYTES: its logit rows and their scratch
MLP_TRANSIENTS = 3  # gate, up and activation outputs of one MLP, alive together in the prefill pass
HIDDEN_TRANSIENTS = 6  # residual, normed input, q/k/v and attention output, hidden-sized, in the prefill pass
# the torch allocator's rounding and short-lived copies on top of the computed KV and prefill transients
# (measured: 1.02–1.10 × at Qwen2.5-0.5B shape, 64 sequences of 64 + 32 tokens)
TRANSIENT_SLACK = 1.15
# Before a first download nothing but file sizes is known: assume the worst common case for each unknown.
FALLBACK_LARGEST_SHARE = 0.3  # the largest tensor (a tied embedding) as a share of the weights (Qwen2.5-0.5B: 0.27)
FALLBACK_VOCAB = 262_144  # the largest common vocabulary (Gemma's 256 k)
FALLBACK_KV_SHARE_PER_TOKEN = 4e-5  # K+V of one token as a share of the weights (Llama-2-7B, no GQA: 3.7e-5)
FALLBACK_ACTIVATION_SHARE_PER_TOKEN = 4e-5  # one prompt token's MLP and hidden-state transients as a share of
# the weights (Qwen2.5-0.5B: 80 KB of 1.98 GB; larger models have a smaller share)


@dataclass(frozen=True)
class ModelShape:
    """What the KV and activation terms need from a model's configuration."""

    layers: int
    hidden: int
    heads: int
    kv_width: int  # num_key_value_heads × head_dim: one token's K (or V) in one layer
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ModelShape | None:
        """From a Hugging Face ``config.json`` (None when a field is missing or not a positive integer)."""
        try:
            layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            inter, vocab = int(cfg.get("intermediate_size") or 4 * hidden), int(cfg["vocab_size"])
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None
        if min(layers, hidden, heads, kv_heads, head_dim, inter, vocab) <= 0:
            return None
        return cls(layers, hidden, heads, kv_heads * head_dim, inter, vocab)


@dataclass(frozen=True)
class Batch:
    """The sequences a job generates at once and their lengths (the torch backend runs a job as one batch)."""

    sequences: int
    prompt_tokens: int  # the longest prompt (prompts are left-padded to it)
    new_tokens: int

    @classmethod
    def of_job(cls, job: Any) -> Batch:
        return cls(len(job.prompts) * job.group_size, max(len(p.token_ids) for p in job.prompts),
                   job.sampling.max_tokens)


# before the first job: the self-benchmark's workload (swarm_client/benchmark.py: 4 samples of an 8-token prompt,
# 32 new tokens). Every job is checked with its own batch before the model is loaded for it.
DEFAULT_BATCH = Batch(sequences=4, prompt_tokens=8, new_tokens=32)


@dataclass(frozen=True)
class Need:
    """An estimate of peak resident memory, in bytes, with what it is made of (for the refusal message)."""

    parts: dict[str, int] = field(default_factory=dict)
    model_bytes: int = 0  # the files the estimate is for (what the refusal message calls the version's size)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {n / GIB:.2f}" for name, n in self.parts.items() if n)


@dataclass(frozen=True)
class Weights:
    """The weights as the torch backend will hold them."""

    memory_bytes: int  # all tensors at the backend's bytes per element (``width``)
    largest_bytes: int  # the largest single tensor, same unit
    file_bytes: int  # the safetensors files' total size

    @classmethod
    def from_file_bytes(cls, file_bytes: int, like: Weights | None, width: int = TORCH_DTYPE_BYTES) -> Weights:
        """Weights known only by their files' size (before a download): scaled like ``like`` (another version
        of the run, whose headers were read), else assumed float32 files (the coordinator's default, a float32
        learner) held at ``width`` bytes per element, with the fallback share for the largest."""
        if like is None or like.file_bytes <= 0:
            memory = file_bytes * width // TORCH_DTYPE_BYTES
            return cls(memory, int(memory * FALLBACK_LARGEST_SHARE), file_bytes)
        memory = file_bytes * like.memory_bytes // like.file_bytes
        return cls(memory, memory * like.largest_bytes // max(1, like.memory_bytes), file_bytes)

    @property
    def loading_bytes(self) -> int:
        """What loading adds to the weights: the whole file while a converting first load maps it (files in
        another dtype than the model's), else one tensor (the in-place swap's temporary, at most)."""
        converted = self.file_bytes < self.memory_bytes * 0.9  # header bytes aside, a float32 file is the model's size
        return max(self.largest_bytes, self.file_bytes if converted else 0)


# ---- the formulas ---------------------------------------------------------------------------------------------
def torch_generation_bytes(shape: ModelShape, batch: Batch, width: int = TORCH_DTYPE_BYTES) -> tuple[int, int]:
    """(KV cache, prefill transients) of one generation of ``batch`` by the torch backend, in bytes."""
    n, p = batch.sequences, batch.prompt_tokens
    kv = 2 * shape.layers * shape.kv_width * n * (p + batch.new_tokens) * width
    per_token = shape.vocab + MLP_TRANSIENTS * shape.intermediate + HIDDEN_TRANSIENTS * shape.hidden
    scores = shape.heads * p  # one layer's attention scores for one query token
    prefill = n * p * (per_token + scores) * width
    return kv, prefill


def torch_need_from(weights: Weights, shape: ModelShape | None, batch: Batch, width: int = TORCH_DTYPE_BYTES
                    ) -> Need:
    """The torch backend's peak for ``weights`` and one generation of ``batch`` at ``width`` bytes per element
    (shape None: fallbacks)."""
    if shape is not None:
        kv, prefill = torch_generation_bytes(shape, batch, width)
    else:
        n, p = batch.sequences, batch.prompt_tokens
        kv = int(weights.memory_bytes * FALLBACK_KV_SHARE_PER_TOKEN * n * (p + batch.new_tokens))
        prefill = int(n * p * (FALLBACK_VOCAB * width
                               + weights.memory_bytes * FALLBACK_ACTIVATION_SHARE_PER_TOKEN))
    return Need({"runtime": TORCH_RUNTIME_BYTES, "weights": weights.memory_bytes, "loading": weights.loading_bytes,
                 "KV cache": int(kv * TRANSIENT_SLACK), "prefill": int(prefill * TRANSIENT_SLACK)},
                model_bytes=weights.file_bytes)


def llama_need_from(gguf_bytes: int, shape: ModelShape | None) -> Need:
    """The llama.cpp backend's peak for a GGUF of ``gguf_bytes`` (base + adapter) and its context window."""
    if shape is not None:
        kv = 2 * shape.layers * shape.kv_width * LLAMA_N_CTX * LLAMA_KV_DTYPE_BYTES
        compute = LLAMA_N_BATCH * (shape.vocab + MLP_TRANSIENTS * shape.intermediate) * 4
    else:
        kv = int(gguf_bytes * FALLBACK_KV_SHARE_PER_TOKEN * LLAMA_N_CTX)
        compute = LLAMA_N_BATCH * FALLBACK_VOCAB * 4
    return Need({"runtime": LLAMA_RUNTIME_BYTES, "weights": gguf_bytes, "KV cache": kv,
                 "compute": compute + LLAMA_LOGIT_BUFFER_BYTES}, model_bytes=gguf_bytes)


# ---- reading the facts from a model ----------------------------------------------------------------------------
def read_shape(folder: Path) -> ModelShape | None:
    """From ``folder/config.json``, or the GGUF header of ``folder/model.gguf`` / ``base.gguf`` (None: neither)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    if isinstance(cfg, dict):
        return ModelShape.from_config(cfg)
    for path in [folder / "model.gguf", folder / "base.gguf", *sorted(folder.glob("model.*.gguf"))]:
        if path.is_file():
            return gguf_shape(path)
    return None


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}  # GGUF value types → struct formats (8 = string, 9 = array)
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_header(path: Path) -> dict[str, Any]:
    """The key-value section of a GGUF file: scalars as numbers, strings as text, arrays as their length.
    Read with plain buffered reads, stopping before the tensor data (the ``gguf`` package's reader parses every
    string of the vocabulary into objects: seconds for a 150 k vocabulary, on every job)."""
    import struct

    out: dict[str, Any] = {}
    with open(path, "rb", buffering=1 << 16) as fh:

        def unpack(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            raw = fh.read(size)
            if len(raw) != size:
                raise ValueError(f"{path} ends inside its GGUF header")
            return struct.unpack(fmt, raw)[0]

        def string(limit: int = 1 << 20) -> bytes:
            n = unpack("<Q")
            if n > limit:
                raise ValueError(f"{path}: a GGUF string of {n} bytes")
            return fh.read(n)

        def skip(kind: int) -> Any:
            if kind == _GGUF_STRING:
                return string(1 << 30).decode(errors="replace")
            if kind == _GGUF_ARRAY:
                elem, count = unpack("<I"), unpack("<Q")
                if elem in _GGUF_SCALARS:
                    fh.seek(struct.calcsize(_GGUF_SCALARS[elem]) * count, 1)
                elif elem == _GGUF_STRING:
                    for _ in range(count):
                        fh.seek(unpack("<Q"), 1)
                else:
                    raise ValueError(f"{path}: GGUF arrays of type {elem} are not expected in a header")
                return count
            if kind not in _GGUF_SCALARS:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            return unpack(_GGUF_SCALARS[kind])

        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _tensors, kv_count = unpack("<I"), unpack("<Q"), unpack("<Q")
        if version not in (2, 3) or kv_count > 1_000_000:
            raise ValueError(f"{path}: unsupported GGUF version {version} or header")
        for _ in range(kv_count):
            key = string().decode(errors="replace")
            out[key] = skip(unpack("<I"))
    return out


def gguf_shape(path: Path) -> ModelShape | None:
    """The hyper-parameters in a GGUF header (None if one is missing or the file is not GGUF)."""
    try:
        fields = gguf_header(path)
    except (OSError, ValueError):
        return None
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        return None
    cfg = {"num_hidden_layers": fields.get(f"{arch}.block_count"),
           "hidden_size": fields.get(f"{arch}.embedding_length"),
           "num_attention_heads": fields.get(f"{arch}.attention.head_count"),
           "num_key_value_heads": fields.get(f"{arch}.attention.head_count_kv"),
           "head_dim": fields.get(f"{arch}.attention.key_length"),
           "intermediate_size": fields.get(f"{arch}.feed_forward_length"),
           "vocab_size": fields.get("tokenizer.ggml.tokens")}
    return ModelShape.from_config(cfg)


def torch_weights(folder: Path, width: int = TORCH_DTYPE_BYTES) -> Weights:
    """From the safetensors headers of ``folder`` (base weights; a LoRA adapter's own file is tiny and only ever
    one tensor at a time): the bytes the torch backend holds, at ``width`` bytes per element."""
    total = largest = size = 0
    for path in base_weight_files(folder):
        size += path.stat().st_size
        with SafetensorsFile(path) as fh:
            for entry in fh.entries.values():
                n = 1
                for d in entry.get("shape", ()):
                    n *= int(d)
                b = n * width
                total += b
                largest = max(largest, b)
    return Weights(total, largest, size)


def torch_need(folder: Path, batch: Batch, width: int = TORCH_DTYPE_BYTES) -> Need:
    """The torch backend's peak for the model in ``folder`` and one generation of ``batch`` at ``width``."""
    return torch_need_from(torch_weights(folder, width), read_shape(folder), batch, width)


def llama_need(folder: Path) -> Need:
    """The llama.cpp backend's peak for the GGUF form in ``folder``."""
    folder = Path(folder)
    files = [p for p in [*(folder / n for n in ("model.gguf", "base.gguf", "adapter.gguf")),
                         *folder.glob("model.*.gguf")] if p.is_file()]
    return llama_need_from(sum(p.stat().st_size for p in files), read_shape(folder))
