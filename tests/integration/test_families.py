"""GGUF beyond Qwen2 (issue 35): a version of another family goes through the exporter the learner calls — llama.cpp's
own converter, then its quantiser — and real llama.cpp loads each file and computes torch's logits within the
precision; llama.cpp tokenises as transformers does; a LoRA version's adapter.gguf (llama.cpp's own adapter converter)
applied by llama.cpp to base.gguf computes what a GGUF of the merged weights computes; an architecture no route writes
is refused at start-up in one line naming what is supported; on the learner's side, a step of the coordinator's
Learner on another family equals the same step on 2 FSDP ranks, and the version it publishes is rebuilt by torch and
llama.cpp clients from the previous one through its patches. Figures per family: bench/families.py,
docs/benchmarks.md "Model families"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.engine.family_models import BY_NAME, build_family_model
from coordinator.publish.gguf_export import route, write_model_ggufs
from shared.exit_codes import ExitCode

pytestmark = pytest.mark.slow

TEXTS = ["Hello world, it's 2026.", "  two  spaces\tand\nlines", "12345 digits", "naïve 日本語 🦙"]
# measured on these random models (bench/families.py, logits' std 0.8): f16 max |Δ| 0.006, q8_0 0.13
TOL = {"f16": 0.05, "q8_0": 0.5}


def _logits(path: Path, ids: list[int], lora: Path | None = None) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), lora_path=None if lora is None else str(lora), n_ctx=128,
                          n_batch=128, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_a_version_of_another_family_is_published_as_gguf_llama_cpp_runs_like_torch(tmp_path: Path,
                                                                                     name: str) -> None:
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from shared.policy import load_tokenizer

    family = BY_NAME[name]
    folder = build_family_model(family, tmp_path / name)
    load_tokenizer(folder).save_pretrained(str(folder))  # the tokenizer files as the learner publishes them
    assert route(folder) == "converter"
    write_model_ggufs(folder, {}, ("f16", "q8_0"))  # as the learner publishes a version: model.gguf + model.q8_0
    assert sorted(p.name for p in folder.glob("*.gguf")) == ["model.gguf", "model.q8_0.gguf"]
    assert not list(folder.glob("*.tmp"))

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = [tok.bos_token_id] if family.bos else []
    for text in TEXTS:
        ids += tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    for file, precision in (("model.gguf", "f16"), ("model.q8_0.gguf", "q8_0")):
        got = _logits(folder / file, ids)
        worst = float(np.abs(got - want).max())
        assert worst < TOL[precision], f"{name} {precision}: max |Δ logit| {worst:.3g}"
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9

    llm = llama_cpp.Llama(model_path=str(folder / "model.gguf"), n_ctx=64, vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text,
                                                                                        add_special_tokens=False)
    finally:
        llm.close()


# measured (bench/families.py, rank 4 on every linear module, the adapter moving the logits by ~1.6): llama.cpp's
# base.gguf + adapter.gguf vs a GGUF of the merged weights, f16, max |Δ| 0.003-0.006
LORA_TOL = 0.05


@pytest.mark.parametrize("name", ["llama3", "phi3", "gemma2", "gemma3"])
def test_a_lora_version_of_another_family_is_applied_by_llama_cpp_as_the_merged_weights(tmp_path: Path,
                                                                                        name: str) -> None:
    """A LoRA run of a converted family publishes base.gguf once and adapter.gguf per version, both through
    llama.cpp's own converters (Llama 3's q/k row permutation, Phi-3's fused qkv and gate/up, Gemma 3's layout);
    llama.cpp applying the adapter to the base matches llama.cpp on the merged weights (base + alpha/r · B·A, as
    torch clients and the verifier merge)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    from coordinator.config import LearnerConfig, ModelConfig
    from coordinator.engine.learner import Learner
    from coordinator.publish.gguf_export import export_folder
    from coordinator.publish.snapshots import SnapshotStore
    from shared import crypto
    from shared.adapters import read_adapter

    family = BY_NAME[name]
    folder = build_family_model(family, tmp_path / name)
    learner = Learner(folder, ModelConfig(device="cpu"), LearnerConfig(lora_rank=4, threads=2,
                                                                       lora_targets=list(family.linear)),
                      temperature=1.0, gguf="f16")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stand-in for training: peft starts B at 0
        for pname, p in learner.model.named_parameters():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    store = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run")
    store.publish(1, learner.snapshot_files(), 1.0)
    version, base = store.folder(1), store.base_dir
    assert {"base.gguf", "model.safetensors"} <= {p.name for p in base.iterdir()}
    assert "adapter.gguf" in {p.name for p in version.iterdir()}

    merged = tmp_path / "merged"  # the published base + the published adapter, merged as torch does
    merged.mkdir()
    for p in base.iterdir():
        if p.suffix in (".json", ".model") and not p.name.startswith("."):
            (merged / p.name).write_bytes(p.read_bytes())
    state = load_file(str(base / "model.safetensors"))
    adapter = read_adapter(version)
    assert len(adapter.factors) == len(family.linear) * int(learner.model.config.num_hidden_layers)
    for wname in adapter.factors:
        state[wname] = (state[wname].float() + adapter.delta(wname)).to(state[wname].dtype)
    save_file(state, str(merged / "model.safetensors"), metadata={"format": "pt"})
    export_folder(merged, tmp_path / "merged.gguf", "f16")

    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ids = ([tok.bos_token_id] if family.bos else []) + [i for t in TEXTS for i in tok.encode(
        t, add_special_tokens=False)]
    applied = _logits(base / "base.gguf", ids, lora=version / "adapter.gguf")
    want = _logits(tmp_path / "merged.gguf", ids)
    worst = float(np.abs(applied - want).max())
    assert worst < LORA_TOL, f"{name}: llama.cpp base + adapter vs merged, max |Δ logit| {worst:.3g}"
    assert float(np.abs(_logits(base / "base.gguf", ids) - want).max()) > 10 * LORA_TOL  # the adapter matters


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_a_learner_step_on_another_family_equals_two_fsdp_ranks_and_clients_rebuild_its_version_from_patches(
        tmp_path: Path, name: str) -> None:
    """Gemma 3 (tied head, sliding-window layers, (1 + w) norms) and Phi-3 (untied head, fused qkv and gate/up): the
    coordinator's Learner takes one on-policy GRPO step (bench/family_learner.py) while the same step runs as rank 0
    of 2 gloo FSDP ranks beside it; versions 0 and 1 are published by the SnapshotStore as a run publishes them
    (bf16 safetensors, f16 GGUF through llama.cpp's converter, lazy publication, patches). A torch client and a
    llama.cpp client holding version 0 fetch version 1 over HTTP through their own snapshot cache: each downloads
    only its file's patch and rebuilds the file the manifest names, byte for byte (sha256)."""
    import math

    from bench import family_learner as fl
    from coordinator.config import SnapshotConfig
    from coordinator.publish.snapshots import SnapshotStore
    from shared.hashing import sha256_file
    from shared.policy import load_tokenizer
    from swarm_client.backends.llama_backend import GGUF_FORMS
    from tests.integration.test_delta_snapshots import KEY, _entries, _fetch

    folder = build_family_model(BY_NAME[name], tmp_path / name)
    load_tokenizer(folder).save_pretrained(str(folder))  # the tokenizer files as the learner publishes them
    snap = SnapshotConfig()  # the run's defaults, as coordinator.run.runfiles makes the store
    store = SnapshotStore(tmp_path / "snapshots", KEY, "run", anchor_every=snap.anchor_every,
                          lag_tolerance=snap.lag_tolerance, lag_cap=snap.lag_steps * fl.LR)
    ranks = fl.start_ranks(tmp_path / "ranks", folder)
    try:
        one = fl.step_and_publish(folder, store, tmp_path / "single")
    finally:
        two = fl.finish(ranks, tmp_path / "ranks")

    # the step: a finite loss and a real gradient; AdamW's first step moves nearly every weight, each by at most ~lr
    assert math.isfinite(one["loss"]) and math.isfinite(one["grad_norm"]) and one["grad_norm"] > 0.1
    base, after = fl.weights(folder), fl.weights(tmp_path / "single" / fl.FULL)
    largest, share = fl.moved({k: base[k] for k in after}, after)
    assert share > 0.5 and 0.5 * fl.LR < largest < 1.1 * fl.LR, (largest, share)

    # 2 FSDP ranks: the same loss and grad norm (a model computed otherwise on one device — Gemma's embedding once
    # unscaled there, coordinator.engine.tied — was 10 % off), the same weights to float rounding: the ranks sum the
    # gradient in another order, and where a gradient element nearly cancels to AdamW's eps its step lr·g/(|g| + eps)
    # moves with g's last bits (bench/families.py --learner: up to 2.7e-6 of a 1e-5 step, Phi-3), on a few elements
    ranked = fl.weights(tmp_path / "ranks" / fl.FULL)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4, abs=1e-6)
    assert fl.max_diff(after, ranked) < fl.LR
    off = sum(int(((after[k] - ranked[k]).abs() > 0.01 * fl.LR).sum()) for k in after)
    assert off < 1e-3 * sum(v.numel() for v in after.values()), off

    # deltas: each client holding version 0 downloads only its file's patch and rebuilds version 1's file
    entries = _entries(store, 1)
    for forms, file in ((frozenset({"hf"}), "model.safetensors"), (GGUF_FORMS, "model.gguf")):
        patch = entries[file + ".delta"]
        assert patch.result_sha256 == entries[file].sha256 and patch.size < entries[file].size / 10
        cache, folders, downloaded = _fetch(store, tmp_path / f"home-{file}", [0, 1], forms=forms)
        assert sha256_file(folders[1] / file) == entries[file].sha256, file
        assert sha256_file(folders[0] / file) != entries[file].sha256  # the step changed the published file
        assert (cache.patches.patched, cache.patches.patches_refused) == (1, 0), file
        assert downloaded[1] == patch.size, file  # the other files of version 1 are version 0's, cached


def test_a_sentencepiece_model_tokenises_and_detokenises_alike_in_sentencepiece_transformers_and_llama_cpp(
        tmp_path: Path) -> None:
    """Gemma 2's tokenizer is a real SentencePiece model (trained here by the sentencepiece trainer): transformers
    builds its tokenizer from tokenizer.model, llama.cpp's converter writes the vocabulary from the same file, and
    all three give the same ids and the same text back on texts none of which was in the training corpus."""
    import ctypes

    import llama_cpp
    import sentencepiece as spm

    from coordinator.engine.family_models import SENTENCEPIECE_MODEL, build_family_tokenizer
    from coordinator.publish.gguf_export import export_folder

    family = BY_NAME["gemma2"]
    folder = build_family_model(family, tmp_path / "gemma2")
    sp = spm.SentencePieceProcessor(model_proto=(folder / SENTENCEPIECE_MODEL).read_bytes())
    tok = build_family_tokenizer(family)
    export_folder(folder, tmp_path / "gemma2.gguf", "f16")
    texts = [*TEXTS, "tab\tand\r\nCRLF", "   leading and trailing   ", "x = [1, 2, 3]  # list", "Ελληνικά", ""]
    llm = llama_cpp.Llama(model_path=str(tmp_path / "gemma2.gguf"), n_ctx=64, vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        for text in texts:
            ids = sp.encode(text)
            assert tok.encode(text, add_special_tokens=False) == ids, text
            assert (llm.tokenize(text.encode(), add_bos=False, special=False) if text else []) == ids, text
            arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
            buf = ctypes.create_string_buffer(64 + 16 * len(ids))
            n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, len(buf), False, False)
            assert buf.raw[:max(0, n)].decode() == tok.decode(ids) == sp.decode(ids) == text, text
    finally:
        llm.close()


def _refused_at_start_up(folder: Path, tmp_path: Path) -> str:
    """The coordinator started on ``folder``: exit 11 (model invalid) before any role starts, nothing on stdout, no
    run directory, one line on stderr (returned)."""
    res = subprocess.run([sys.executable, "-m", "echo_swarm", "coordinator", "--model", str(folder), "--run-dir",
                          str(tmp_path / "run"), "--port", "0"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert (res.returncode, res.stdout) == (ExitCode.MODEL_INVALID, ""), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "run").exists()
    return res.stderr


def test_an_architecture_no_route_writes_is_refused_at_start_up_in_one_line(tmp_path: Path) -> None:
    """GPT-2 is a causal LM torch trains, but neither the exporter nor the families list writes it: the coordinator
    exits 11 (model invalid) before any role starts, with one line naming the supported families and the way out."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from coordinator.engine.tiny_model import build_tokenizer

    folder = tmp_path / "gpt2"
    tok = build_tokenizer()
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    stderr = _refused_at_start_up(folder, tmp_path)
    assert stderr.startswith(f"error: model folder {folder}: GGUF export supports Qwen2ForCausalLM (Qwen2, Qwen2.5), "
                             f"LlamaForCausalLM (Llama 2, Llama 3.x, SmolLM2), Qwen3ForCausalLM (Qwen3), "
                             f"Gemma2ForCausalLM (Gemma 2), Gemma3ForCausalLM (Gemma 3), MistralForCausalLM "
                             f"(Mistral), Phi3ForCausalLM (Phi-3, Phi-4), Olmo2ForCausalLM (OLMo 2); this model "
                             f"is GPT2LMHeadModel. Set snapshots.gguf = 'off'"), stderr


def test_a_gemma3_whose_layer_pattern_llama_cpp_does_not_run_is_refused_at_start_up(tmp_path: Path) -> None:
    """A real Gemma 3 folder with two layers, local then global: llama.cpp's converter would write it without
    complaint and llama.cpp would run both layers as local (its assumed pattern is five local, one global), so the
    coordinator exits 11 before any role starts, in one line naming the pattern llama.cpp runs."""
    import dataclasses


    family = dataclasses.replace(BY_NAME["gemma3"], config={**BY_NAME["gemma3"].config, "num_hidden_layers": 2,
                                                            "layer_types": ["sliding_attention", "full_attention"]})
    folder = build_family_model(family, tmp_path / "gemma3")
    stderr = _refused_at_start_up(folder, tmp_path)
    assert stderr.startswith(f"error: model folder {folder}: Gemma 3's GGUF runs in llama.cpp with five "
                             f"sliding_attention layers then one full_attention layer, repeated"), stderr
    assert "this model's layer 1 of 2 is full_attention" in stderr
