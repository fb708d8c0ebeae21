"""GGUF export of each supported architecture, loaded in real llama.cpp and compared with torch: greedy tokens
agree and the per-token logprobs agree within the tolerance measured by bench/llama_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.publish.gguf_export import GGUFExportError, export_folder, gguf_tensor_name, llama_permute

# f32 weights with an f32 KV cache are float-rounding exact (measured max 3e-6 nats); the f16 KV cache
# that llama.cpp uses by default adds up to ~2e-3 (../shared/notes/llama-cpp.md, docs/benchmarks.md). These
# random models have larger weights than a trained one (sharper distributions), so q8_0 errors are larger here
# (measured 0.11 max) than on the tiny model in docs/benchmarks.md.
TOL = {("f32", True): 1e-4, ("f32", False): 1e-2, ("f16", False): 2e-2, ("q8_0", False): 0.25}


def _random_model(folder: Path, arch: str) -> Path:
    """A tiny randomly initialised model of ``arch`` with the project's byte-level tokenizer, saved as an HF
    folder. Weights are scaled up so the next-token distributions are peaked (greedy decoding has no ties)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    tok = build_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                  initializer_range=0.2)
    torch.manual_seed(7)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False))
        with torch.no_grad():  # Qwen2 has q/k/v biases: make them non-zero so the export must carry them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0))
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return folder


def _torch_greedy_and_logprobs(folder: Path, prompt: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """torch's greedy tokens, their logprobs, and the top-1 − top-2 logprob margin at each step."""
    import torch

    from shared.policy import completion_logprobs, generate, load_model

    model = load_model(folder).eval()
    out = generate(model, [prompt], group_size=1, temperature=1.0, max_tokens=n, stop_ids=[10**6], seed=None,
                   pad_id=0)
    tokens = out[0].token_ids
    with torch.no_grad():
        lp, _ = completion_logprobs(model, [prompt], [tokens], temperature=1.0, pad_id=0)
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        top2 = torch.log_softmax(logits.float(), -1).topk(2, dim=-1).values
    return tokens, lp[0, : len(tokens)].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def _torch_parameters(folder: Path) -> int:
    from swarm_client.backends.torch_backend import TorchBackend

    backend = TorchBackend(device="cpu", threads=1)
    backend.load(folder)
    count = backend.parameters()
    assert count is not None
    return count


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(("precision", "kv_f32"), [("f32", True), ("f32", False), ("f16", False), ("q8_0", False)])
def test_export_matches_torch(tmp_path: Path, arch: str, precision: str, kv_f32: bool) -> None:
    from swarm_client.backends.llama_backend import LlamaBackend

    folder = _random_model(tmp_path / arch, arch)
    prompt = [81, 26, 32, 19, 21, 11, 20, 22, 29, 32, 33, 26, 32]  # "Q: 24+13= A:" as bytes
    n = 24
    want_tokens, want_lp, margins = _torch_greedy_and_logprobs(folder, prompt, n)

    gguf_dir = tmp_path / f"{arch}-{precision}"
    gguf_dir.mkdir()
    export_folder(folder, gguf_dir / "model.gguf", precision)
    backend = LlamaBackend(device="cpu", threads=1, n_ctx=256, kv_f32=kv_f32)  # one: see llama_verifier
    backend.load(gguf_dir)
    assert backend.backend_class == f"llama-{precision}"
    # what a turn on a shared machine costs per token (swarm_client/shares.py): the model's parameters, as torch counts
    assert backend.parameters() == _torch_parameters(folder)

    # greedy decoding in llama.cpp (temperature → 0 is argmax) reproduces torch's tokens ...
    backend.llm.reset()
    got_tokens = []
    for tok in backend.llm.generate(prompt, temp=0.0, reset=True):
        got_tokens.append(int(tok))
        if len(got_tokens) == n:
            break
    tol = TOL[(precision, kv_f32)]
    # teacher-forced logprobs of torch's tokens agree within the measured tolerance ...
    got_lp = backend.score(prompt, want_tokens)
    worst = max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True))
    assert worst < tol, f"{arch} {precision}: max |Δ logprob| {worst:.2e} ≥ {tol}"
    # ... and the greedy tokens agree up to the first step where torch's top two are closer than that error
    # can resolve (a random model has near-ties; rounding may then legitimately pick the other one)
    decided = next((k for k, m in enumerate(margins) if m < 4 * worst + 1e-4), n)
    if precision != "q8_0":  # q8_0's error on these sharp random models exceeds most margins
        assert decided >= 8, f"random model too flat for the test: margins {margins[:8]}"
    assert got_tokens[:decided] == want_tokens[:decided]
    # a sampled rollout reports the logprobs of its own tokens under the same logits
    s = backend.sample(prompt, temperature=0.7, max_tokens=8, stop_ids=frozenset({256}), key=3, rollout=0)
    ref = backend.score(prompt, s.token_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)) < tol  # one-token vs batched evaluation


def test_permutation_is_a_row_reordering() -> None:
    import numpy as np

    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    p = llama_permute(w, n_head=2)
    assert sorted(map(tuple, p.tolist())) == sorted(map(tuple, w.tolist()))
    assert not np.array_equal(p, w)
    # head 0 rows [0,1,2,3] (halves [0,1] and [2,3]) interleave to [0,2,1,3]
    assert p[:4, 0].tolist() == [0.0, 6.0, 3.0, 9.0]


def test_names_and_refusals(tmp_path: Path) -> None:
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.bias") == "blk.3.attn_q.bias"
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    with pytest.raises(GGUFExportError, match="GGUF name"):
        gguf_tensor_name("model.layers.0.mlp.experts.weight")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(GGUFExportError, match="supports"):
        export_folder(tmp_path, tmp_path / "x.gguf")
