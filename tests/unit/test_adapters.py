"""shared.adapters: a LoRA version = base + scale·B·A on the adapted weights, applied in place, exactly, and
switched between versions without drift; malformed or unsupported adapters are refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    apply_adapter,
    is_adapter_folder,
    load_base_model,
    load_weights_in_place,
    peft_key,
    read_adapter,
)

TARGETS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight")


def _config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                       tie_word_embeddings=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    Qwen2ForCausalLM(_config()).save_pretrained(str(folder), safe_serialization=True)
    return folder


def _write_adapter(folder: Path, seed: int, rank: int = 2, alpha: float = 4.0, **extra: Any) -> dict[str, Any]:
    """peft's file layout, written by hand: {peft key: tensor}."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    out_dims = {"q_proj": 16, "v_proj": 8}
    tensors = {}
    for name in TARGETS:
        out = out_dims[name.split(".")[-2]]
        tensors[peft_key(name, "lora_A")] = torch.randn(rank, 16, generator=g)
        tensors[peft_key(name, "lora_B")] = torch.randn(out, rank, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    (folder / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, **extra}))
    return tensors


def _weights(model: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_apply_switch_and_remove_are_exact(base: Path, tmp_path: Path) -> None:
    import torch

    t1 = _write_adapter(tmp_path / "v1", 1)
    _write_adapter(tmp_path / "v2", 2)
    model = load_base_model(base)
    w0 = _weights(model)
    apply_adapter(model, base, read_adapter(tmp_path / "v1"))
    after1 = _weights(model)
    for name in TARGETS:
        a, b = t1[peft_key(name, "lora_A")], t1[peft_key(name, "lora_B")]
        assert torch.allclose(after1[name], w0[name] + (b @ a) * 2.0, atol=1e-6)  # alpha / r = 4 / 2
    assert all(torch.equal(after1[k], w0[k]) for k in w0 if k not in TARGETS)  # nothing else written
    for _ in range(3):  # switching back and forth never drifts: W0 is read afresh every time
        apply_adapter(model, base, read_adapter(tmp_path / "v2"))
        apply_adapter(model, base, read_adapter(tmp_path / "v1"))
    assert all(torch.equal(v, after1[k]) for k, v in _weights(model).items())
    apply_adapter(model, base, None)
    assert all(torch.equal(v, w0[k]) for k, v in _weights(model).items())


def test_matches_peft_merge(base: Path, tmp_path: Path) -> None:
    """The same adapter through peft (load + merge_and_unload) gives the same weights."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    tensors = _write_adapter(tmp_path / "v1", 3)
    peft_model = get_peft_model(load_base_model(base), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    set_peft_model_state_dict(peft_model, tensors)
    merged = peft_model.merge_and_unload()
    ours = load_base_model(base)
    apply_adapter(ours, base, read_adapter(tmp_path / "v1"))
    for name in TARGETS:
        assert torch.allclose(ours.state_dict()[name], merged.state_dict()[name], atol=1e-6)


def test_the_base_loads_without_the_adapter_beside_it(base: Path, tmp_path: Path) -> None:
    """A client's folder holds base files and adapter files together; transformers would apply the adapter it
    finds there (peft integration), load_base_model must not."""
    import shutil

    import torch

    folder = tmp_path / "client"
    shutil.copytree(base, folder)
    _write_adapter(folder, 4)
    assert is_adapter_folder(folder)
    plain = load_base_model(base)
    beside = load_base_model(folder)
    assert type(beside) is type(plain)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in beside.state_dict().items())


@pytest.mark.parametrize(("extra", "match"), [
    ({"use_dora": True}, "use_dora"),
    ({"use_rslora": True}, "use_rslora"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "not a LoRA"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_unsupported_configs_are_refused(tmp_path: Path, extra: dict[str, Any], match: str) -> None:
    _write_adapter(tmp_path, 5)
    cfg = json.loads((tmp_path / ADAPTER_CONFIG).read_text()) | extra
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=match):
        read_adapter(tmp_path)


def test_malformed_tensors_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = _write_adapter(tmp_path, 6)
    one = {k: v for k, v in tensors.items() if not k.endswith("v_proj.lora_B.weight")}
    save_file(one, str(tmp_path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match="only one of lora_A, lora_B"):
        read_adapter(tmp_path)
    wrong_rank = dict(tensors)
    wrong_rank[peft_key(TARGETS[0], "lora_A")] = tensors[peft_key(TARGETS[0], "lora_A")][:1]
    save_file(wrong_rank, str(tmp_path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match="expected A"):
        read_adapter(tmp_path)
    embedding = tensors[peft_key(TARGETS[0], "lora_A")].clone()
    save_file({**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": embedding},
              str(tmp_path / ADAPTER_WEIGHTS))
    with pytest.raises(AdapterError, match="unexpected tensor"):
        read_adapter(tmp_path)


def test_an_adapter_for_another_model_is_refused_before_anything_is_written(base: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = _write_adapter(tmp_path, 7)
    renamed = {k.replace("layers.0", "layers.5"): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / ADAPTER_WEIGHTS))
    model = load_base_model(base)
    w0 = _weights(model)
    with pytest.raises(AdapterError, match="does not have"):
        apply_adapter(model, base, read_adapter(tmp_path))
    assert all(torch.equal(v, w0[k]) for k, v in _weights(model).items())


def test_whole_weights_load_in_place_and_other_models_are_refused(base: Path, tmp_path: Path) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(1)
    other = Qwen2ForCausalLM(_config())
    other.save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    model = load_base_model(base)
    load_weights_in_place(model, tmp_path / "other")
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
    bigger = _config()
    bigger.hidden_size = 32
    Qwen2ForCausalLM(bigger).save_pretrained(str(tmp_path / "bigger"), safe_serialization=True)
    with pytest.raises(ValueError, match="not this model's weights"):
        load_weights_in_place(model, tmp_path / "bigger")
