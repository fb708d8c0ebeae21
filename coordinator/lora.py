"""LoRA training for the learner (peft), and the snapshot forms of a LoRA-trained policy.

With ``learner.lora_rank > 0`` the base weights stay frozen and only low-rank adapters are trained. A version
is then published as
- ``model.safetensors``: the merged weights ``W + alpha/r · B·A`` (torch clients and the learner's own
  verification of stale versions load an ordinary Hugging Face folder);
- ``base.gguf``: the frozen base, byte-identical in every version, so a llama.cpp client downloads it once
  (snapshot files are content-addressed);
- ``adapter.gguf``: this version's adapter, a small fraction of the full snapshot (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.config import LearnerConfig


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


def base_state(peft_model: Any) -> dict[str, Any]:
    """The frozen base weights under their plain HF names."""
    out: dict[str, Any] = {}
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


def merged_state(peft_model: Any) -> dict[str, Any]:
    """Base weights plus each adapter's delta: the policy as an ordinary model."""
    from peft.tuners.lora import LoraLayer

    state = base_state(peft_model)
    for module_name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            name = module_name.removeprefix("base_model.model.") + ".weight"
            delta = module.get_delta_weight("default")  # type: ignore[attr-defined]
            state[name] = state[name] + delta.detach().to(state[name].dtype)
    return state


def save_merged(peft_model: Any, tokenizer: Any, folder: Path) -> dict[str, Any]:
    """Write the merged policy as a Hugging Face folder; returns the merged state (HF names)."""
    from safetensors.torch import save_file

    base = peft_model.get_base_model()
    state = merged_state(peft_model)
    if getattr(base.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embeddings, stored once (as save_pretrained does)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    base.config.save_pretrained(str(folder))
    if base.generation_config is not None:
        base.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return state


def describe(peft_model: Any) -> dict[str, Any]:
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {"lora_trainable_parameters": trainable,
            "lora_config": json.loads(json.dumps(peft_model.peft_config["default"].to_dict(), default=str))}
