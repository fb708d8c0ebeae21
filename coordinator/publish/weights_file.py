"""A version's ``model.safetensors`` written tensor by tensor, chunk by chunk, without ever changing its input; and
read back the same way.

Why. A bf16 learner publishing bf16 snapshots hands the publisher its *live* weights instead of a copy (the copy
was 2 B/param of the learner's peak, coordinator.engine.learner), so the writer must not touch them: lazy
publication's rule (coordinator.publish.lazy) is applied to a chunk-sized scratch buffer on its way to the file,
not to the tensors. The file is byte for byte what ``safetensors.torch.save_file`` writes for the same values
(same header, same order, same padding; tests/unit/test_weights_file.py checks it). The GGUF form is then written
from this file (:class:`StoredWeights`: plain reads, one block of rows at a time, no mmap whose pages would count
in the learner's RSS), so both forms hold the same, settled, values.

The layout (safetensors' own): 8 bytes little-endian header length, a compact JSON header
(``__metadata__`` first, then the tensors in the order of their data, each with ``dtype``, ``shape`` and
``data_offsets`` relative to the data), padded with spaces to a multiple of 8 bytes, then the tensors' raw bytes:
ordered by dtype, widest first (safetensors' enum order, descending), then by name.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.publish.lazy import CHUNK_ELEMENTS, Lag, LagRule, Settled

if TYPE_CHECKING:
    from torch import Tensor

# safetensors' dtype names, in the order of its Rust enum (the data is laid out by this order, descending)
_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64",
          "U64")
_NAMES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
          "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
          "float32": "F32", "float64": "F64", "int64": "I64", "uint64": "U64"}


class WeightsFileError(ValueError):
    """A tensor cannot be written as safetensors, or a file is not the safetensors file it should be."""


def _dtype_name(tensor: Tensor) -> str:
    name = _NAMES.get(str(tensor.dtype).removeprefix("torch."))
    if name is None:
        raise WeightsFileError(f"safetensors stores no {tensor.dtype} tensors; publish in one of "
                               f"{', '.join(sorted(_NAMES))}")
    return name


def _raw(tensor: Tensor) -> Any:
    """The tensor's own bytes, as a flat uint8 numpy array (a view: nothing is copied unless the tensor is not
    contiguous or not on the CPU)."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else flat.new_empty(0, dtype=torch.uint8).numpy()


def write_weights(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None,
                  lag: LagRule | None = None) -> Settled | None:
    """Write ``tensors`` as the safetensors file ``path`` (byte-identical to ``save_file``), reading each one a chunk
    at a time and never writing to it. ``lag``: lazy publication against the previous version's file
    (coordinator.publish.lazy), applied to the chunks on their way out; returns what it did (None without ``lag``,
    or when the previous file is gone: then everything is published as it is)."""
    kinds = {name: _dtype_name(t) for name, t in tensors.items()}
    order = sorted(tensors, key=lambda n: (-_ORDER.index(kinds[n]), n))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    at = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": kinds[name], "shape": [int(d) for d in t.shape], "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    settler = Lag.open(lag) if lag is not None else None
    try:
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)))
            fh.write(text)
            for name in order:
                t = tensors[name]
                if settler is not None and settler.applies(name, t):
                    for chunk in settler.chunks(name, t):
                        fh.write(chunk.data)
                    continue
                raw = _raw(t)
                step = CHUNK_ELEMENTS * max(1, t.element_size())
                for start in range(0, raw.size, step):
                    fh.write(raw[start:start + step].data)
    finally:
        if settler is not None:
            settler.close()
    return settler.settled() if settler is not None else None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, read on demand: ``value[a:b]`` reads rows a..b (a torch tensor) with a
    plain read; ``shape`` and ``dtype`` come from the header. What :func:`write_model_gguf` needs of a tensor."""

    path: Path
    dtype: str  # torch's name (bfloat16)
    shape: tuple[int, ...]
    offset: int  # of the first data byte in the file

    def __getitem__(self, rows: slice) -> Tensor:
        import torch

        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a stored tensor is read by a plain slice of rows")
        count = int(self.shape[0]) if self.shape else 1
        start, stop, _ = rows.indices(count)
        stop = max(start, stop)
        dtype = getattr(torch, self.dtype)
        row = math.prod(self.shape[1:]) if self.shape else 1
        width = torch.empty(0, dtype=dtype).element_size()
        out = torch.empty((stop - start) * row, dtype=dtype)
        buf = out.view(torch.uint8).numpy() if out.numel() else None
        if buf is not None:
            with open(self.path, "rb", buffering=0) as fh:
                fh.seek(self.offset + start * row * width)
                done = 0
                while done < buf.nbytes:
                    n = fh.readinto(buf[done:].data)
                    if not n:
                        raise WeightsFileError(f"{self.path} ends inside a tensor")
                    done += n
        return out.reshape(stop - start, *self.shape[1:]) if self.shape else out.reshape(())

    def reshape(self, *shape: int) -> StoredTensor:
        """Only the flattening ``reshape(-1)`` of a vector, as the GGUF writer asks of 1-D tensors."""
        if tuple(shape) != (-1,) or len(self.shape) > 1:
            raise TypeError("a stored tensor is only flattened when it is a vector")
        return StoredTensor(self.path, self.dtype, (math.prod(self.shape),), self.offset)


class StoredWeights(Mapping[str, StoredTensor]):
    """The tensors of a safetensors file by name (header read once; data read per slice, see :class:`StoredTensor`),
    in the file's order, or in ``order`` when given (the GGUF's tensor table follows the learner's state dict)."""

    def __init__(self, path: Path, order: list[str] | None = None) -> None:
        torch_names = {v: k for k, v in _NAMES.items()}
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        self._tensors = {
            name: StoredTensor(Path(path), torch_names[str(t["dtype"])], tuple(int(d) for d in t["shape"]),
                               8 + n + int(t["data_offsets"][0]))
            for name, t in header.items() if name != "__metadata__"}
        if order is not None:
            missing = [k for k in order if k not in self._tensors]
            if missing:
                raise WeightsFileError(f"{path} lacks tensors {missing[:3]}")
            self._tensors = {k: self._tensors[k] for k in order}

    def __getitem__(self, name: str) -> StoredTensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
