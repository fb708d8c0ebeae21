"""The publisher's side of delta snapshots (shared.deltas): which files get a patch, and their element layout.

A full-weight version's weight files (``model.safetensors`` for torch clients, ``model.gguf`` and any further
precision's ``model.<p>.gguf`` for llama.cpp clients) are also published as a patch against the previous version's file of the same name, when both have the
same size and layout, the version is not an anchor, and the patch is smaller than ``MAX_SHARE`` of the file
(otherwise it saves nothing worth a second download path). The layout gives each tensor its element width, so
that a bf16 element that moved by one unit in the last place is one small change: safetensors from its JSON header,
GGUF from its tensor table. Quantised GGUF tensors (q8_0) are compared byte by byte: the learner re-quantises every
version, and a block's int8 values (and its f16 scale) change only where a weight crosses a quantisation step,
which is coarser than bf16's, so these patches are smaller still (bench/deltas.py: 0.4–2 % on the tiny model).
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

from shared.deltas import Span, check_layout, encode, whole_file
from shared.llama_files import name_precision

logger = logging.getLogger(__name__)

PATCHED_FILES = ("model.safetensors", "model.gguf")  # the whole weights of a full-weight version


def patched(name: str) -> bool:
    """Whether a version file gets a patch: the whole weights, in every published form and precision (the
    further precisions' ``model.<p>.gguf``, shared.llama_files.gguf_name, as the default's ``model.gguf``)."""
    return name in PATCHED_FILES or name_precision(name) is not None
MAX_SHARE = 0.5  # a patch larger than this share of its file is not published
_SAFETENSORS_WIDTH = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I16": 2, "I32": 4, "I64": 8, "U16": 2, "U32": 4,
                      "U64": 8}
_GGUF_WIDTH = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I16": 2, "I32": 4, "I64": 8}


def _tile(items: list[tuple[int, int, int]], size: int) -> list[Span]:
    """Tensor spans (offset, length, width) plus width-1 spans for the bytes between and around them."""
    spans: list[Span] = []
    at = 0
    for offset, length, width in sorted(items):
        if offset < at:
            raise ValueError("overlapping tensors")
        if offset > at:
            spans.append(Span(at, offset - at, 1))
        spans.append(Span(offset, length, width if length % width == 0 else 1))
        at = offset + length
    if at < size:
        spans.append(Span(at, size - at, 1))
    check_layout(spans, size)
    return spans


def safetensors_layout(path: Path) -> list[Span]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > size - 8:
            raise ValueError(f"a {n}-byte header in a {size}-byte file")
        header = json.loads(fh.read(n))
    start = 8 + n
    items = [(start + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0],
              _SAFETENSORS_WIDTH.get(t["dtype"], 1)) for name, t in header.items() if name != "__metadata__"]
    return _tile(items, size)


def gguf_layout(path: Path) -> list[Span]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    items = [(int(t.data_offset), int(t.n_bytes), _GGUF_WIDTH.get(t.tensor_type.name, 1)) for t in reader.tensors]
    del reader
    return _tile(items, path.stat().st_size)


def layout(path: Path) -> list[Span]:
    """The element layout of a weight file; the format-free whole file (bytes) if it cannot be read as one."""
    try:
        if path.suffix == ".gguf":
            return gguf_layout(path)
        if path.suffix == ".safetensors":
            return safetensors_layout(path)
    except (ValueError, KeyError, OSError, struct.error, TypeError) as exc:
        logger.info("%s: no tensor layout (%s); compared byte by byte", path.name, exc)
    return whole_file(path.stat().st_size)


def write_delta(base: Path, result: Path, out: Path, *, base_sha256: str, result_sha256: str) -> int | None:
    """Write ``out``, the patch from ``base`` to ``result``, and return its size; None (nothing left behind) when the
    two do not share a layout or the patch would not save enough to be worth publishing."""
    if base.stat().st_size != result.stat().st_size:
        return None
    spans = layout(result)
    if spans != layout(base):
        return None
    size = encode(base, result, spans, base_sha256=base_sha256, result_sha256=result_sha256, out=out)
    if size > MAX_SHARE * result.stat().st_size:
        out.unlink()
        logger.info("%s: the patch would be %.0f %% of the file; shipped whole", result.name,
                    100 * size / result.stat().st_size)
        return None
    return size
