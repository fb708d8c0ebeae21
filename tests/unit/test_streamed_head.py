"""The learner's streamed output layer (coordinator.engine.head): its logprobs and every parameter's gradient equal
the plain pass's (shared.policy.completion_logprobs) up to float rounding — tied and untied output layers, with the
learner's in-place tied-embedding hooks, plain and shared-prompt passes, uneven and empty completions, any
temperature, the vocabulary cut into many slices — and the learner takes it wherever its head is plain."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine import head
from coordinator.engine.head import streamed_logprobs
from coordinator.engine.learner import Learner
from coordinator.engine.tied import TiedEmbeddingGradient, lookup_scale
from shared.policy import completion_logprobs, load_model


def _batch(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    for g in range(3):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 7))]
        for k in range(4):
            n = 0 if (g, k) == (1, 2) else rng.randrange(1, 9)
            prompts.append(prompt)
            completions.append([rng.randrange(3, 250) for _ in range(n)])
    return prompts, completions


def _untied(folder: Path) -> torch.nn.Module:
    """The tiny model with an output layer of its own (a copy of the embedding, then trained apart)."""
    model = load_model(folder)
    model.config.tie_word_embeddings = False
    out = model.get_output_embeddings()
    out.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone() * 1.5)
    return model


def _run(model: torch.nn.Module, streamed: bool, weights: torch.Tensor, **kw: object
         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    fn = streamed_logprobs if streamed else completion_logprobs
    logp, mask = fn(model, **kw)  # type: ignore[operator]
    ((logp * mask) * weights[: logp.shape[0], : logp.shape[1]]).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), mask, grads


@pytest.mark.parametrize(("tied", "hooks"), [(True, False), (True, True), (False, False)],
                         ids=["tied", "tied-in-place-hooks", "untied"])
@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_streamed_logprobs_and_gradients_are_the_plain_pass(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                           tied: bool, hooks: bool, share_prompts: bool,
                                                           temperature: float) -> None:
    torch.manual_seed(0)
    model = load_model(tiny_model_dir) if tied else _untied(tiny_model_dir)
    model.train()
    tied_hooks = TiedEmbeddingGradient(model.get_input_embeddings(), model.get_output_embeddings()) if hooks else None
    monkeypatch.setattr(head, "MIN_SLICE", 16)
    monkeypatch.setattr(head, "LOGIT_ELEMENTS", 16 * 40)  # 16 vocabulary entries per slice: 17 slices of 257
    slices: list[int] = []
    real = head._slice_width
    monkeypatch.setattr(head, "_slice_width", lambda *a: slices.append(real(*a)) or real(*a))
    prompts, completions = _batch(int(temperature * 10) + 2 * share_prompts)
    kw = {"prompts": prompts, "completions": completions, "temperature": temperature, "pad_id": 0,
          "share_prompts": share_prompts}
    weights = torch.randn(len(completions), 16)
    lp_plain, mask_plain, g_plain = _run(model, False, weights, **kw)
    lp_ours, mask_ours, g_ours = _run(model, True, weights, **kw)
    assert slices and slices[0] == 16
    assert torch.equal(mask_plain, mask_ours) and mask_ours.dtype == torch.float32
    real_tokens = mask_ours.bool()
    assert torch.allclose(lp_ours[real_tokens], lp_plain[real_tokens], atol=2e-5, rtol=0)
    assert bool((lp_ours[~real_tokens] == 0).all())
    assert g_ours.keys() == g_plain.keys()
    assert ("lm_head.weight" in g_ours) == (not tied) and "model.embed_tokens.weight" in g_ours
    for name, grad in g_plain.items():
        scale = float(grad.abs().max()) or 1.0
        assert float((g_ours[name] - grad).abs().max()) <= 1e-4 * scale, name
    if tied_hooks is not None:
        tied_hooks.remove()


def _gemma3() -> Any:
    """A small Gemma 3 with a tied embedding, which scales its rows by √hidden (here 8)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                           tie_word_embeddings=True, pad_token_id=0)
    return Gemma3ForCausalLM(cfg).train()


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_a_scaled_tied_embedding_is_hooked_with_its_scale(share_prompts: bool, streamed: bool) -> None:
    """Gemma's lookup multiplies its rows by √hidden: with the in-place hooks on, the pass computes the model's own
    logprobs and gradients. (The hook once returned the plain rows: the one-device learner trained Gemma 2 and 3
    without their embedding scale, 10 % off in the gradient's norm from the same step on FSDP ranks.)"""
    model = _gemma3()
    lookup, output = model.get_input_embeddings(), model.get_output_embeddings()
    scale = lookup_scale(lookup)
    assert scale is not None and float(scale) == pytest.approx(8.0)
    prompts, completions = _batch(3)
    kw = {"prompts": prompts, "completions": completions, "temperature": 1.0, "pad_id": 0,
          "share_prompts": share_prompts}
    weights = torch.randn(len(completions), 16)
    lp_plain, _, g_plain = _run(model, streamed, weights, **kw)
    hooks = TiedEmbeddingGradient(lookup, output)
    try:
        lp_ours, _, g_ours = _run(model, streamed, weights, **kw)
    finally:
        hooks.remove()
    assert torch.allclose(lp_ours, lp_plain, atol=1e-6, rtol=0)
    assert g_ours.keys() == g_plain.keys()
    for name, grad in g_plain.items():
        assert float((g_ours[name] - grad).abs().max()) <= 1e-5 * (float(grad.abs().max()) or 1.0), name


def test_an_embedding_that_is_not_a_row_lookup_is_left_to_autograd(tiny_model_dir: Path) -> None:
    """An input embedding whose output is not its weight's rows times a factor cannot be recomputed by the hook:
    lookup_scale says so, and the learner's passes put no hooks on it."""
    from coordinator.engine.passes import TokenPasses

    class Shifted(torch.nn.Embedding):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) + 0.5

    model = load_model(tiny_model_dir)
    plain = model.get_input_embeddings()
    assert lookup_scale(plain) is not None and float(lookup_scale(plain)) == 1.0  # type: ignore[arg-type]
    shifted = Shifted(plain.num_embeddings, plain.embedding_dim, plain.padding_idx)
    shifted.weight = plain.weight
    model.set_input_embeddings(shifted)
    assert lookup_scale(shifted) is None
    with pytest.raises(ValueError, match="left to autograd"):
        TiedEmbeddingGradient(shifted, model.get_output_embeddings())
    passes = TokenPasses(model, ranks=None, lora=False, temperature=1.0, pad_id=0, share_prompts=True)
    assert passes.tied is None


def test_bf16_gradients_round_as_the_plain_pass(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16 the output weight's gradient is rounded once per element, as the plain pass's (within two
    bfloat16 steps of the float32 reference wherever the plain pass is), and the hidden states' in float32."""
    torch.manual_seed(0)
    monkeypatch.setattr(head, "MIN_SLICE", 16)
    monkeypatch.setattr(head, "LOGIT_ELEMENTS", 16 * 40)
    prompts, completions = _batch(5)
    kw = {"prompts": prompts, "completions": completions, "temperature": 1.0, "pad_id": 0, "share_prompts": False}
    weights = torch.randn(len(completions), 16)
    ref = load_model(tiny_model_dir)
    _, _, g_ref = _run(ref, False, weights, **kw)
    model = load_model(tiny_model_dir, dtype="bfloat16")
    _, _, g_plain = _run(model, False, weights, **kw)
    _, _, g_ours = _run(model, True, weights, **kw)
    for name, grad in g_ref.items():
        err_plain = float((g_plain[name].float() - grad).abs().max())
        err_ours = float((g_ours[name].float() - grad).abs().max())
        assert g_ours[name].dtype == torch.bfloat16
        assert err_ours <= 2 * err_plain + 1e-3 * float(grad.abs().max()), (name, err_ours, err_plain)


def test_the_learner_streams_its_head_where_it_is_plain(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = Learner(tiny_model_dir, ModelConfig(device="cpu"), LearnerConfig(lr=1e-3, threads=1), temperature=1.0)
    assert learner.passes.stream_head
    calls: list[int] = []
    real = head._slice_width
    monkeypatch.setattr(head, "_slice_width", lambda *a: calls.append(1) or real(*a))
    from coordinator.engine.learner import Sample

    prompts, completions = _batch(9)
    samples = [Sample(p, c, [-1.0] * len(c), [-1.0] * len(c), advantage=1.0 if i % 2 else -1.0)
               for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
    stats = learner.train_step(samples)
    assert calls and stats["grad_norm"] > 0
    lora = Learner(tiny_model_dir, ModelConfig(device="cpu"), LearnerConfig(lr=1e-3, threads=1, lora_rank=4),
                   temperature=1.0)
    assert not lora.passes.stream_head
