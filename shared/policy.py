"""The policy as both sides compute it: loading a Hugging Face model folder, sampling with per-token
behaviour logprobs, and recomputing those logprobs for training and verification.

The behaviour logprob of a token is ``log_softmax(logits / temperature)[token]`` — the exact distribution it
was sampled from (no top-k/top-p truncation). The learner's recompute uses the same definition, so an honest
torch client and the learner agree to float rounding. torch and transformers are imported lazily.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from shared.messages import Completion
from shared.sampler import KeyedRows, Segment, choose_torch, margins_of_rows, margins_torch, row_keys

if TYPE_CHECKING:
    import torch


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"

    def to_completion(self) -> Completion:
        """The wire form. Float rounding can leave a certain token's logprob a hair above 0; the protocol
        bounds logprobs at ≤ 0 (plus a tiny margin), so clamp."""
        return Completion(token_ids=self.token_ids, logprobs=[min(0.0, x) for x in self.logprobs],
                          finish_reason="stop" if self.finish_reason == "stop" else "length")


def pick_device(requested: str = "auto") -> str:
    import torch

    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def load_tokenizer(folder: Path) -> Any:
    """Load the folder's tokenizer. A folder whose tokenizer_config names PreTrainedTokenizerFast is loaded
    with exactly that class: AutoTokenizer would substitute the architecture's own tokenizer class and its
    pre-tokenizer for a model_type such as qwen2, silently changing tokenisation."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_path = Path(folder) / "tokenizer_config.json"
    with LOAD_LOCK:
        if cfg_path.exists() and json.loads(cfg_path.read_text()).get("tokenizer_class") == "PreTrainedTokenizerFast":
            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        return AutoTokenizer.from_pretrained(str(folder))


#: One model or tokenizer load at a time per process: transformers' loading is not thread-safe (a model loaded
#: while another thread loads one can keep parameters on the meta device), and a coordinator role's verifier and
#: evaluator threads, or a test beside an in-process coordinator, load concurrently.
LOAD_LOCK = threading.RLock()


def import_backends() -> None:
    """Import torch and the transformers classes this module uses, on the calling thread, before a process starts
    threads that load models: transformers' lazy module is not safe to import from two threads at once (one of
    them gets "cannot import name 'AutoModelForCausalLM'"), as a verifier role's verifier and evaluator threads
    would otherwise do. Also the machinery under every model class (transformers.modeling_utils: seconds of
    imports), so a process that calls this early — a client starting, a verifier waiting for version 0 — does not
    pay for it when its first model is needed."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401


def load_model(folder: Path, device: str = "cpu", dtype: str = "float32", *, own_memory: bool = False) -> Any:
    """Load a Hugging Face model folder. ``own_memory``: make sure no weight stays a memory map of the folder's
    safetensors (a float32 file loaded as float32 on the CPU is mapped, since no conversion copies it); a
    long-lived reader of files that something else may rewrite or truncate (the coordinator's verifier and
    evaluator) would otherwise die of SIGBUS reading the mapping. Costs a copy only where one is needed."""
    import itertools

    import torch
    from transformers import AutoModelForCausalLM

    with LOAD_LOCK:  # from_pretrained builds on the meta device: two threads at once leave weights on it
        model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
        model = model.to(device)
    if own_memory:
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                if t.device.type == "cpu":
                    t.data = t.data.clone()
    return model


def stop_token_ids(tokenizer: Any) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


def _cache_kwarg(model: Any) -> str:
    """transformers ≥ 5.x names the KV cache ``cache``; earlier releases ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_only(model: Any) -> dict[str, Any]:
    """Ask the prefill for the last position's logits only, where the model supports it: the full
    [sequences × prompt length × vocabulary] tensor is the largest allocation of a generation (about 1 GB for eight
    200-token prompts over Qwen's 152 k vocabulary) and sampling reads only its last row."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


class Decoder:
    """How a client evaluates a batch of contexts, one implementation for sampling (:func:`generate`) and its replay
    by the verifier (:func:`replay_stats`): every context left-padded and evaluated in one batch (the prefill, the
    last position's logits only), then one token per row at a time on the KV cache.

    Why one: in bfloat16 the logits depend on that schedule, not only on the tokens. A batched teacher-forced pass
    (:func:`completion_stats`) rounds differently from one-token decoding, and the batch's rows and width change the
    kernels too: measured on the tiny model, a bf16 client's keyed choices were off the teacher-forced bf16
    recompute's by up to 0.047 logit and its logprobs by 0.11 nats; replayed with this schedule (same rows, same
    padding, same steps), margins and logprobs were the client's to the bit (docs/benchmarks.md, "torch clients
    computing in bf16")."""

    def __init__(self, model: Any, seqs: Sequence[Sequence[int]], pad_id: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._mask: torch.Tensor
        ids, self._mask = _left_pad(seqs, pad_id, str(self.device))
        self._positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        self._cache_kw = _cache_kwarg(model)
        self._out = model(input_ids=ids, attention_mask=self._mask, position_ids=self._positions, use_cache=True,
                          **_last_logits_only(model))

    def logits(self) -> torch.Tensor:
        """The float32 logits [rows, V] that predict each row's next token."""
        return self._out.logits[:, -1, :].float()

    def step(self, nxt: torch.Tensor) -> None:
        """Evaluate one more token per row (``nxt`` [rows])."""
        import torch

        ones = torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        self._positions = self._positions[:, -1:] + 1
        self._out = self.model(input_ids=nxt[:, None], attention_mask=self._mask, position_ids=self._positions,
                               use_cache=True, **{self._cache_kw: _cache_of(self._out)})


def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    temperature: float,
    max_tokens: int,
    stop_ids: Sequence[int],
    seed: int | None,
    pad_id: int,
    should_stop: Callable[[], bool] | None = None,
) -> list[Sampled]:
    """Sample ``group_size`` completions per prompt in one batch (prompt-major order).

    ``seed=None`` means greedy decoding (used for evaluation). Otherwise ``seed`` is the job's sampling key and
    each token is the keyed Gumbel-max choice (shared.sampler) of rollout ``i·group_size + g`` at its position —
    the same choice a llama.cpp client or another device makes from the same logits, and the one the verifier
    checks. Returns early with what it has if ``should_stop()`` becomes true (the caller
    then discards the partial job).
    """
    import torch

    seqs = [list(p) for p in prompts for _ in range(group_size)]
    n = len(seqs)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    with torch.inference_mode():
        decoder = Decoder(model, seqs, pad_id)
        device = decoder.device
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        words, rollouts = row_keys([(int(seed or 0), r) for r in range(n)], device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        stopped = torch.zeros(n, dtype=torch.bool, device=device)
        for position in range(max_tokens):
            logits = decoder.logits()
            if seed is None:
                nxt = logits.argmax(-1)
                lp = torch.log_softmax(logits, -1).gather(1, nxt[:, None]).squeeze(1)
            else:
                logp = torch.log_softmax(logits / temperature, -1)
                nxt = choose_torch(logits, temperature, words, rollouts, position)
                lp = logp.gather(1, nxt[:, None]).squeeze(1)
            nxt_list, lp_list, done_list = nxt.tolist(), lp.tolist(), done.tolist()
            for i in range(n):
                if not done_list[i]:
                    tokens[i].append(nxt_list[i])
                    logprobs[i].append(lp_list[i])
            hit = torch.isin(nxt, stop) & ~done
            stopped |= hit
            done |= hit
            if bool(done.all()) or (should_stop is not None and should_stop()):
                break
            decoder.step(nxt)
    stopped_list = stopped.tolist()
    return [
        Sampled(tokens[i], logprobs[i], "stop" if stopped_list[i] else "length") for i in range(n)
    ]


def _right_pad(completions: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Completions as [B, T] ids and mask, padded on the right (T ≥ 1, so an all-empty batch still has a column)."""
    import torch

    width = max(1, max(len(c) for c in completions))
    c_ids = torch.full((len(completions), width), pad_id, dtype=torch.long, device=device)
    c_mask = torch.zeros((len(completions), width), dtype=torch.long, device=device)
    for i, c in enumerate(completions):
        if c:
            c_ids[i, : len(c)] = torch.tensor(list(c), dtype=torch.long, device=device)
            c_mask[i, : len(c)] = 1
    return c_ids, c_mask


def _completion_logits(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tempered logits that predict each completion token, with the token ids and the mask, all [B, T, ·].

    One forward pass over prompt + completion; prompts are left-padded so every completion starts at the same
    column. Shared by :func:`completion_logprobs` and :func:`completion_stats` so both read the same numbers.
    """
    import torch

    device = next(model.parameters()).device
    p_ids, p_mask = _left_pad(prompts, pad_id, str(device))
    c_ids, c_mask = _right_pad(completions, pad_id, device)
    width = c_ids.shape[1]
    ids = torch.cat([p_ids, c_ids], dim=1)
    mask = torch.cat([p_mask, c_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    start = p_ids.shape[1] - 1
    return logits[:, start : start + width, :].float() / temperature, c_ids, c_mask


def _prefill_once(model: Any, prompts: Sequence[Sequence[int]], pad_id: int, device: Any
                  ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each distinct prompt through the model once, keeping its cache: (the output, each completion's row in it,
    the prompts' attention mask, their positions)."""
    import torch

    index: dict[tuple[int, ...], int] = {}
    rows = [index.setdefault(tuple(p), len(index)) for p in prompts]
    p_ids, p_mask = _left_pad(list(index), pad_id, str(device))
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                **_last_logits_only(model))
    return out, torch.tensor(rows, dtype=torch.long, device=device), p_mask, p_pos


def _continuation(out: Any, sel: torch.Tensor, p_mask: torch.Tensor, p_pos: torch.Tensor, c_mask: torch.Tensor,
                  width: int, device: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The prompts' cache copied to every completion's row, and the mask and positions that continue it with the
    completions' tokens but their last (which predict the ones after them)."""
    import torch

    cache = _cache_of(out)
    cache.reorder_cache(sel)
    mask = torch.cat([p_mask[sel], c_mask[:, :-1]], dim=1)
    positions = p_pos[sel][:, -1:] + 1 + torch.arange(width - 1, device=device)[None, :]
    return cache, mask, positions


def _shared_prompt_logits(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_completion_logits` for completions that share prompts (a GRPO group: ``group_size`` completions
    of each prompt): each distinct prompt is run once, its KV cache copied to the rows that continue it, and the
    completions are run on that cache — as a client generated them (prefill, then the completion tokens). Why:
    a group of G repeats its prompt G times, so the plain pass spends most of its work on prompts whenever
    they are long against the completions; the logits are the same up to float rounding (a unit test bounds it).
    """
    import torch

    device = next(model.parameters()).device
    out, sel, p_mask, p_pos = _prefill_once(model, prompts, pad_id, device)
    first = out.logits[:, -1, :][sel]  # predicts each completion's first token
    c_ids, c_mask = _right_pad(completions, pad_id, device)
    width = c_ids.shape[1]
    logits = first[:, None, :]
    if width > 1:  # the completion's tokens but its last predict the ones after them
        cache, mask, positions = _continuation(out, sel, p_mask, p_pos, c_mask, width, device)
        rest = model(input_ids=c_ids[:, :-1], attention_mask=mask, position_ids=positions, use_cache=True,
                     **{_cache_kwarg(model): cache}).logits
        logits = torch.cat([logits, rest], dim=1)
    return logits.float() / temperature, c_ids, c_mask


def _logits(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], temperature: float,
            pad_id: int, share_prompts: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain pass, or each prompt once where ``share_prompts`` and some prompt repeats."""
    repeated = share_prompts and len({tuple(p) for p in prompts}) < len(prompts)
    return (_shared_prompt_logits if repeated else _completion_logits)(
        model, prompts, completions, temperature=temperature, pad_id=pad_id)


def completion_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each completion given its prompt, as (logprobs [B, T], mask [B, T]).

    Differentiable when called under grad mode (the learner's loss); wrap in no_grad to verify. Prompts are
    left-padded so every completion starts at the same column. ``share_prompts``: each distinct prompt runs once
    (:func:`_shared_prompt_logits`; gradients flow through its copied KV cache, so they are the plain pass's up to
    float rounding) — for a model that keeps a KV cache in training (not under activation checkpointing).
    """
    import torch

    logits, c_ids, c_mask = _logits(model, prompts, completions, temperature, pad_id, share_prompts)
    logp = torch.log_softmax(logits, -1).gather(2, c_ids[:, :, None]).squeeze(2)
    return logp, c_mask.to(logp.dtype)


# completion_stats expands the distribution for this many (sequence, position, vocabulary) entries at a time:
# 2**25 float32 values = 128 MiB per temporary, whatever the batch or the vocabulary
STATS_ELEMENTS = 2**25
#: Without gradients, completion_stats computes the logits themselves from the last hidden states this many
#: (position, vocabulary) entries at a time once the whole [completions × tokens × vocabulary] tensor would be at
#: least twice that: 2**23 float32 values = 32 MiB per temporary (at Qwen's 152 k vocabulary, [64 × 512 × V] would
#: be 20 GB, ten copies of the 0.5 B model) ...
LOGIT_ELEMENTS = 2**23
#: ... but for at least this many positions at once: a matrix product over so many rows takes the same BLAS path
#: as over all of them (for a handful of rows MKL picks other kernels, with other rounding), so the logits are the
#: unchunked pass's to the bit.
LOGIT_ROWS = 64


class CompletionStats(NamedTuple):
    """What :func:`completion_stats` computes, each [B, T]: the logprob of each token, the entropy H, surprisal
    variance V and largest logprob of the tempered distribution at its position, the mask, and — when the job's
    sampling key was given — each token's keyed-sampler margin (shared.sampler.margins_torch; None otherwise)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    variance: torch.Tensor
    top: torch.Tensor
    mask: torch.Tensor
    margins: torch.Tensor | None


def completion_stats(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
    share_prompts: bool = False,
    segments: Sequence[Sequence[Segment]] | None = None,
) -> CompletionStats:
    """:func:`completion_logprobs` plus, from the same forward pass, the entropy H, the variance of the
    surprisal V = E[(−log p)²] − H² and the largest logprob (of the likeliest token) of the tempered
    distribution at every completion position. A token is the likeliest exactly when its logprob equals
    top_logprob (both are read from the same tensor).

    Why: a token sampled honestly at the job's temperature has expected surprisal H and variance V at its
    position, so a result's summed surprisal can be compared with its summed entropy without a second sample
    (the sampling test, coordinator.core.verify.check_sampling). The logprobs are bit-identical to
    completion_logprobs'. No gradient flows into the entropy terms. The full [T, vocab] distribution is
    expanded STATS_ELEMENTS entries at a time, so the extra memory is bounded whatever the batch; without
    gradients, a batch whose logits would be large gets them LOGIT_ELEMENTS at a time from the last hidden states
    (:func:`_streamed_stats`), with the same bits.

    ``segments`` (per completion, which keyed draws its tokens are: shared.sampler.Segment): also each token's
    margin under the keyed sampler, from the same logits — the check of every token's choice. Tokens outside every
    segment get margins of 0.

    ``share_prompts``: run each distinct prompt once (:func:`_shared_prompt_logits`; the verifier's recompute of
    GRPO groups) — then equal to the plain pass up to float rounding, not bit for bit.
    """
    import torch

    if segments is not None and len(segments) != len(completions):
        raise ValueError(f"{len(segments)} segment lists for {len(completions)} completions")
    streamed = _streamed_stats(model, prompts, completions, temperature, pad_id, share_prompts, segments)
    if streamed is not None:
        return streamed
    logits, c_ids, c_mask = _logits(model, prompts, completions, temperature, pad_id, share_prompts)
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(2, c_ids[:, :, None]).squeeze(2)
    entropy, variance = entropy_variance(logp_all.detach())
    top = logp_all.detach().max(-1).values
    margins = None
    if segments is not None:
        # the logits are already tempered (float32 l/T, as a client computes them): the scores are l/T + G
        margins = margins_torch(logits, c_ids, 1.0, segments) * c_mask
    return CompletionStats(logp, entropy, variance, top, c_mask.to(logp.dtype), margins)


def replay_stats(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
    segments: Sequence[Sequence[Segment]] | None = None,
) -> CompletionStats:
    """:func:`completion_stats` computed as the client computed its logits: each of the client's generations
    replayed with :class:`Decoder` — the same rows in the same order, prefilled together, then fed the completions'
    tokens one at a time. For a model in half precision, whose logits depend on that schedule (Decoder's docstring);
    in float32 one teacher-forced pass already gives the client's bits, at a fraction of the cost.

    The generations follow from ``segments`` (each completion's keyed draws, shared.sampler.Segment): the draws of
    one key were one generation, whose row ``rollout`` continued ``prompt + completion[:offset]`` — a plain job's
    one batch of every completion, a multi-turn job's one batch per turn over the episodes then live
    (shared.envs.play.episode_segments). Without segments, the completions are one batch. A position no segment
    covers (an episode's observation tokens: never sampled, never trained) gets the statistics of uniform logits,
    as coordinator.engine.llama_verifier gives it. Statistics are computed a step at a time, so the memory is one
    step's [rows × vocabulary], whatever the completions' length."""
    import torch

    if segments is not None and len(segments) != len(completions):
        raise ValueError(f"{len(segments)} segment lists for {len(completions)} completions")
    keyed = segments is not None
    generations = _generations(completions, segments)
    device = next(model.parameters()).device
    c_ids, c_mask = _right_pad(completions, pad_id, device)
    vocab = int(model.config.vocab_size)
    flat = torch.zeros((1, vocab), dtype=torch.float32, device=device)  # uniform logits
    uniform = _step_stats(flat, temperature, flat.new_zeros(1, dtype=torch.long), None)
    out = [torch.full(c_ids.shape, float(v[0]), dtype=torch.float32, device=device) for v in uniform]
    with torch.inference_mode():
        for key, rows in generations.items():
            rows.sort()
            decoder = Decoder(model, [list(prompts[b]) + list(completions[b][:o]) for _r, b, o, _n in rows], pad_id)
            steps = max(n for *_, n in rows)
            for j in range(steps):
                live = [i for i, (*_, n) in enumerate(rows) if j < n]
                at = torch.tensor([rows[i][1] for i in live], dtype=torch.long, device=device)
                col = torch.tensor([rows[i][2] + j for i in live], dtype=torch.long, device=device)
                ids = c_ids[at, col]
                draw = None
                if keyed:
                    n_live = len(live)
                    words, rollouts = row_keys([(key, rows[i][0]) for i in live], device)
                    draw = KeyedRows(torch.arange(n_live, device=device), words, rollouts,
                                     torch.full((n_live,), j, dtype=torch.long, device=device))
                logits = decoder.logits()[torch.tensor(live, dtype=torch.long, device=device)]
                for dst, value in zip(out, _step_stats(logits, temperature, ids, draw), strict=True):
                    dst[at, col] = value
                if j + 1 < steps:  # rows already ended are fed padding: only their own later logits would change
                    feed = [completions[b][o + j] if j < n else pad_id for _r, b, o, n in rows]
                    decoder.step(torch.tensor(feed, dtype=torch.long, device=device))
    mask = c_mask.to(torch.float32)
    logp, entropy, variance, top, margins = out
    return CompletionStats(logp, entropy, variance, top, mask, margins * mask if keyed else None)


def _generations(completions: Sequence[Sequence[int]], segments: Sequence[Sequence[Segment]] | None
                 ) -> dict[int, list[tuple[int, int, int, int]]]:
    """The client's generations behind ``completions``: key → (rollout, completion, offset, count) per row it
    continued; without segments, one generation of every completion from its start."""
    draws = segments if segments is not None else [[(0, b, 0, len(c))] for b, c in enumerate(completions)]
    generations: dict[int, list[tuple[int, int, int, int]]] = {}
    for b, row in enumerate(draws):
        for key, rollout, offset, count in row:
            count = min(count, len(completions[b]) - offset)  # a draw past the completion's end has no token
            if count > 0 and offset >= 0:
                generations.setdefault(key, []).append((rollout, b, offset, count))
    return generations


def _step_stats(logits: torch.Tensor, temperature: float, ids: torch.Tensor, draw: KeyedRows | None
                ) -> tuple[torch.Tensor, ...]:
    """(logprob of ``ids``, entropy, surprisal variance, top logprob, keyed margin) of each row of untempered float32
    logits [n, V], with the arithmetic of :func:`generate` (``l / T``, then log-softmax and the keyed scores); margins
    0 without ``draw``."""
    import torch

    tempered = logits / temperature
    logp_all = torch.log_softmax(tempered, -1)
    entropy, variance = entropy_variance(logp_all)
    margins = (margins_of_rows(tempered, ids, 1.0, draw) if draw is not None
               else torch.zeros(len(ids), dtype=torch.float32, device=logits.device))
    return (logp_all.gather(1, ids[:, None]).squeeze(1), entropy, variance, logp_all.max(-1).values, margins)


def entropy_variance(logp_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H and V (see :func:`completion_stats`) of each row of log-probabilities [..., V], STATS_ELEMENTS entries at
    a time (whole rows of the leading dimension)."""
    import torch

    lead = logp_all.shape[:-1]
    entropy = torch.empty(lead, dtype=logp_all.dtype, device=logp_all.device)
    variance = torch.empty_like(entropy)
    inner = 1
    for d in logp_all.shape[1:]:
        inner *= d
    rows = max(1, STATS_ELEMENTS // max(1, inner))
    with torch.no_grad():
        for b in range(0, logp_all.shape[0], rows):
            part = logp_all[b : b + rows]
            p = part.exp()
            # a token whose probability underflows to 0 contributes nothing (and no 0 · −inf = nan)
            nothing = torch.logical_not(p > 0)
            t = torch.mul(p, part).masked_fill_(nothing, 0.0)
            h = t.sum(-1).neg_()  # H = −Σ p·log p
            dev = torch.neg(part, out=t).sub_(h[..., None]).masked_fill_(nothing, 0.0)  # −log p − H, in t's place
            entropy[b : b + rows] = h
            variance[b : b + rows] = p.mul_(dev).mul_(dev).sum(-1)  # Σ (p·dev)·dev, in p's place
    return entropy, variance


_PLAIN_HEADS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def plain_head(model: Any) -> bool:
    """Whether ``model``'s logits are its output layer applied to its decoder's last hidden states and nothing
    more, checked once per model by computing a two-token pass both ways (a model that scales or soft-caps its
    logits, or a wrapper, fails it). Never on FSDP-sharded models: there a pass on one rank alone would hang."""
    known = _PLAIN_HEADS.get(model)
    if known is not None:
        return known
    import torch

    plain = False
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    sharded = type(model).__name__.startswith("FSDP") or any(
        type(m).__name__.startswith("FSDP") for m in (decoder, head) if m is not None)
    if isinstance(head, torch.nn.Linear) and decoder is not None and not sharded:
        device = next(model.parameters()).device
        ids = torch.tensor([[0, 1]], dtype=torch.long, device=device)
        with torch.no_grad():
            try:
                whole = model(input_ids=ids).logits
                parts = head(decoder(input_ids=ids).last_hidden_state)
                plain = whole.shape == parts.shape and bool(torch.equal(whole, parts))
            except Exception:  # any model that cannot be taken apart this way computes its logits whole
                plain = False
    _PLAIN_HEADS[model] = plain
    return plain


class CompletionHidden(NamedTuple):
    """The decoder's last hidden states at the positions that predict each completion token, without the logits
    (:func:`completion_hidden`). Position t of completion b predicts its token t: ``hidden[b, t]`` — or, with shared
    prompts (``first`` set), ``first[b]`` holds position 0's logits (from the prompt's own pass) and ``hidden[b, t − 1]``
    position t ≥ 1 (None when every completion has one token)."""

    hidden: torch.Tensor | None
    first: torch.Tensor | None
    ids: torch.Tensor  # [B, T] completion token ids, right-padded
    mask: torch.Tensor  # [B, T] 1 on real tokens


def completion_hidden(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                      pad_id: int, share_prompts: bool) -> CompletionHidden:
    """The passes of :func:`completion_logprobs` up to the decoder's last hidden states, for callers that apply the
    output layer a slice at a time (:func:`_streamed_stats`; the learner's coordinator.engine.head). Differentiable
    under grad mode. The model's head must be plain (:func:`plain_head`)."""
    import torch

    decoder = model.get_decoder()
    device = next(model.parameters()).device
    repeated = share_prompts and len({tuple(p) for p in prompts}) < len(prompts)
    c_ids, c_mask = _right_pad(completions, pad_id, device)
    width = c_ids.shape[1]
    if repeated:  # as _shared_prompt_logits: each prompt once, then the completions on a copy of its cache
        out, sel, p_mask, p_pos = _prefill_once(model, prompts, pad_id, device)
        first = out.logits[:, -1, :][sel]  # [B, V]: predicts each completion's first token
        hidden = None
        if width > 1:
            cache, mask, positions = _continuation(out, sel, p_mask, p_pos, c_mask, width, device)
            hidden = decoder(input_ids=c_ids[:, :-1], attention_mask=mask, position_ids=positions, use_cache=True,
                             **{_cache_kwarg(decoder): cache}).last_hidden_state  # [B, T − 1, H]
        del out
        return CompletionHidden(hidden, first, c_ids, c_mask)
    # as _completion_logits: one pass over prompt + completion
    p_ids, p_mask = _left_pad(prompts, pad_id, str(device))
    ids = torch.cat([p_ids, c_ids], dim=1)
    mask = torch.cat([p_mask, c_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    start = p_ids.shape[1] - 1
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    return CompletionHidden(hidden[:, start : start + width], None, c_ids, c_mask)  # [B, T, H]


def _streamed_stats(model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    temperature: float, pad_id: int, share_prompts: bool,
                    segments: Sequence[Sequence[Segment]] | None) -> CompletionStats | None:
    """:func:`completion_stats` without ever holding the [B, T, V] logits: the decoder's last hidden states once,
    then the output layer, the log-softmax, the entropy terms and the margins on LOGIT_ELEMENTS entries at a time.
    None where that does not apply (gradients wanted, a small batch, a model whose head is not plain): then the
    caller computes the logits whole.

    The bits are the whole pass's: each chunk's rows go through the same output layer (a product over at least
    LOGIT_ROWS rows, as the whole one), and everything after it depends on its own row alone. For shared prompts,
    each completion's first logits come from the prompt's own pass, as in :func:`_shared_prompt_logits`."""
    import torch

    if torch.is_grad_enabled() or not completions:
        return None
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    width = max(1, max(len(c) for c in completions))
    rows_per_chunk = max(LOGIT_ROWS, LOGIT_ELEMENTS // max(1, vocab))
    if vocab <= 0 or len(completions) * width < 2 * rows_per_chunk or not plain_head(model):
        return None
    head = model.get_output_embeddings()
    hidden, first, c_ids, c_mask = completion_hidden(model, prompts, completions, pad_id=pad_id,
                                                     share_prompts=share_prompts)
    device = c_ids.device
    bsz = len(completions)
    total = bsz * width
    flat_ids = c_ids.reshape(-1)
    outs = [torch.empty(total, dtype=torch.float32, device=device) for _ in range(4)]  # logp, H, V, top
    margins = torch.zeros(total, dtype=torch.float32, device=device) if segments is not None else None
    keyed = KeyedRows.of(segments, width, device) if segments is not None else None
    bounds = list(range(0, total, rows_per_chunk))
    if total - bounds[-1] < rows_per_chunk:  # no short last chunk: it joins the one before
        bounds.pop()
    bounds.append(total)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        logits = _logit_rows(head, hidden, first, width, start, stop).float().div_(temperature)
        logp_all = torch.log_softmax(logits, -1)
        outs[0][start:stop] = logp_all.gather(1, flat_ids[start:stop, None]).squeeze(1)
        outs[1][start:stop], outs[2][start:stop] = entropy_variance(logp_all)
        outs[3][start:stop] = logp_all.max(-1).values
        del logp_all
        if keyed is not None and margins is not None:
            mine, _ = keyed.within(start, stop)
            if mine.count:
                margins[mine.flat] = margins_of_rows(logits, flat_ids[mine.flat], 1.0, mine,
                                                     rows_at=mine.flat - start)
        del logits
    c_maskf = c_mask.to(torch.float32)
    logp, entropy, variance, top = (t.view(bsz, width) for t in outs)
    return CompletionStats(logp, entropy, variance, top, c_maskf,
                           margins.view(bsz, width) * c_mask if margins is not None else None)


def _logit_rows(head: Any, hidden: torch.Tensor | None, first: torch.Tensor | None, width: int, start: int,
                stop: int) -> torch.Tensor:
    """Untempered logits [stop − start, V] of rows start…stop of the [B × T] completion positions (row b·T + t),
    from the decoder's hidden states; with ``first`` (shared prompts) position 0's are the prompt pass's own and
    ``hidden`` holds positions 1…T−1."""
    import torch

    source = first if first is not None else hidden
    assert source is not None
    rows = torch.arange(start, stop, device=source.device)
    b, t = rows // width, rows % width
    if first is None:
        assert hidden is not None
        return head(hidden[b, t])
    out = torch.empty((stop - start, first.shape[-1]), dtype=first.dtype, device=first.device)
    later = torch.nonzero(t > 0).squeeze(1)
    at_first = torch.nonzero(t == 0).squeeze(1)
    if len(at_first):
        out[at_first] = first[b[at_first]]
    if len(later):
        assert hidden is not None
        out[later] = head(hidden[b[later], t[later] - 1]).to(out.dtype)
    return out
