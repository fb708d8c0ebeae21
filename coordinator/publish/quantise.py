"""Quantised GGUF snapshots from llama.cpp's own quantiser (``llama_model_quantize``, exposed by llama-cpp-python).

Why llama.cpp's quantiser and not ours: the volunteers a quantised snapshot is for run llama.cpp, and the
verifier recomputes their results with llama.cpp on the very same file (coordinator.engine.llama_verifier). With
the file made by the library that runs it, the k-quant formats (q6_K, q5_K_M, q4_K_M: the "mixtures" choose a
type per tensor) and their fallbacks are exactly what every llama.cpp user gets from ``llama-quantize``, and a
new format needs no code here. The input is the f16 file of the same version (coordinator.publish.gguf_export).

A tensor whose rows are not a multiple of the format's block (256 for k-quants) is quantised by llama.cpp's own
fallback rule (e.g. q5_0 / q8_0 for the tiny model's 128-wide rows); the file still says its mixture's type.
The quantiser is deterministic (same f16 bytes → same output bytes), so unchanged versions keep their hash and a
delta patch of a quantised file changes only the blocks whose weights moved (coordinator.publish.deltas).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

#: The quantised precisions a run can publish, each with llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` number (llama.h).
QUANTISED: dict[str, int] = {"q8_0": 7, "q6_K": 18, "q5_K_M": 17, "q4_K_M": 15, "q4_0": 2}


class QuantiseError(RuntimeError):
    """llama.cpp's quantiser failed or is not installed; the message says which and what to do."""


def quantise(src: Path, out: Path, precision: str, *, threads: int | None = None) -> None:
    """Write ``out``, the GGUF ``src`` (f16 or f32) quantised to ``precision`` (a key of :data:`QUANTISED`) by
    llama.cpp. Written beside ``out`` first and renamed, so a half-written file never has its name."""
    ftype = QUANTISED.get(precision)
    if ftype is None:
        raise QuantiseError(f"unknown quantised precision {precision!r}; use one of {', '.join(QUANTISED)}")
    try:
        import llama_cpp
    except ImportError as exc:
        raise QuantiseError("quantised GGUF snapshots are made by llama.cpp's quantiser: install llama-cpp-python "
                            "on the coordinator (pip install 'echo-swarm[coordinator,llama]'), or set "
                            "snapshots.gguf = 'f16'") from exc
    # llama.cpp prints a line per tensor (and a fallback warning per narrow one) through llama-cpp-python's logger,
    # which prints everything until a model is opened with verbose=False: once per published version, too much
    llama_log = logging.getLogger("llama-cpp-python")
    if llama_log.level < logging.ERROR:
        llama_log.setLevel(logging.ERROR)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(threads or 0) or max(1, min(8, os.cpu_count() or 1))
    tmp = out.with_name(out.name + ".part")
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.exists():
            raise QuantiseError(f"llama.cpp could not quantise {src.name} to {precision} (code {rc})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    logger.debug("quantised %s to %s (%d bytes)", src.name, precision, out.stat().st_size)
