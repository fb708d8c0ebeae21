"""Opening a version's GGUF form with llama.cpp — the one way both sides do it.

The llama.cpp client (swarm_client.backends.llama_backend) generates from these files and the coordinator's verifier
(coordinator.engine.llama_verifier) recomputes the client's result from the same files. A verdict of "same logits"
needs the same model built the same way on both sides: the same file, the same context parameters that change
arithmetic (batch size, KV-cache type), the same LoRA application. So both open files through here.

A version is either one full GGUF (``model.gguf``) or a base GGUF shared by a LoRA run's versions plus the
version's adapter (``base.gguf`` + ``adapter.gguf``). A run that offers more precisions than its default
(snapshots.gguf_also) publishes each of them beside it as ``model.<precision>.gguf`` (:func:`gguf_name`); a client
downloads only the one its lease names, so its folder holds one model file whichever it is.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

#: llama.cpp's ``general.file_type`` numbers (LLAMA_FTYPE_*, llama.h) → the precision names snapshots use.
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 15: "q4_K_M", 17: "q5_K_M", 18: "q6_K",
              32: "bf16"}
#: Tokens evaluated per llama_decode call when a prompt is evaluated at once (prefill).
N_BATCH = 512
#: The context window both sides open a model with (the KV cache's size; the footprint estimate counts it).
N_CTX = 2048


def gguf_precision(path: Path) -> str:
    """The precision of a GGUF file ("f32", "f16", "q8_0", "q4_K_M", ...), from its general.file_type."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.file_type")
    return FILE_TYPES.get(int(field.parts[-1][0]), "other") if field is not None else "f32"


def gguf_name(precision: str, default: str) -> str:
    """The file name of a version's GGUF at ``precision`` in a run whose default precision (snapshots.gguf) is
    ``default``: the default keeps the name every client knows, ``model.gguf``; another is ``model.<p>.gguf``."""
    return "model.gguf" if precision == default else f"model.{precision}.gguf"


def name_precision(name: str) -> str | None:
    """The precision a file name states (``model.q4_K_M.gguf`` → "q4_K_M"); None for any other name (the
    default's ``model.gguf`` states none: its header does, :func:`gguf_precision`)."""
    parts = name.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "model" and parts[2] == "gguf" else None


def version_files(folder: Path, base_dir: Path | None = None, precision: str | None = None
                  ) -> tuple[Path, Path | None]:
    """(the model file, the LoRA adapter or None) of a version folder; FileNotFoundError naming what to do. A
    client's cache links a LoRA run's base into every version's folder; the coordinator keeps it once, in
    ``base_dir``. ``precision``: the file of that precision where the run offers several (``model.<p>.gguf``),
    else the default ``model.gguf`` (which is that precision when it is the run's default)."""
    full, base, adapter = folder / "model.gguf", folder / "base.gguf", folder / "adapter.gguf"
    if precision is not None and (folder / f"model.{precision}.gguf").exists():
        return folder / f"model.{precision}.gguf", None
    if full.exists():
        return full, None
    others = sorted(p for p in folder.glob("model.*.gguf") if name_precision(p.name) is not None)
    if precision is None and len(others) == 1:  # a client's folder: the one precision its lease named
        return others[0], None
    if not base.exists() and base_dir is not None:
        base = base_dir / "base.gguf"
    if base.exists() and adapter.exists():
        return base, adapter
    raise FileNotFoundError(
        f"snapshot {folder} has no GGUF form (model.gguf, or base.gguf + adapter.gguf): the coordinator "
        f"publishes safetensors only. Ask its operator to set snapshots.gguf, or join with --backend torch")


def file_id(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size)


def open_model(path: Path, *, n_ctx: int = N_CTX, threads: int | None, n_gpu_layers: int = 0,
               kv_f32: bool = False) -> Any:
    """A ``llama_cpp.Llama`` on ``path``. Only the last evaluated position's logits are kept (:func:`last_logits`):
    no n_ctx × n_vocab score matrix (1.2 GB for a 150 k vocabulary)."""
    import llama_cpp

    kwargs: dict[str, Any] = {}
    if kv_f32:
        kwargs.update(type_k=0, type_v=0)  # GGML_TYPE_F32: removes the f16 KV cache rounding
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(N_BATCH, n_ctx), logits_all=False,
                           n_gpu_layers=n_gpu_layers, n_threads=threads, n_threads_batch=threads, seed=0,
                           verbose=False, **kwargs)


def set_adapter(llm: Any, path: Path | None, current: Any) -> Any:
    """Apply the LoRA adapter at ``path`` to ``llm`` (None: the bare base) in place of ``current`` (the handle
    returned by the previous call, or None), without reloading the base; returns the new handle. The context is
    reset afterwards: a KV cache built under the old adapter must not be reused."""
    import llama_cpp as lib

    if path is not None:
        new = lib.llama_adapter_lora_init(llm.model, str(path).encode())
        if not new:
            raise ValueError(f"llama.cpp could not load the LoRA adapter {path}")
        arr = (lib.llama_adapter_lora_p_ctypes * 1)(new)
        scales = (ctypes.c_float * 1)(1.0)
        rc = lib.llama_set_adapters_lora(llm.ctx, arr, 1, scales)
    else:
        new = None
        rc = lib.llama_set_adapters_lora(llm.ctx, None, 0, None)
    if rc != 0:
        raise ValueError(f"llama.cpp refused the LoRA adapter {path} (code {rc})")
    if current is not None:
        lib.llama_adapter_lora_free(current)
    llm.reset()
    return new


def prefill(llm: Any, prompt: list[int], *, fresh: bool) -> None:
    """Evaluate ``prompt`` so that the context holds the logits of its last position. ``fresh``: from scratch, in
    one batch. Otherwise, when the context holds ``prompt[:-1]`` (a GRPO group's next rollout: the previous one
    left its prompt and completion there), that cache is kept and only the last prompt token is evaluated.

    Why one fixed schedule: llama.cpp computes a batch with other kernels than a single token (a matrix product
    instead of a matrix-vector one), and the two round differently — enough to move a keyed choice at a near-tie
    (measured up to 0.05 logit on a sharp model). The client (swarm_client.backends.llama_backend) follows this
    schedule and decodes one token at a time; the verifier (coordinator.engine.llama_verifier) replays exactly the
    same evaluations, so on the same kind of machine it computes the client's logits bit for bit."""
    n = len(prompt) - 1
    keep = 0
    if not fresh and llm.n_tokens >= n and [int(t) for t in llm.input_ids[:n]] == list(prompt[:n]):
        keep = n
    llm.n_tokens = keep  # eval() drops the cache past n_tokens
    llm.eval(list(prompt[keep:]))


def last_logits(llm: Any, out: Any) -> None:
    """Copy the logits of the last evaluated position into ``out`` (a float32 array of n_vocab)."""
    import llama_cpp

    ctypes.memmove(out.ctypes.data, llama_cpp.llama_get_logits_ith(llm.ctx, -1), out.nbytes)
