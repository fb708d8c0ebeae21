"""completion_stats without gradients streams the logits from the last hidden states (shared.policy.
_streamed_stats) once a batch's [B, T, V] logits would be large: the verifier's numbers — logprobs, entropy,
variance, top logprob and keyed-sampler margins — must be the whole pass's to the bit, for plain and shared-prompt
passes, uneven and empty completions, several segments per completion and any temperature."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from shared import policy
from shared.policy import CompletionStats, completion_stats, load_model


def _batch(groups: int, group_size: int, seed: int) -> tuple[list[list[int]], list[list[int]], list[list[tuple[int, int, int, int]]]]:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    segments: list[list[tuple[int, int, int, int]]] = []
    for g in range(groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(2, 9))]
        for k in range(group_size):
            n = 0 if (g, k) == (1, 2) else rng.randrange(1, 12)
            comp = [rng.randrange(3, 250) for _ in range(n)]
            prompts.append(prompt)
            completions.append(comp)
            if k % 3 == 2 and n > 3:  # an episode-like completion: two keyed turns with an observation between
                segments.append([(1000 + g, k, 0, 2), (2000 + g, k, 3, n - 3)])
            else:
                segments.append([(1000 + g, k, 0, n)])
    return prompts, completions, segments


def _stats(model: torch.nn.Module, streamed: bool, monkeypatch: pytest.MonkeyPatch, **kw: object) -> CompletionStats:
    monkeypatch.setattr(policy, "LOGIT_ELEMENTS", 1 if streamed else 10**12)  # 64-row chunks, or the whole pass
    calls: list[int] = []
    real = policy._logit_rows

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(policy, "_logit_rows", counted)
    with torch.no_grad():
        out = completion_stats(model, **kw)  # type: ignore[arg-type]
    assert bool(calls) == streamed
    return out


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_streamed_logits_give_the_whole_pass_bits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  share_prompts: bool, temperature: float) -> None:
    model = load_model(tiny_model_dir).eval()
    prompts, completions, segments = _batch(groups=9, group_size=8, seed=int(temperature * 10) + share_prompts)
    kw = {"prompts": prompts, "completions": completions, "temperature": temperature, "pad_id": 0,
          "share_prompts": share_prompts, "segments": segments}
    whole = _stats(model, False, monkeypatch, **kw)
    streamed = _stats(model, True, monkeypatch, **kw)
    assert whole.margins is not None and streamed.margins is not None
    for name, a, b in zip(CompletionStats._fields, whole, streamed, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, (a - b).abs().max())
    assert float((whole.margins == 0).float().mean()) > 0.05  # honest-looking zeros and real margins both occur
    no_keys = _stats(model, True, monkeypatch, **(kw | {"segments": None}))
    assert no_keys.margins is None and torch.equal(no_keys.logprobs, whole.logprobs)


def test_small_batches_and_gradients_take_the_whole_pass(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_model_dir).eval()
    prompts, completions, segments = _batch(groups=1, group_size=4, seed=3)
    monkeypatch.setattr(policy, "_logit_rows", lambda *a: pytest.fail("streamed a small batch"))
    with torch.no_grad():
        completion_stats(model, prompts, completions, temperature=1.0, pad_id=0, segments=segments)
    monkeypatch.setattr(policy, "LOGIT_ELEMENTS", 1)
    prompts, completions, segments = _batch(groups=9, group_size=8, seed=3)
    out = completion_stats(model, prompts, completions, temperature=1.0, pad_id=0)  # grad on: the learner's use
    assert out.logprobs.requires_grad


def test_a_model_whose_logits_are_not_its_head_alone_is_not_streamed(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir).eval()
    assert policy.plain_head(model)
    capped = load_model(tiny_model_dir).eval()
    real_forward = capped.forward

    def soft_capped(*args: object, **kwargs: object) -> object:
        out = real_forward(*args, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0)
        return out

    capped.forward = soft_capped  # as Gemma 2 computes its logits
    assert not policy.plain_head(capped)


def test_the_same_bits_at_the_half_billion_models_width_and_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output layer's shape is what decides BLAS's kernels: Qwen2.5-0.5B's hidden width (896) and vocabulary
    (151,936), one layer, at the verifier's default chunk size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=1024, tie_word_embeddings=True, vocab_size=151_936)
    with torch.random.fork_rng():  # leaves the global generator as other tests found it
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(151_936) for _ in range(6)]] * 4 + [[rng.randrange(151_936) for _ in range(9)]] * 4
    completions = [[rng.randrange(151_936) for _ in range(16 if i != 5 else 11)] for i in range(8)]
    segments = [[(77, i, 0, len(c))] for i, c in enumerate(completions)]
    for share in (True, False):
        kw = {"prompts": prompts, "completions": completions, "temperature": 1.0, "pad_id": 0,
              "share_prompts": share, "segments": segments}
        monkeypatch.setattr(policy, "LOGIT_ELEMENTS", 10**12)
        with torch.no_grad():
            whole = completion_stats(model, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(policy, "LOGIT_ELEMENTS", 2**23)  # the default: 64-row chunks at this vocabulary
        with torch.no_grad():
            streamed = completion_stats(model, **kw)  # type: ignore[arg-type]
        for name, a, b in zip(CompletionStats._fields, whole, streamed, strict=True):
            assert torch.equal(a, b), (share, name, (a - b).abs().max())
