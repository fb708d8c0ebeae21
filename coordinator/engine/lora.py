"""LoRA training for the learner (peft), and how a LoRA-trained policy is published and verified.

With ``learner.lora_rank > 0`` the base weights stay frozen and only low-rank adapters are trained. The frozen
base is written ONCE per run, into the run-level folder ``snapshots/base/`` (coordinator.publish.snapshots writes a
shared file the first time a version lists it and reuses it afterwards):
- ``model.safetensors`` + ``config.json`` + generation config + tokenizer files: the base as an ordinary
  Hugging Face folder (torch clients, verification);
- ``base.gguf``: the same base for llama.cpp clients (when ``snapshots.gguf`` is not "off").
A version is then only its adapter, written from a CPU copy taken on the learner thread:
- ``adapter_model.safetensors`` + ``adapter_config.json``: peft's own format (shared.adapters reads it);
- ``adapter.gguf``: the same adapter for llama.cpp.
Each version's manifest lists the base files (same sha256 every version) beside its own, so a client
downloads the base once and then only adapters (a few hundred KB at 0.5 B parameters, rank 4). No merged
weights are written: a torch client and the verifier apply the adapter to the base in place
(shared.adapters.apply_adapter), llama.cpp applies it at run time.

Version 0 of a LoRA run is the base plus peft's initial adapter: A random, B = 0, so its policy is the base.

Run directories written before the base was shared hold merged weights (``model.safetensors``) and their own
``base.gguf`` + ``adapter.gguf`` in every version folder and no ``adapter_config.json``: such a version is
loaded as the whole model it is (:func:`shared.adapters.load_version_model`), so a restarted coordinator still
serves and verifies it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from coordinator.config import LearnerConfig
from coordinator.engine.weights import load_full_state, read_weights
from coordinator.publish.gguf_export import route, write_adapter_gguf, write_model_gguf
from coordinator.publish.snapshots import BASE_DIR
from shared.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    AdapterError,
    apply_adapter,
    base_weight_files,
    holds_base,
    is_adapter_folder,
    load_base_model,
    load_version_model,
    mark_base,
    peft_key,
    read_adapter,
)
from shared.policy import load_tokenizer

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["AdapterError", "AdapterSnapshot", "VersionLoader", "adapter_snapshot", "base_folder_for",
           "base_writers", "is_adapter_folder", "load_adapter", "load_base_model",
           "load_version_model", "wrap", "write_adapter"]

BASE_WEIGHTS = "model.safetensors"
BASE_GGUF = "base.gguf"
ADAPTER_GGUF = "adapter.gguf"


def wrap(model: Any, cfg: LearnerConfig) -> Any:
    """The model with trainable LoRA adapters on ``cfg.lora_targets`` (B initialised to zero, so version 0
    of a LoRA run equals the base model)."""
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(r=cfg.lora_rank, target_modules=list(cfg.lora_targets), lora_dropout=0.0, bias="none",
                      lora_alpha=cfg.lora_alpha)  # type: ignore[arg-type]  # peft annotates int; floats work
    return get_peft_model(model, lcfg)


def _base_name(key: str) -> str | None:
    """Map a peft-wrapped parameter name to the plain HF name (None for adapter weights)."""
    if ".lora_" in key:
        return None
    key = key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".")


def plain_names(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A peft model's base weights (adapter weights dropped) under their plain HF names."""
    return {name: value for key, value in state.items() if (name := _base_name(key)) is not None}


def base_state(peft_model: Any) -> dict[str, Tensor]:
    """The frozen base weights under their plain HF names (references, not copies: they never change)."""
    out: dict[str, Tensor] = {}
    for key, value in peft_model.state_dict().items():
        name = _base_name(key)
        if name is not None:
            out[name] = value.detach()
    return out


def adapter_pairs(peft_model: Any) -> tuple[dict[str, tuple[Any, Any]], float]:
    """{HF weight name: (A [r, in], B [out, r])} of every adapted linear layer, and the scale alpha."""
    from peft.tuners.lora import LoraLayer

    pairs: dict[str, tuple[Any, Any]] = {}
    alpha = None
    for module_name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            name = module_name.removeprefix("base_model.model.") + ".weight"
            pairs[name] = (module.lora_A["default"].weight.detach(),  # type: ignore[operator]
                           module.lora_B["default"].weight.detach())  # type: ignore[operator]
            alpha = float(module.lora_alpha["default"])
    if alpha is None:
        raise ValueError("the model has no LoRA adapters")
    return pairs, alpha


def _adapter_config_bytes(peft_model: Any) -> bytes:
    """peft's adapter_config.json for this model, deterministic (the same bytes every version, so one blob).
    ``base_model_name_or_path`` is dropped: it would publish a path on the coordinator's disk, and the base
    travels with every version's manifest anyway."""
    cfg = peft_model.peft_config["default"].to_dict()
    cfg.pop("base_model_name_or_path", None)
    cfg.pop("revision", None)
    for key, value in list(cfg.items()):
        if isinstance(value, set | frozenset):
            cfg[key] = sorted(value)
    return (json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n").encode()


@dataclass(frozen=True)
class AdapterSnapshot:
    """A version's adapter, copied to the CPU on the learner thread: peft's tensor names → float32 tensors,
    its adapter_config.json, and the scale numerator alpha (for the GGUF form)."""

    tensors: dict[str, Tensor]
    config_json: bytes
    alpha: float

    def pairs(self) -> dict[str, tuple[Any, Any]]:
        """{HF weight name: (A, B)} as the GGUF writer takes them."""

        out: dict[str, tuple[Any, Any]] = {}
        for key in self.tensors:
            module, _, factor = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if factor == "A.weight":
                out[f"{module}.weight"] = (self.tensors[key], self.tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"])
        return out


def adapter_snapshot(peft_model: Any, state_dict: Mapping[str, Any] | None = None) -> AdapterSnapshot:
    """Copy the trainable adapter (a few MB at most) so the publisher can write it while training goes on.
    ``state_dict``: the model's adapter weights by parameter name when the model's own are shards (FSDP)."""
    import torch
    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().to("cpu", dtype=torch.float32, copy=True)
               for k, v in get_peft_model_state_dict(peft_model, state_dict=state_dict).items()}
    _, alpha = adapter_pairs(peft_model)
    return AdapterSnapshot(tensors, _adapter_config_bytes(peft_model), alpha)


def write_adapter(folder: Path, snap: AdapterSnapshot, static_files: Mapping[str, bytes], gguf: str) -> None:
    """Write one version's own files: the peft adapter and, unless ``gguf`` is "off", its GGUF form, by the route
    of the base (coordinator.publish.gguf_export.write_adapter_gguf), which reads the base's config and tokenizer
    from ``static_files`` (name → bytes, as :func:`base_writers` takes them)."""
    from safetensors.torch import save_file

    save_file(snap.tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_bytes(snap.config_json)
    if gguf != "off":
        with tempfile.TemporaryDirectory(prefix="echo-swarm-base-") as tmp:
            _write_static(Path(tmp), static_files)
            write_adapter_gguf(folder / ADAPTER_GGUF, Path(tmp), folder, snap.pairs(), snap.alpha,
                               "f32" if gguf == "f32" else "f16")


def _write_static(folder: Path, static_files: Mapping[str, bytes]) -> None:
    for name, data in static_files.items():
        (folder / name).write_bytes(data)


Writer = Callable[[Path], None]


def base_writers(peft_model: Any, static_files: Mapping[str, bytes], dtype: Any, gguf: str,
                 gathered: Mapping[str, Any] | None = None) -> dict[str, Writer]:
    """Writers of the run-level base files, by manifest name (each writes exactly the path it is given):
    ``static_files`` (config.json, tokenizer files: name → bytes), ``model.safetensors`` (the frozen base in
    ``dtype``, a torch dtype) and ``base.gguf``. They read the frozen base weights, which never change, so
    they may run on another thread while the learner trains. ``gathered``: the base under plain names when the
    model holds only shards of it (FSDP), gathered on the learner's thread."""
    base = peft_model.get_base_model()
    tied = bool(getattr(base.config, "tie_word_embeddings", False))

    def state() -> dict[str, Tensor]:
        out = dict(gathered) if gathered is not None else base_state(peft_model)
        if tied:
            out.pop("lm_head.weight", None)  # tied to the embeddings, stored once (as save_pretrained does)
        return out

    def bytes_writer(data: bytes) -> Writer:
        def write(path: Path) -> None:
            path.write_bytes(data)

        return write

    def write_weights(path: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.to("cpu", dtype=dtype if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in state().items()}, str(path), metadata={"format": "pt"})

    def write_gguf(path: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="echo-swarm-base-") as tmp:  # the GGUF writer reads these files
            _write_static(Path(tmp), static_files)
            if route(Path(tmp)) == "converter":  # llama.cpp's converter reads the weights from the folder
                write_weights(Path(tmp) / BASE_WEIGHTS)
            write_model_gguf(path, Path(tmp), state(), gguf)

    writers: dict[str, Writer] = {name: bytes_writer(data) for name, data in static_files.items()}
    writers[BASE_WEIGHTS] = write_weights
    if gguf != "off":
        writers[BASE_GGUF] = write_gguf
    return writers


def load_adapter(peft_model: Any, folder: Path) -> None:
    """Load a published version's adapter into the learner's peft model (resuming a run from a version folder).
    Refuses an adapter whose targets or rank differ from the model's (learner.lora_* changed mid-run)."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    read_adapter(folder)  # checks the files
    tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    pairs, _ = adapter_pairs(peft_model)
    want = {peft_key(n, f): (a if f == "lora_A" else b).shape for n, (a, b) in pairs.items()
            for f in ("lora_A", "lora_B")}
    got = {k: v.shape for k, v in tensors.items()}
    if want != got:
        raise AdapterError(f"the adapter in {folder} does not fit this learner's LoRA setup (learner.lora_rank / "
                           f"lora_targets changed?): {len(got)} tensors vs {len(want)} expected; restore the "
                           f"run's LoRA settings to resume it")
    with torch.no_grad():
        set_peft_model_state_dict(peft_model, tensors)


def base_folder_for(version_folder: Path) -> Path:
    """Where a version's base lives: the version folder itself when it holds base weights (a folder written by
    :meth:`Learner.save_model` alone), else the run-level ``snapshots/base/`` beside it."""

    version_folder = Path(version_folder)
    if base_weight_files(version_folder):
        return version_folder
    return version_folder.parent / BASE_DIR


class VersionLoader:
    """Stale-version models for verification with one model in memory: the base loaded once, each version's
    adapter applied in place (only the adapted weights are rewritten). A version folder without an adapter
    (an older run's merged weights) is loaded whole into the same model; the base is reloaded whole only when
    an adapter version follows such a folder.

    For coordinator.engine.verifier: ``load_first(folder, device, dtype)`` → model and ``load_into(model, folder)``;
    ``load_state(folder, device)`` (a whole state dict) is there for callers that can only load full weights."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = Path(base_dir)

    def _base_of(self, folder: Path) -> Path:
        own = base_folder_for(folder)
        return own if base_weight_files(own) else self.base_dir

    def load_first(self, folder: Path, device: str, dtype: str) -> Any:
        folder = Path(folder)
        return load_version_model(self._base_of(folder), folder, device, dtype)

    def load_eval(self, folder: Path, device: str = "cpu") -> tuple[Any, Any]:
        """(model, tokenizer) of a version, for coordinator.engine.evaluation.Evaluator's ``load``."""

        folder = Path(folder)
        model = self.load_first(folder, device, "float32")
        return model, self.load_tokenizer(folder)

    def load_tokenizer(self, folder: Path) -> Any:
        """A version's tokenizer: its base's for an adapter folder (which holds none), else the folder's own."""
        folder = Path(folder)
        return load_tokenizer(self._base_of(folder) if is_adapter_folder(folder) else folder)

    def load_into(self, model: Any, folder: Path) -> None:
        folder = Path(folder)
        if not is_adapter_folder(folder):
            _load_whole(model, folder)
            mark_base(model, False)
            return
        base = self._base_of(folder)
        if not holds_base(model):
            _load_whole(model, base)
            mark_base(model, True)
        apply_adapter(model, base, read_adapter(folder))

    def load_state(self, folder: Path, device: str) -> dict[str, Tensor]:
        folder = Path(folder)
        if not is_adapter_folder(folder):
            return read_weights(folder, device)
        adapter = read_adapter(folder)
        state = read_weights(self._base_of(folder), device)
        for name in adapter.factors:
            w = state[name]
            state[name] = (w.float() + adapter.delta(name).to(w.device)).to(w.dtype)
        return state


def _load_whole(model: Any, folder: Path) -> None:
    """Load a folder's whole weights into ``model`` in place; a tied output layer may be absent (stored once)."""
    device = str(next(model.parameters()).device)
    load_full_state(model, read_weights(folder, device), folder)


class LoraDescription(TypedDict):
    """What the learner's report says of its adapter. ``lora_config`` is peft's adapter_config.json as it is: its
    keys are peft's, and change with peft's version."""

    lora_trainable_parameters: int
    lora_config: dict[str, object]


def describe(peft_model: Any) -> LoraDescription:
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {"lora_trainable_parameters": trainable,
            "lora_config": json.loads(_adapter_config_bytes(peft_model))}

