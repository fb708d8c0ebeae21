"""Delta snapshots (docs/protocol.md §6, "Deltas"): a full-weight version shipped as a patch against the previous one.

One small optimizer step changes few elements of a bf16 (or f16) snapshot: the learner keeps f32 weights, and a
published element changes only when its f32 weight crosses a rounding boundary, usually by one unit in the last
place. So a patch lists, per span of the file, the flat indices of the elements that changed (delta-encoded, as
gaps) and each one's change (the new element's bit pattern minus the old one's, as the unsigned integer of the
element's width, wrapping: mostly ±1, zigzag-coded), byte-shuffled (all first bytes, then all second bytes, …) and compressed
with zstd. The spans are the file's tensors, each with its element width; the bytes between them (headers) are
spans of width 1. The codec itself knows no file format: the publisher chooses the spans
(coordinator.publish.deltas), and a client rebuilds the file by adding the changes to the base it holds, span by
span. A span longer than ``SPAN_BYTES`` (a large tensor) is coded as several consecutive spans, so that neither side
ever holds more than one piece of a file in memory.

A patch names the sha256 of its base and of the file it rebuilds, and the manifest lists both (ManifestFile.
base_sha256 / result_sha256): the client checks the rebuilt file's sha256 before it uses it, so a patch can at worst
waste its bytes, never change what a client runs.

File layout: ``MAGIC``, a little-endian uint32 header length, the msgpack header ``{base, base_size, result, size,
spans: [[offset, length, width, changed, compressed_bytes], ...]}``, then for each span with changed > 0 one zstd
frame of ``shuffle(gaps as uint32) + shuffle(changes as uint<width>)``.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from shared import wire
from shared.errors import IntegrityError

MAGIC = b"ESDELTA1"
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_SPANS = 65_536
WIDTHS: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
ZSTD_LEVEL = 3
SPAN_BYTES = 8 * 2**20  # spans are coded in pieces of at most this many bytes (split_spans)
_GAP = np.dtype("<u4")


class PatchError(IntegrityError):
    """A patch that cannot be applied to the file at hand (malformed, another base, or rebuilding another file):
    the client refuses it and fetches the full file instead."""


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` compared as elements of ``width`` bytes (``length`` a multiple of it)."""

    offset: int
    length: int
    width: int


def whole_file(size: int, width: int = 1) -> list[Span]:
    """The format-free layout: the whole file as one span (``width`` if the size allows, else bytes)."""
    return [Span(0, size, width if size % width == 0 else 1)] if size else []


def check_layout(spans: Sequence[Span], size: int) -> None:
    """Spans must tile ``[0, size)`` in order, each a whole number of its elements."""
    at = 0
    for s in spans:
        if s.width not in WIDTHS or s.offset != at or s.length < 0 or s.length % s.width:
            raise ValueError(f"span {s} does not continue the layout at byte {at} in whole elements")
        at += s.length
    if at != size:
        raise ValueError(f"the spans cover {at} bytes of a {size}-byte file")


def _zigzag(changes: np.ndarray) -> np.ndarray:
    """Wrapped unsigned differences → small unsigned codes: 0, -1, +1, -2, … → 0, 1, 2, 3, … (so a change of one
    unit in the last place, up or down, leaves every byte but the first zero)."""
    bits = changes.dtype.itemsize * 8
    signed = changes.view(changes.dtype.str.replace("u", "i"))
    return ((signed << 1) ^ (signed >> (bits - 1))).view(changes.dtype)


def _unzigzag(codes: np.ndarray) -> np.ndarray:
    return (codes >> 1) ^ (np.zeros_like(codes) - (codes & 1))


def _shuffle(a: np.ndarray) -> bytes:
    return a.view(np.uint8).reshape(-1, a.dtype.itemsize).T.tobytes()


def _unshuffle(data: bytes, dtype: np.dtype[Any], count: int) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8).reshape(dtype.itemsize, count)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(count)


def split_spans(spans: Sequence[Span], max_bytes: int | None = None) -> list[Span]:
    """The same layout with every span longer than ``max_bytes`` (default ``SPAN_BYTES``) cut into pieces of at most
    that many bytes (whole elements): each is coded as its own frame, so encoding and applying hold one piece at a
    time, not a tensor."""
    max_bytes = SPAN_BYTES if max_bytes is None else max_bytes
    out: list[Span] = []
    for s in spans:
        step = max(s.width, max_bytes - max_bytes % s.width)
        out.extend(Span(s.offset + at, min(step, s.length - at), s.width) for at in range(0, s.length, step))
    return out


def _read(fh: BufferedReader, offset: int, length: int) -> np.ndarray:
    """``length`` bytes at ``offset`` of an open file, read into fresh memory (no mapping of the file: its pages
    would stay in the process's resident set until unmapped)."""
    buf = np.empty(length, np.uint8)
    fh.seek(offset)
    if fh.readinto(buf.data) != length:
        raise ValueError(f"{getattr(fh, 'name', 'a file')} ends before byte {offset + length}")
    return buf


def encode(base: Path, result: Path, spans: Sequence[Span], *, base_sha256: str, result_sha256: str,
           out: Path) -> int:
    """Write the patch that turns ``base`` into ``result`` (same size, the same ``spans`` layout) to ``out``;
    return its size. ValueError when the files cannot be patched (sizes differ, spans do not tile the file).
    Spans longer than ``SPAN_BYTES`` are coded in pieces (:func:`split_spans`); both files are read piece by piece."""
    size = os.path.getsize(result)
    if os.path.getsize(base) != size:
        raise ValueError(f"{result.name}: {size} bytes, its base {os.path.getsize(base)}: a patch needs equal sizes")
    check_layout(spans, size)
    spans = split_spans(spans)
    if len(spans) > MAX_SPANS:
        raise ValueError(f"{len(spans)} spans; at most {MAX_SPANS}")
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    table: list[list[int]] = []
    frames: list[bytes] = []
    with open(base, "rb") as old, open(result, "rb") as new:
        for s in spans:
            dtype = WIDTHS[s.width]
            a = _read(old, s.offset, s.length).view(dtype)
            b = _read(new, s.offset, s.length).view(dtype)
            idx = np.flatnonzero(a != b)
            if idx.size == 0:
                table.append([s.offset, s.length, s.width, 0, 0])
                continue
            gaps = np.diff(idx, prepend=-1) - 1  # ≥ 0: elements skipped since the previous change
            changes = b[idx] - a[idx]  # unsigned: wraps, and adding it back wraps the same way
            frame = compressor.compress(_shuffle(gaps.astype(_GAP)) + _shuffle(_zigzag(np.asarray(changes, dtype))))
            table.append([s.offset, s.length, s.width, int(idx.size), len(frame)])
            frames.append(frame)
    header = wire.pack({"base": base_sha256, "base_size": size, "result": result_sha256, "size": size,
                        "spans": table})
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(MAGIC + struct.pack("<I", len(header)) + header)
        for frame in frames:
            fh.write(frame)
    os.replace(tmp, out)
    return os.path.getsize(out)


@dataclass(frozen=True)
class PatchHeader:
    base: str
    base_size: int
    result: str
    size: int
    spans: list[tuple[int, int, int, int, int]]  # offset, length, width, changed, compressed bytes
    body_offset: int


def read_header(patch: Path) -> PatchHeader:
    """Parse and bound-check a patch's header (PatchError otherwise). Reads only the header."""
    with open(patch, "rb") as fh:
        head = fh.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            raise PatchError(f"{patch.name} is not an echo-swarm patch (no {MAGIC!r} header)")
        (n,) = struct.unpack("<I", head[len(MAGIC):])
        if n > MAX_HEADER_BYTES:
            raise PatchError(f"{patch.name}: a {n}-byte header; at most {MAX_HEADER_BYTES}")
        raw = fh.read(n)
    try:
        h = wire.unpack(raw, max_bytes=MAX_HEADER_BYTES)
        base, result, size, base_size = h["base"], h["result"], int(h["size"]), int(h["base_size"])
        spans = [tuple(int(x) for x in s) for s in h["spans"]]
        if not (isinstance(base, str) and isinstance(result, str)) or any(len(s) != 5 for s in spans):
            raise ValueError("bad field types")
        check_layout([Span(o, ln, w) for o, ln, w, _, _ in spans], size)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise PatchError(f"{patch.name}: malformed patch header ({exc})") from exc
    except IntegrityError:
        raise
    except Exception as exc:  # wire.unpack's ProtocolError: not msgpack
        raise PatchError(f"{patch.name}: malformed patch header ({exc})") from exc
    for _, length, width, changed, clen in spans:
        if not 0 <= changed <= length // width or clen < 0 or (changed == 0) != (clen == 0):
            raise PatchError(f"{patch.name}: a span claims {changed} changes in {length // width} elements")
    body = len(MAGIC) + 4 + n
    if body + sum(s[4] for s in spans) != os.path.getsize(patch):
        raise PatchError(f"{patch.name}: the header's frame sizes do not add up to the file's size")
    return PatchHeader(base, base_size, result, size, spans, body)  # type: ignore[arg-type]


def apply_patch(base: Path, patch: Path, out: Path, *, base_sha256: str, result_sha256: str) -> str:
    """Write ``base`` + ``patch`` to ``out`` and return the sha256 (hex) of what was written. The patch must name
    exactly this base and result; every frame is bounded to the bytes its header announces. PatchError on anything
    amiss, with ``out`` removed. The caller accepts ``out`` only if the returned sha256 is ``result_sha256``.

    One pass: each span of the base is read, changed, hashed and written in turn (no copy of the base to rewrite
    afterwards, no mapping of either file, no second read to hash the result)."""
    h = read_header(patch)
    if h.base != base_sha256 or h.result != result_sha256:
        raise PatchError(f"{patch.name} patches {h.base[:12]} into {h.result[:12]}, not {base_sha256[:12]} into "
                         f"{result_sha256[:12]} as the manifest says")
    if os.path.getsize(base) != h.base_size:
        raise PatchError(f"{patch.name}: its base has {h.base_size} bytes, the file at hand {os.path.getsize(base)}")
    digest = hashlib.sha256()
    try:
        decompressor = zstandard.ZstdDecompressor()
        with open(base, "rb") as src, open(patch, "rb") as fh, open(out, "wb") as dst:
            fh.seek(h.body_offset)
            for offset, length, width, changed, clen in h.spans:
                data = _read(src, offset, length)
                if changed:
                    dtype = WIDTHS[width]
                    expect = changed * (_GAP.itemsize + width)
                    try:
                        raw = decompressor.decompress(fh.read(clen), max_output_size=expect)
                    except zstandard.ZstdError as exc:
                        raise PatchError(f"{patch.name}: a frame does not decompress ({exc})") from exc
                    if len(raw) != expect:
                        raise PatchError(f"{patch.name}: a frame holds {len(raw)} bytes, its header says {expect}")
                    gaps = _unshuffle(raw[:changed * _GAP.itemsize], _GAP, changed)
                    changes = _unzigzag(_unshuffle(raw[changed * _GAP.itemsize:], dtype, changed))
                    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
                    if idx[-1] >= length // width:
                        raise PatchError(f"{patch.name}: a change lies past the end of its span")
                    view = data.view(dtype)
                    view[idx] += changes
                digest.update(data.data)
                dst.write(data.data)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return digest.hexdigest()
