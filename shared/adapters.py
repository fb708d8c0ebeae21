"""A LoRA version as files, and applying it to a plain model in place (torch clients and the coordinator).

A LoRA run publishes its frozen base once, as an ordinary Hugging Face folder (config, tokenizer,
``model.safetensors``), and for every version only the adapter, in peft's own format:
``adapter_config.json`` and ``adapter_model.safetensors`` holding ``base_model.model.<module>.lora_A.weight``
[r, in] and ``….lora_B.weight`` [out, r] for each adapted linear layer. The version's policy is the base with
each adapted weight replaced by ``W0 + scale · B·A``, ``scale = lora_alpha / r`` (peft's merge).

Applying a version never needs a second model: each adapted weight is set to the base value read afresh from
the base's safetensors (memory-mapped, only those tensors, one at a time) plus this version's delta. Reading
W0 again — rather than subtracting the previous delta — keeps every version exact however many were applied
before, and costs no resident copy of the base weights. Which weights the model's current adapter touched is
remembered on the model object, so switching to an adapter with other targets (or to none) restores them.

peft itself is not needed here (only torch and safetensors), so a torch client needs no extra package.
Unsupported adapter features (DoRA, rsLoRA, per-module rank/alpha patterns, fan_in_fan_out, adapted
embeddings) are refused with :class:`AdapterError` rather than applied wrongly.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.policy import LOAD_LOCK, load_model

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
PEFT_PREFIX = "base_model.model."  # peft's name prefix for the wrapped model's modules
_APPLIED = "_echo_swarm_adapter_targets"  # attribute on a model: the weight names its current adapter changed


class AdapterError(ValueError):
    """A LoRA adapter that cannot be applied (malformed, unsupported, or for another model); the message says
    what was wrong."""


@dataclass(frozen=True)
class Adapter:
    """One version's adapter: {HF weight name: (A [r, in], B [out, r])} and the merge scale alpha/r."""

    factors: dict[str, tuple[Any, Any]]
    scale: float

    def delta(self, name: str) -> Any:
        """scale · B·A in float32, shaped like the weight it is added to."""
        a, b = self.factors[name]
        return (b.float() @ a.float()) * self.scale


def is_adapter_folder(folder: Path) -> bool:
    """True when ``folder`` holds a LoRA adapter (the version is base + adapter, not whole weights)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def peft_key(weight_name: str, factor: str) -> str:
    """peft's tensor name for ``factor`` ("lora_A"/"lora_B") of HF weight ``model.layers.0.….q_proj.weight``."""
    return f"{PEFT_PREFIX}{weight_name.removesuffix('.weight')}.{factor}.weight"


def read_adapter(folder: Path) -> Adapter:
    """Read and check the adapter files of a version folder (tensors on the CPU)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / ADAPTER_CONFIG} is missing or not JSON ({exc})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: not a LoRA adapter config (peft_type must be LORA)")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(key):
            raise AdapterError(f"{folder / ADAPTER_CONFIG}: {key} is not supported (plain LoRA only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"{folder / ADAPTER_CONFIG}: a per-module {key} is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise AdapterError(f"{folder / ADAPTER_CONFIG}: r must be a positive integer and lora_alpha positive "
                           f"(got r={rank!r}, lora_alpha={alpha!r})")
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / ADAPTER_WEIGHTS} is missing or unreadable ({exc})") from None
    factors: dict[str, tuple[Any, Any]] = {}
    for key in tensors:
        module, _, rest = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not key.startswith(PEFT_PREFIX) or rest not in ("A.weight", "B.weight"):
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: unexpected tensor {key!r} (only linear-layer "
                               f"lora_A/lora_B weights are supported)")
        name = f"{module}.weight"
        if name in factors:
            continue
        a, b = tensors.get(peft_key(name, "lora_A")), tensors.get(peft_key(name, "lora_B"))
        if a is None or b is None:
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: {module} has only one of lora_A, lora_B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{folder / ADAPTER_WEIGHTS}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                               f"expected A [r, in] and B [out, r] with r = {rank}")
        factors[name] = (a, b)
    if not factors:
        raise AdapterError(f"{folder / ADAPTER_WEIGHTS} holds no adapter weights")
    return Adapter(factors, float(alpha) / rank)


def base_weight_files(folder: Path) -> list[Path]:
    """The base model's safetensors files in ``folder`` (the adapter's own file excluded)."""
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.name != ADAPTER_WEIGHTS)


def applied_targets(model: Any) -> frozenset[str]:
    """The weight names the model's current adapter changed (empty: the model holds whatever was loaded)."""
    return frozenset(getattr(model, _APPLIED, ()))


def apply_adapter(model: Any, base_folder: Path, adapter: Adapter | None) -> None:
    """Make ``model`` (a plain model holding the base in ``base_folder``, possibly with another adapter applied
    by this function) compute base + ``adapter`` (None: the bare base), in place.

    Every weight touched by the previous or the new adapter is read back from the base file straight into the
    parameter, then the new delta is added in float32 (one fused multiply-add; a float32 copy first for
    lower-precision weights): the same arithmetic as peft's merge. Nothing else is written."""
    import torch

    if not holds_base(model):
        raise AdapterError("the model holds whole weights, not the base: load the base before applying an adapter")
    names = set(applied_targets(model)) | (set(adapter.factors) if adapter is not None else set())
    params = dict(model.named_parameters())
    missing = sorted(n for n in names if n not in params)
    if missing:
        raise AdapterError(f"the adapter changes {missing[:3]}, which this model does not have: it was trained "
                           f"for another architecture")
    # the model no longer equals base + a known adapter until every write below has succeeded
    setattr(model, _APPLIED, frozenset(names))
    left = set(names)
    with torch.no_grad():
        for path in base_weight_files(base_folder):
            if not left:
                break
            with SafetensorsFile(path) as fh:
                for name in sorted(left & set(fh.entries)):
                    param = params[name]
                    factors = adapter.factors.get(name) if adapter is not None else None
                    if factors is None:
                        fh.read_into(name, param)
                    else:
                        a, b = (f.to(device=param.device, dtype=torch.float32) for f in factors)
                        scale = adapter.scale if adapter is not None else 0.0
                        work = param if param.dtype == torch.float32 else torch.empty_like(param, dtype=torch.float32)
                        fh.read_into(name, work)
                        work.addmm_(b, a, alpha=scale)  # rank r is tiny: one memory-bound pass over W
                        if work is not param:
                            param.copy_(work)
                    left.discard(name)
    if left:
        raise AdapterError(f"the base in {base_folder} has no {sorted(left)[:3]}: the adapter does not belong to it")
    setattr(model, _APPLIED, frozenset(adapter.factors) if adapter is not None else frozenset())


def holds_base(model: Any) -> bool:
    """True when the model's weights are a base plus at most one adapter applied by :func:`apply_adapter`
    (False after whole weights were loaded into it: then no adapter may be applied before the base is back)."""
    return hasattr(model, _APPLIED)


def mark_base(model: Any, is_base: bool) -> None:
    """Record that whole weights were just loaded into the model: a base (True) or anything else (False)."""
    if is_base:
        setattr(model, _APPLIED, frozenset())
    elif hasattr(model, _APPLIED):
        delattr(model, _APPLIED)


def load_weights_in_place(model: Any, folder: Path) -> None:
    """Read a folder's whole weights (its safetensors, adapter file excluded) into ``model``'s own tensors with
    plain file reads (no memory map): the peak is the model plus at most one tensor for a dtype conversion, not
    a second state dict. A tied output layer is stored once (as save_pretrained does); any other difference
    means another model."""
    import torch

    files = base_weight_files(folder)
    if not files:
        raise FileNotFoundError(f"no weights in {folder}")
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    seen: set[str] = set()
    mark_base(model, False)  # until every tensor is in
    with torch.no_grad():
        for path in files:
            with SafetensorsFile(path) as fh:
                for name in fh.entries:
                    dest = targets.get(name)
                    if dest is None:
                        if name == "lm_head.weight":
                            continue  # tied to the embeddings in this model
                        raise ValueError(f"{path} has a tensor {name!r} this model does not: not its weights")
                    fh.read_into(name, dest)
                    seen.add(name)
    absent = sorted(n for n in dict(model.named_parameters()) if n not in seen)
    if absent:
        raise ValueError(f"{folder} lacks weights {absent[:3]}: not this model's weights")


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class SafetensorsFile:
    """A safetensors file read with ordinary reads into existing tensors. The format: an 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}} (offsets from the end of
    the header), then the raw little-endian tensor bytes. A memory map would keep every page it touched
    resident (and counted against the process) until closed; reads leave them in the reclaimable page cache."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "rb")  # noqa: SIM115 (closed by __exit__)
        try:
            (size,) = struct.unpack("<Q", self._fh.read(8))
            if size > 100 * 2**20:
                raise ValueError("header larger than 100 MiB")
            header = json.loads(self._fh.read(size))
        except (struct.error, ValueError) as exc:
            self._fh.close()
            raise ValueError(f"{self.path} is not a safetensors file ({exc})") from None
        header.pop("__metadata__", None)
        self._base = 8 + size
        self.entries: dict[str, dict[str, Any]] = header

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._fh.close()

    def read_into(self, name: str, dest: Any) -> None:
        """Copy tensor ``name`` into ``dest`` (same shape; any dtype and device: converted through one
        temporary tensor only when the stored dtype or the device differs)."""
        import torch

        entry = self.entries[name]
        dtype = getattr(torch, _DTYPES.get(entry.get("dtype", ""), "none"), None)
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if dtype is None or shape != tuple(dest.shape) or end - begin != dtype.itemsize * dest.numel():
            raise ValueError(f"{self.path}: {name} is {entry.get('dtype')} {list(shape)}, the model's is "
                             f"{str(dest.dtype).removeprefix('torch.')} {list(dest.shape)}: not this model's weights")
        direct = dest.device.type == "cpu" and dest.dtype == dtype and dest.is_contiguous()
        self._fh.seek(self._base + begin)
        if direct:
            self._read_exactly(name, dest.detach())
            return
        if not dest.is_contiguous():
            buf = torch.empty(shape, dtype=dtype)
            self._read_exactly(name, buf)
            dest.copy_(buf)
            return
        # converted a piece at a time: the temporary is READ_PIECE bytes, not the tensor (a 0.5 B model's
        # embedding is 272 MB in bfloat16)
        flat = dest.detach().view(-1)
        step = max(1, READ_PIECE // dtype.itemsize)
        piece = torch.empty(min(step, flat.numel()), dtype=dtype)
        for start in range(0, flat.numel(), step):
            part = piece[: min(step, flat.numel() - start)]
            self._read_exactly(name, part)
            flat[start : start + part.numel()].copy_(part)

    def _read_exactly(self, name: str, buf: Any) -> None:
        """Fill ``buf`` (a contiguous CPU tensor) from the file's current position."""
        import torch

        raw: Any = buf.view(torch.uint8).reshape(-1).numpy()  # the tensor's own bytes, writable
        view = memoryview(raw) if buf.numel() else memoryview(b"")
        got = 0
        while got < len(view):
            n = self._fh.readinto(view[got:])
            if not n:
                raise ValueError(f"{self.path} ends inside tensor {name}: the file is truncated")
            got += n


#: Bytes :meth:`SafetensorsFile.read_into` converts at once when the file's dtype or device is not the tensor's.
READ_PIECE = 32 * 2**20


def read_model(folder: Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """:func:`shared.policy.load_model`'s model, built from the folder's config with uninitialised weights and
    filled by :func:`load_weights_in_place`. Why: transformers' loader maps the safetensors file, and every page it
    touches counts against the process until loading ends, so a bfloat16 snapshot loaded as float32 peaks at
    1.5× the model; here the peak is the model plus READ_PIECE. Owns its memory (no mapping of a file that the
    publisher may later prune)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with LOAD_LOCK:  # transformers' construction is not thread-safe (shared.policy.LOAD_LOCK), nor is the patching
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device(device), no_init_weights():  # untouched empty pages cost no memory until read into
            model: Any = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.tie_weights()
    load_weights_in_place(model, Path(folder))
    return model.eval()


def load_base_model(folder: Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """A plain model from the base files in ``folder``, ignoring any adapter files beside them."""
    import tempfile

    folder = Path(folder)
    if not is_adapter_folder(folder):
        model = load_model(folder, device, dtype)
    else:  # transformers would apply adapter files it finds beside config.json (peft integration): hide them
        with tempfile.TemporaryDirectory(prefix="echo-swarm-base-") as tmp:
            for p in folder.iterdir():
                if p.is_file() and p.name not in ADAPTER_FILES and not p.name.startswith("."):
                    os.symlink(p.resolve(), Path(tmp) / p.name)
            model = load_model(Path(tmp), device, dtype)
    mark_base(model, True)
    return model


def load_version_model(base_folder: Path, version_folder: Path, device: str = "cpu",
                       dtype: str = "float32") -> Any:
    """The policy of one version as a plain model: base + the version's adapter when ``version_folder`` holds
    one, else the version folder's own whole weights (full-weight runs, and LoRA versions published before the
    base was shared, whose folders hold merged weights)."""
    if not is_adapter_folder(version_folder):
        return load_model(Path(version_folder), device, dtype).eval()
    model = load_base_model(base_folder, device, dtype)
    apply_adapter(model, base_folder, read_adapter(version_folder))
    return model.eval()


