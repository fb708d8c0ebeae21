"""llama.cpp's converter is vendored unchanged (coordinator/publish/vendor_llama_cpp/SOURCE.md): every file matches
the hash it was copied with, so an edit of upstream code cannot slip in; the routes the exporter picks; and what
start-up refuses before any role runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.launch.preflight import PreflightError, check_gguf_family, check_lora_targets
from coordinator.publish.gguf_export import GGUFExportError, route
from coordinator.publish.hf_convert import VENDOR, pre_tokenizer_name
from shared.exit_codes import ExitCode


def test_every_vendored_file_is_upstreams_byte_for_byte() -> None:
    listed = {}
    for line in (VENDOR / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name.removeprefix("./")] = digest
    present = {p.relative_to(VENDOR).as_posix() for p in VENDOR.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts and p.name not in ("SHA256SUMS", "SOURCE.md")}
    assert present == set(listed), present ^ set(listed)
    changed = [n for n, d in listed.items() if hashlib.sha256((VENDOR / n).read_bytes()).hexdigest() != d]
    assert changed == []
    assert "MIT License" in (VENDOR / "LICENSE").read_text()


def test_pre_tokenizer_names_come_from_the_regex_the_tokenizer_states() -> None:
    def tok(pre: object, merges: bool = True) -> dict[str, object]:
        return {"model": {"type": "BPE", "merges": ["a b"] if merges else []}, "pre_tokenizer": pre}

    split = {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t)|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"}}
    assert pre_tokenizer_name(tok({"type": "Sequence", "pretokenizers": [split]})) == "llama-bpe"
    split["pattern"] = {"Regex": r"(?i:'s|'t)|\p{N}| ?[^\s\p{L}\p{N}]+"}
    assert pre_tokenizer_name(tok(split)) == "qwen2"
    assert pre_tokenizer_name(tok({"type": "ByteLevel", "use_regex": True})) == "gpt-2"
    smol = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                  {"type": "ByteLevel", "use_regex": True}]}
    assert pre_tokenizer_name(tok(smol)) == "smollm"
    assert pre_tokenizer_name(tok({"type": "Whitespace"})) is None  # upstream's fingerprint decides
    assert pre_tokenizer_name(tok(None, merges=False)) == "default"  # one byte per token whatever the split


def test_the_project_writes_qwen2_itself_and_the_converter_the_rest(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert route(tiny_model_dir) == "writer"  # the files every earlier version published, byte for byte
    config = json.loads((tiny_model_dir / "config.json").read_text())
    for arch, want in (("LlamaForCausalLM", "writer"), ("Qwen3ForCausalLM", "converter"),
                       ("Olmo2ForCausalLM", "converter")):
        folder = tmp_path / arch
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        (folder / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
        assert route(folder) == want, arch
    scaled = tmp_path / "LlamaForCausalLM"  # Llama 3.1's rope scaling needs the rope_freqs tensor upstream writes
    (scaled / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"],
                                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    assert route(scaled) == "converter"


def test_a_lora_run_of_a_converted_family_starts_and_an_unsupported_one_is_refused(tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """Every family the exporter writes gets llama.cpp LoRA adapters by the same route as its base, so a LoRA run
    of a converted family (Qwen3; Llama 3.1 with rope scaling) starts; an architecture no route writes does not."""
    config = json.loads((tiny_model_dir / "config.json").read_text())

    def model(name: str, **keys: object) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **keys}))
        (folder / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
        return folder

    def run(folder: Path, **keys: object) -> object:
        return load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(folder), **keys})

    qwen3 = model("qwen3", architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    llama31 = model("llama31", architectures=["LlamaForCausalLM"], model_type="llama",
                    rope_scaling={"rope_type": "llama3", "factor": 8.0})
    for folder in (qwen3, llama31, tiny_model_dir):
        check_gguf_family(run(folder), folder)
        check_gguf_family(run(folder, **{"learner.lora_rank": 4}), folder)
    gpt2 = model("gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(PreflightError) as err:
        check_gguf_family(run(gpt2, **{"learner.lora_rank": 4}), gpt2)
    assert err.value.code == ExitCode.MODEL_INVALID
    assert "GGUF export supports Qwen2ForCausalLM" in err.value.message
    check_gguf_family(run(gpt2, **{"learner.lora_rank": 4, "snapshots.gguf": "off"}), gpt2)  # torch clients only


def test_a_gemma_layer_pattern_llama_cpp_does_not_run_is_refused_at_start_up(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """llama.cpp runs Gemma 3 as five local layers then one global, repeated (the converter writes no per-layer
    types), or all global with sliding_window_pattern = 1, and Gemma 2 as local and global alternating; any other
    pattern is refused before a role starts."""
    local, full = "sliding_attention", "full_attention"

    def gemma3(name: str, **keys: object) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"],
                                                        "model_type": "gemma3_text", "sliding_window": 16, **keys}))
        (folder / "tokenizer.json").write_bytes((tiny_model_dir / "tokenizer.json").read_bytes())
        return folder

    def run(folder: Path) -> object:
        return load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(folder)})

    runs = [gemma3("real", num_hidden_layers=8, layer_types=[local] * 5 + [full] + [local] * 2),
            gemma3("derived", num_hidden_layers=12),  # no layer_types: transformers' default pattern of 6
            gemma3("global", num_hidden_layers=2, sliding_window_pattern=1, layer_types=[full, full])]
    for folder in runs:
        assert route(folder) == "converter"
        check_gguf_family(run(folder), folder)
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 16}
    (tmp_path / "gemma2").mkdir()
    (tmp_path / "gemma2" / "config.json").write_text(json.dumps({**gemma2, "num_hidden_layers": 4}))  # alternating
    assert route(tmp_path / "gemma2") == "converter"
    (tmp_path / "gemma2" / "config.json").write_text(json.dumps({**gemma2, "num_hidden_layers": 4,
                                                                 "layer_types": [local, local, local, full]}))
    with pytest.raises(GGUFExportError, match="^Gemma 2's GGUF runs in llama.cpp with one sliding_attention layer "
                                              "then one full_attention layer, repeated; this model's layer 1 of 4 is "
                                              "sliding_attention. Set snapshots.gguf = 'off'"):
        route(tmp_path / "gemma2")
    refused = [(gemma3("alternating", num_hidden_layers=2, layer_types=[local, full]), "layer 1 of 2 is full_attention"),
               (gemma3("pattern2", num_hidden_layers=4, sliding_window_pattern=2), "layer 1 of 4 is full_attention"),
               (gemma3("late", num_hidden_layers=7, layer_types=[local] * 7), "layer 5 of 7 is sliding_attention")]
    for folder, where in refused:
        with pytest.raises(PreflightError) as err:
            check_gguf_family(run(folder), folder)
        assert err.value.code == ExitCode.MODEL_INVALID
        assert "\n" not in err.value.message
        assert ("Gemma 3's GGUF runs in llama.cpp with five sliding_attention layers then one full_attention layer, "
                f"repeated (or every layer full_attention with sliding_window_pattern = 1); this model's {where}. "
                "Set snapshots.gguf = 'off'") in err.value.message, err.value.message


def test_lora_targets_that_name_no_linear_module_of_the_model_are_refused_at_start_up(tmp_path: Path) -> None:
    """Phi-3 fuses q, k and v into qkv_proj: a LoRA run with the default targets (q_proj, v_proj) would adapt
    nothing, and peft would say so only after the learner loaded the model. Start-up reads the weight names and
    refuses, naming the model's matrices."""
    import numpy as np
    from safetensors.numpy import save_file

    folder = tmp_path / "phi3"
    folder.mkdir()
    weights = {f"model.layers.0.{m}.weight": np.zeros((4, 4), np.float32)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    save_file({**weights, "model.embed_tokens.weight": np.zeros((8, 4), np.float32),
               "model.layers.0.input_layernorm.weight": np.zeros(4, np.float32)}, str(folder / "model.safetensors"))

    def run(**keys: object) -> object:
        return load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(folder), **keys})

    check_lora_targets(run(), folder)  # full weights: no targets
    check_lora_targets(run(**{"learner.lora_rank": 4, "learner.lora_targets": ["qkv_proj", "self_attn.o_proj"]}),
                       folder)
    with pytest.raises(PreflightError) as err:
        check_lora_targets(run(**{"learner.lora_rank": 4}), folder)
    assert err.value.code == ExitCode.MODEL_INVALID
    assert err.value.message == (f"model folder {folder}: learner.lora_targets q_proj, v_proj name no linear module of "
                                 f"this model; its matrices are down_proj, embed_tokens, gate_up_proj, o_proj, "
                                 f"qkv_proj: set learner.lora_targets to those to adapt (e.g. the attention "
                                 f"projections)")
    with pytest.raises(PreflightError, match="lora_targets input_layernorm name no linear module"):
        check_lora_targets(run(**{"learner.lora_rank": 4, "learner.lora_targets": ["qkv_proj", "input_layernorm"]}),
                           folder)
