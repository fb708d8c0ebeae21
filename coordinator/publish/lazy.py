"""Lazy publication (``snapshots.lag_tolerance``): a 16-bit snapshot element changes only when the learner's weight
has moved far enough from what clients already hold.

Why. The learner keeps float32 weights and publishes them rounded to bfloat16 (or float16). Adam moves every weight
by about the learning rate at every step, and the rounding of a weight changes whenever it crosses a rounding
boundary — for small weights, whose unit in the last place (ulp) is tiny, at almost every step. At lr 1e-5 a
quarter of a 0.5 B model's bf16 elements change per step, and no lossless coding of that snapshot is under
5 % of the file (docs/benchmarks.md, "Delta snapshots"). Those changes are far below what matters for the policy:
a weight's error in a matrix product counts in absolute terms, and rounding already puts the tensor's typical
element about half an ulp — ``eps/2 · RMS`` — off its master value.

The rule. For each 16-bit floating tensor, with ``R`` its rounding of the learner's weights at this version, ``P``
the same tensor as the previous version published it, and ``δ = lag_tolerance · eps · RMS(R)`` (``eps`` the
dtype's machine epsilon, 2⁻⁷ for bfloat16):

    published = R  where |R − P| > δ,   P elsewhere.

Nothing is lost: the learner's float32 master weights keep every update, and an element is republished once
the master has drifted more than δ from what was published (up to ``δ + ulp/2`` off the master: a bounded lag,
of the order of the rounding error itself at the default 0.5). Anchor versions, the first version, and any
version whose previous file is not at hand publish ``R`` whole (a resync). At tolerance 0 the published
snapshot is exactly ``R``, as without this module. float32 tensors are never held back (nothing is rounded).

A held element lags *along its update*, so its error is coherent with the gradient, unlike rounding noise, and
the policy gap grows with how many steps of movement δ holds back (δ / lr). So δ is also capped at
``snapshots.lag_steps × learner.lr``: at lr 1e-5 the RMS term is the smaller one for weights of RMS ≈ 0.02 (as
measured), at lr 1e-6 the cap keeps the lag to ``lag_steps`` steps (docs/benchmarks.md, "Lazy publication").

Correctness does not depend on the lag: clients sample and the verifier recomputes from the published snapshot
(the behaviour policy), and the learner's importance ratio πθ/π_b corrects for the gap between it and the
learner's own float32 policy. docs/benchmarks.md measures the gap, the learning and the bytes.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 2**22  # elements compared at a time: the temporaries are a few chunks, never a tensor
_DTYPES = {"BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class Settled:
    """What :func:`settle` did: elements of 16-bit tensors compared, republished (differ from the previous
    version's) and held back (their rounding moved, by no more than δ)."""

    elements: int
    republished: int
    held: int


@dataclass(frozen=True)
class _Stored:
    """A tensor as a safetensors file stores it: dtype name (``BF16``), shape, and its first data byte."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


def _tensors(path: Path) -> dict[str, _Stored]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {name: _Stored(str(t["dtype"]), tuple(int(d) for d in t["shape"]), 8 + n + int(t["data_offsets"][0]))
            for name, t in header.items() if name != "__metadata__"}


def settle(weights: MutableMapping[str, Tensor], previous: Path, tolerance: float,
           cap: float | None = None) -> Settled:
    """Apply the rule (module docstring) in place to ``weights`` (the hand-over copy about to be written: name →
    CPU tensor in the publish dtype), against ``previous``, the previous version's ``model.safetensors``. Tensors
    the previous file does not hold with the same dtype and shape are left as they are (published whole). ``cap``:
    the largest δ in absolute terms (``lag_steps × lr``), whatever the tensor's RMS.

    Works on the elements' bit patterns with numpy, a chunk at a time, and computes the gap only where the rounding
    moved (a minority): about 15 ms per million elements, where torch's masked ops took 120."""
    import numpy as np
    import torch

    stored = _tensors(previous)
    elements = republished = held = 0
    with open(previous, "rb") as fh:
        for name, tensor in weights.items():
            entry = stored.get(name)
            dtype = str(tensor.dtype).removeprefix("torch.")
            if (dtype not in _DTYPES.values() or entry is None or _DTYPES.get(entry.dtype) != dtype
                    or entry.shape != tuple(tensor.shape) or not tensor.is_contiguous()):
                continue
            bits = tensor.view(-1).view(torch.int16).numpy().view(np.uint16)  # the tensor's own memory
            delta = tolerance * float(torch.finfo(tensor.dtype).eps) * _rms(bits, dtype)
            if cap is not None:
                delta = min(delta, cap)
            old = np.empty(min(CHUNK_ELEMENTS, bits.size), np.uint16)
            for at in range(0, bits.size, CHUNK_ELEMENTS):
                new = bits[at:at + CHUNK_ELEMENTS]
                prev = old[:new.size]
                fh.seek(entry.offset + 2 * at)
                if fh.readinto(prev.data) != prev.nbytes:
                    raise ValueError(f"{previous} ends inside tensor {name!r}")
                moved = np.flatnonzero(new != prev)  # bit patterns: +0 and -0 differ too
                near = moved[np.abs(_values(new[moved], dtype) - _values(prev[moved], dtype)) <= delta]
                new[near] = prev[near]
                elements += new.size
                held += near.size
                republished += moved.size - near.size
    return Settled(elements, republished, held)


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit floats given by their bit patterns, as float32 (exact)."""
    import numpy as np

    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def _rms(bits: np.ndarray, dtype: str) -> float:
    import numpy as np

    total = 0.0
    for at in range(0, bits.size, CHUNK_ELEMENTS):
        x = _values(bits[at:at + CHUNK_ELEMENTS], dtype)
        total += float(np.dot(x, x))
    return (total / max(1, bits.size)) ** 0.5
