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
from collections.abc import Iterator
from dataclasses import dataclass
from io import BufferedReader
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
    """What a version's settling (:class:`Lag`) did: elements of 16-bit tensors compared, republished (differ from
    the previous version's) and held back (their rounding moved, by no more than δ)."""

    elements: int
    republished: int
    held: int


@dataclass(frozen=True)
class LagRule:
    """Lazy publication of one version: against ``previous`` (the previous version's ``model.safetensors``), with
    δ = ``tolerance`` · eps · RMS, at most ``cap`` (``lag_steps × lr``; None: no cap)."""

    previous: Path
    tolerance: float
    cap: float | None = None


@dataclass(frozen=True)
class _Stored:
    """A tensor as a safetensors file stores it: dtype name (``BF16``), shape, and its first data byte."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


def _tensors(fh: BufferedReader) -> dict[str, _Stored]:
    fh.seek(0)
    (n,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(n))
    return {name: _Stored(str(t["dtype"]), tuple(int(d) for d in t["shape"]), 8 + n + int(t["data_offsets"][0]))
            for name, t in header.items() if name != "__metadata__"}


class Lag:
    """The rule (module docstring) applied on the way to the file (coordinator.publish.weights_file): a tensor of
    this version (name → CPU tensor in the publish dtype) is read a chunk at a time and each chunk's settled bits
    are yielded from a scratch buffer, so the tensor itself is never written to (it may be the learner's live
    weights). Tensors the previous file does not hold with the same dtype and shape are published whole.

    Works on the elements' bit patterns with numpy and computes the gap only where the rounding moved (a
    minority): about 15 ms per million elements, where torch's masked ops took 120."""

    def __init__(self, rule: LagRule, fh: BufferedReader) -> None:
        self.rule = rule
        self._fh = fh
        self._stored = _tensors(fh)
        self._elements = self._republished = self._held = 0

    @classmethod
    def open(cls, rule: LagRule) -> Lag | None:
        """None when the previous file is gone (pruned under us): the version is published whole."""
        try:
            fh = open(rule.previous, "rb")  # noqa: SIM115  # closed by close(), after the whole file is written
        except FileNotFoundError:
            return None
        try:
            return cls(rule, fh)
        except BaseException:
            fh.close()
            raise

    def close(self) -> None:
        self._fh.close()

    def settled(self) -> Settled:
        return Settled(self._elements, self._republished, self._held)

    def applies(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor`` is settled (a 16-bit float tensor the previous file holds alike), else written whole."""
        entry = self._stored.get(name)
        dtype = str(tensor.dtype).removeprefix("torch.")
        return (dtype in _DTYPES.values() and entry is not None and _DTYPES.get(entry.dtype) == dtype
                and entry.shape == tuple(tensor.shape) and tensor.is_contiguous() and tensor.device.type == "cpu")

    def chunks(self, name: str, tensor: Tensor) -> Iterator[np.ndarray]:
        """The settled bit patterns of ``tensor`` (for which :meth:`applies`), in order, a chunk at a time; each
        yielded array is a scratch buffer, valid until the next one is asked for."""
        import numpy as np
        import torch

        entry = self._stored[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        bits = tensor.detach().view(-1).view(torch.int16).numpy().view(np.uint16)  # read only
        delta = self.rule.tolerance * float(torch.finfo(tensor.dtype).eps) * _rms(bits, dtype)
        if self.rule.cap is not None:
            delta = min(delta, self.rule.cap)
        size = min(CHUNK_ELEMENTS, bits.size)
        old, out = np.empty(size, np.uint16), np.empty(size, np.uint16)
        for at in range(0, bits.size, CHUNK_ELEMENTS):
            new = bits[at:at + CHUNK_ELEMENTS]
            prev, settled = old[:new.size], out[:new.size]
            self._fh.seek(entry.offset + 2 * at)
            if self._fh.readinto(prev.data) != prev.nbytes:
                raise ValueError(f"{self.rule.previous} ends inside tensor {name!r}")
            np.copyto(settled, new)
            moved = np.flatnonzero(new != prev)  # bit patterns: +0 and -0 differ too
            near = moved[np.abs(_values(new[moved], dtype) - _values(prev[moved], dtype)) <= delta]
            settled[near] = prev[near]
            self._elements += new.size
            self._held += near.size
            self._republished += moved.size - near.size
            yield settled


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
