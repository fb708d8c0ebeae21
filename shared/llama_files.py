"""Opening a version's GGUF form with llama.cpp — the one way both sides do it.

The llama.cpp client (swarm_client.backends.llama_backend) generates from these files and the coordinator's verifier
(coordinator.engine.llama_verifier) recomputes the client's result from the same files. A verdict of "same logits"
needs the same model built the same way on both sides: the same file, the same context parameters that change
arithmetic (batch size, KV-cache type), the same LoRA application. So both open files through here.

A version is either one full GGUF (``model.gguf``) or a base GGUF shared by a LoRA run's versions plus the
version's adapter (``base.gguf`` + ``adapter.gguf``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

#: llama.cpp's ``general.file_type`` numbers (LLAMA_FTYPE_*, llama.h) → the precision names snapshots use.
FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 15: "q4_K_M", 17: "q5_K_M", 18: "q6_K",
              32: "bf16"}
#: Tokens evaluated per llama_decode call when a sequence is evaluated at once (prefill; the verifier's pass).
N_BATCH = 512


def gguf_precision(path: Path) -> str:
    """The precision of a GGUF file ("f32", "f16", "q8_0", "q4_K_M", ...), from its general.file_type."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.file_type")
    return FILE_TYPES.get(int(field.parts[-1][0]), "other") if field is not None else "f32"


def version_files(folder: Path) -> tuple[Path, Path | None]:
    """(the model file, the LoRA adapter or None) of a version folder; FileNotFoundError naming what to do."""
    full, base, adapter = folder / "model.gguf", folder / "base.gguf", folder / "adapter.gguf"
    if full.exists():
        return full, None
    if base.exists() and adapter.exists():
        return base, adapter
    raise FileNotFoundError(
        f"snapshot {folder} has no GGUF form (model.gguf, or base.gguf + adapter.gguf): the coordinator "
        f"publishes safetensors only. Ask its operator to set snapshots.gguf, or join with --backend torch")


def file_id(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size)


def open_model(path: Path, *, n_ctx: int, threads: int | None, n_gpu_layers: int = 0, logits_all: bool = False,
               kv_f32: bool = False) -> Any:
    """A ``llama_cpp.Llama`` on ``path``. ``logits_all``: keep every evaluated position's logits (the verifier's
    teacher-forced pass; allocates n_ctx × n_vocab floats); otherwise only the last position's are read."""
    import llama_cpp

    kwargs: dict[str, Any] = {}
    if kv_f32:
        kwargs.update(type_k=0, type_v=0)  # GGML_TYPE_F32: removes the f16 KV cache rounding
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(N_BATCH, n_ctx), logits_all=logits_all,
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


def keep_prefix(llm: Any, tokens: list[int], at_most: int) -> int:
    """Keep the KV cache of the longest prefix ``tokens`` shares with what ``llm`` holds, up to ``at_most`` tokens,
    and drop the rest (a GRPO group evaluates its prompt ``group_size`` times); returns how many are kept."""
    held = llm.input_ids[: llm.n_tokens]
    same = 0
    for x, y in zip(held, tokens, strict=False):  # the shorter one bounds the shared prefix
        if int(x) != y:
            break
        same += 1
    llm.n_tokens = min(same, at_most)  # eval() drops the cache past n_tokens
    return int(llm.n_tokens)
