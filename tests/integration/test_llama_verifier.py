"""The verifier's llama.cpp recompute (coordinator.engine.llama_verifier) against a real llama.cpp client
(swarm_client.backends.llama_backend) on GGUF files from the project's exporter and llama.cpp's own quantiser:

- an honest client's every token is the keyed choice of the recompute (margin 0) and its reported logprobs are
  the recompute's, at every precision, k-quants included (a model whose rows are 256 wide): the verifier replays
  the client's evaluations, so the logits are the same bits;
- what a tolerance of CHOICE_TOL_LLAMA then refuses: a result generated from another precision's file (a q4_K_M
  client claiming the f16 job, class shopping) and torch's greedy decoding sent as a llama.cpp result.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import CHOICE_TOL_LLAMA
from coordinator.core.verify import check_choices, choice_stats
from coordinator.publish.gguf_export import export_folder
from shared.errors import ProtocolError
from shared.llama_files import gguf_precision
from shared.sampler import plain_segments

PROMPTS = [list(b"Q: 24+13= A:"), list(b"Q: 7+88= A:")]
GROUP = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 whose matrices have 256-wide rows (k-quants need a multiple of 256), scaled so its
    next-token distributions are peaked and sampled completions vary, with the project's byte tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    folder = tmp_path_factory.mktemp("wide")
    tok = build_tokenizer()
    torch.manual_seed(11)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, initializer_range=0.08,
        tie_word_embeddings=True, use_sliding_window=False))
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    return folder


def _gguf(model: Path, tmp: Path, precision: str) -> Path:
    folder = tmp / precision
    folder.mkdir(exist_ok=True)
    if not (folder / "model.gguf").exists():
        export_folder(model, folder / "model.gguf", precision)
    return folder


def _client(folder: Path) -> object:
    from swarm_client.backends.llama_backend import LlamaBackend

    backend = LlamaBackend(device="cpu", threads=1, n_ctx=256)  # see _recompute
    backend.load(folder)
    return backend


def _results(backend: object, keys: range, temperature: float) -> list[tuple[list[list[int]], list[list[int]],
                                                                        list[list[float]], int]]:
    """Per key, one job's result as the client makes it: (prompts per completion, completions, logprobs, key)."""
    out = []
    for key in keys:
        prompts, comps, lps = [], [], []
        for i, p in enumerate(PROMPTS):
            for g in range(GROUP):
                s = backend.sample(p, temperature=temperature, max_tokens=MAX_TOKENS,  # type: ignore[attr-defined]
                                   stop_ids=frozenset({256}), key=key, rollout=i * GROUP + g, fresh=g == 0)
                prompts.append(p)
                comps.append(s.token_ids)
                lps.append(s.logprobs)
        out.append((prompts, comps, lps, key))
    return out


def _recompute(folder: Path, temperature: float):  # type: ignore[no-untyped-def]
    from coordinator.engine.llama_verifier import LlamaRecompute

    # one thread, like the client: ggml's workers meet at spinning barriers, and on a busy two-core machine (CI's
    # other worker running three processes) a two-thread llama.cpp ran these tests ~100x slower (400 s, not 4 s)
    return LlamaRecompute(lambda _v: folder, temperature=temperature, threads=1)


@pytest.mark.parametrize("precision", ["f16", "q8_0", "q6_K", "q5_K_M", "q4_K_M", "q4_0"])
def test_an_honest_client_is_its_own_precision_recompute(wide_model: Path, tmp_path: Path, precision: str) -> None:
    folder = _gguf(wide_model, tmp_path, precision)
    assert gguf_precision(folder / "model.gguf") == precision  # what llama.cpp's quantiser wrote
    temperature = 0.7
    recompute = _recompute(folder, temperature)
    worst_margin = worst_lp = 0.0
    tokens = 0
    for prompts, comps, lps, key in _results(_client(folder), range(1, 9), temperature):
        stats = recompute.recompute_stats(0, prompts, comps, plain_segments(key, [len(c) for c in comps]), GROUP)
        assert stats.margins is not None
        for margins, reported, recomputed in zip(stats.margins, lps, stats.logprobs, strict=True):
            assert len(margins) == len(reported) == len(recomputed)
            tokens += len(margins)
            worst_margin = max(worst_margin, *margins)
            worst_lp = max(worst_lp, *(abs(a - b) for a, b in zip(reported, recomputed, strict=True)))
    assert tokens > 100
    # the same file, the same evaluations (the verifier replays the client's schedule): the same logits, bit for
    # bit — a teacher-forced batch instead gave margins up to 0.05 and logprob gaps up to 0.1 on this model
    assert worst_margin == 0.0, worst_margin
    assert worst_lp < 1e-5, worst_lp  # the client's float32/float64 log-softmax against torch's float32


def test_another_precisions_tokens_and_torch_greedy_are_refused(wide_model: Path, tmp_path: Path) -> None:
    """Class shopping: results from the q4_K_M file sent for the f16 file's job, and torch's greedy decoding sent
    as a llama.cpp result, are refused by the keyed choice check at the llama.cpp classes' tolerance."""
    import torch

    from shared.policy import generate, load_model

    f16 = _gguf(wide_model, tmp_path, "f16")
    q4 = _gguf(wide_model, tmp_path, "q4_K_M")
    recompute = _recompute(f16, 1.0)

    def refused(prompts: list[list[int]], comps: list[list[int]], key: int) -> bool:
        stats = recompute.recompute_stats(0, prompts, comps, plain_segments(key, [len(c) for c in comps]), GROUP)
        assert stats.margins is not None
        try:
            check_choices(choice_stats(stats.margins), CHOICE_TOL_LLAMA)
        except ProtocolError as exc:
            assert exc.reason.value == "choice_mismatch"
            return True
        return False

    keys = range(100, 116)
    honest = {key: comps for _p, comps, _l, key in _results(_client(f16), keys, 1.0)}
    shopped = [(p, comps, key) for p, comps, _l, key in _results(_client(q4), keys, 1.0) if comps != honest[key]]
    assert len(shopped) >= 8, "the two precisions sampled the same tokens for most jobs: the model is too flat"
    assert all(refused(p, comps, key) for p, comps, key in shopped)

    model = load_model(wide_model).eval()
    flat = [p for p in PROMPTS for _ in range(GROUP)]
    with torch.no_grad():
        greedy = [s.token_ids for s in generate(model, PROMPTS, group_size=GROUP, temperature=1.0,
                                                max_tokens=MAX_TOKENS, stop_ids=[256], seed=None, pad_id=256)]
    differing = [key for key in keys if greedy != honest[key]]
    assert differing and all(refused(flat, greedy, key) for key in differing)


def test_the_clients_samples_do_not_depend_on_where_its_logit_buffer_is_flushed(
        wide_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaBackend.sample log-softmaxes its buffered logit rows whenever the buffer is full (every 6 tokens at a
    152 k vocabulary; this model's completions fit in one buffer): a buffer of 3 rows must give the very tokens and
    logprobs, bit for bit, of one that holds a whole completion."""
    from swarm_client.backends import llama_backend

    folder = _gguf(wide_model, tmp_path, "q8_0")
    whole = _results(_client(folder), range(1, 4), 0.7)
    client = _client(folder)
    monkeypatch.setattr(llama_backend, "LOGIT_BUFFER_BYTES", 3 * 4 * client.llm.n_vocab())  # type: ignore[attr-defined]
    flushed = _results(client, range(1, 4), 0.7)
    assert client._rows is not None and len(client._rows) == 3  # type: ignore[attr-defined]
    assert max(len(c) for _p, comps, _l, _k in flushed for c in comps) > 3  # the buffer was flushed mid-completion
    assert flushed == whole
