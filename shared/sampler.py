"""The keyed Gumbel-max sampler: every backend picks each token the same way, so the verifier can check every
choice from the teacher-forced pass it already runs (docs/protocol.md §5b).

A rollout's token at a position is ``argmax_i(logits_i / T + G_i)``, where the Gumbel noise ``G_i`` is a fixed
function of (the job's sampling key, the rollout's index in the job, the position, the token id). This samples
exactly ``softmax(logits / T)`` (the Gumbel-max trick), so the behaviour logprob stays
``log_softmax(logits / T)[token]``. Why keyed noise rather than a seeded random generator: llama.cpp's sampler
draws by inverse CDF from ``std::mt19937`` (different across C++ libraries, and flipped by a small logit drift
anywhere in the CDF), torch's multinomial differs across devices — neither can be replayed by the verifier. With
the noise fixed, an honest token is the argmax of the verifier's scores too, up to the small difference between
the two implementations' logits; a forced, cherry-picked or greedy token is not.

The specification, which a client written from docs/protocol.md reproduces bit for bit:

- ``mix32(x)``: for x in [0, 2³²): ``x ^= x >> 16; x = x·0x7feb352d mod 2³²; x ^= x >> 15; x = x·0x846ca68b mod
  2³²; x ^= x >> 16`` (Wellons' lowbias32; a bijection with full avalanche).
- the key (the job's ``seed``, 63 bits, secret to the run until the job is leased: core.jobs) gives
  ``k = mix32((key mod 2³²) ^ mix32((key >> 32) ^ 0x9e3779b9))``; rollout ``r`` (prompt-major index in the job:
  prompt i, sample g → ``i·group_size + g``) and position ``t`` (index of the token among the completion's tokens)
  give ``a = mix32(mix32(k ^ mix32(r ^ 0x85ebca6b)) ^ mix32(t ^ 0xc2b2ae35))`` and ``b = mix32(a ^ 0x27d4eb2f)``;
- token id ``i``: ``bits = mix32(mix32(mix32(i ^ 0x165667b1) ^ a) ^ b)``; ``u = ((bits >> 9) + 0.5) / 2²³``
  (exact in float32, never 0 or 1: with 24 bits the largest u would round to 1); ``G = −log(−log(u))`` in float32 — the one step where libraries may differ,
  by a few float32 ulp (|ΔG| < 1e-5), which the verifier's tolerance (≥ 0.02) absorbs. float32, not float64:
  the two logarithms over the vocabulary are most of the sampler's cost, and float64 ones cost a llama.cpp
  client 6 % of its decode speed at a 152 k vocabulary (bench/choice_cost.py);
- score ``s_i = logits_i / T + G_i`` in float32 (logits as the model computed them); the token is the first index
  of the largest score.

The integer steps use only ``^ >> & + ·`` on non-negative values below 2⁴⁹ (a 32-bit product is split into 16-bit
halves), so one implementation runs on Python ints, numpy int64 arrays and torch int64 tensors on any device with
identical bits. The verifier's *margin* of a token x is ``max_i s_i − s_x ≥ 0``: 0 when x is the keyed choice.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

SAMPLER_ID = "gumbel-max/lowbias32-v1"  # the specification above; named in the job so a client can refuse another

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B
KEY_SALT, ROLLOUT_SALT, POSITION_SALT, B_SALT, TOKEN_SALT = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1

Ints = Any  # an int, a numpy int64 array or a torch int64 tensor: the integer steps run on any of them


def _mul32(x: Ints, c: int) -> Ints:
    """x·c mod 2³² for x in [0, 2³²), without a product ≥ 2⁶³: c split into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return ((x * lo) + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: Ints) -> Ints:
    """lowbias32 (see the module docstring): a 32-bit bijection."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def job_word(key: int) -> int:
    """The 32-bit word a job's 63-bit sampling key reduces to."""
    key = int(key)
    return mix32((key & MASK32) ^ mix32(((key >> 32) & MASK32) ^ KEY_SALT))


def position_words(k: Ints, rollout: Ints, position: Ints) -> tuple[Ints, Ints]:
    """(a, b) for rollout(s) and position(s): ints, or broadcastable int64 arrays/tensors."""
    a = mix32(mix32(k ^ mix32(rollout ^ ROLLOUT_SALT)) ^ mix32(position ^ POSITION_SALT))
    return a, mix32(a ^ B_SALT)


def noise_bits(token_words: Ints, a: Ints, b: Ints) -> Ints:
    """The 32-bit noise word per token, from the token words ``mix32(i ^ TOKEN_SALT)`` and a position's (a, b)."""
    return mix32(mix32(token_words ^ a) ^ b)


# -- numpy (the llama.cpp client) ------------------------------------------------------------------------------
_NP_TOKENS: dict[int, np.ndarray] = {}
_U16, _U15 = np.uint32(16), np.uint32(15)
_UM1, _UM2 = np.uint32(_M1), np.uint32(_M2)


def mix32_u32(x: np.ndarray) -> np.ndarray:
    """:func:`mix32` on a numpy uint32 array, whose multiplication wraps mod 2³² by definition: the same bits in a
    third of the operations (the client's per-token cost over a 152 k vocabulary)."""
    x = x ^ (x >> _U16)
    x *= _UM1
    x ^= x >> _U15
    x *= _UM2
    x ^= x >> _U16
    return x


def token_words_np(vocab: int) -> np.ndarray:
    """``mix32(i ^ TOKEN_SALT)`` for every token id, uint32 (cached per vocabulary size: it does not depend on the
    key)."""
    words = _NP_TOKENS.get(vocab)
    if words is None:
        words = mix32_u32(np.arange(vocab, dtype=np.uint32) ^ np.uint32(TOKEN_SALT))
        _NP_TOKENS[vocab] = words
    return words


def noise_bits_np(token_words: np.ndarray, a: int, b: int) -> np.ndarray:
    """:func:`noise_bits` for uint32 token words and one position's (a, b)."""
    x = mix32_u32(token_words ^ np.uint32(a))
    x ^= np.uint32(b)
    return mix32_u32(x)


_U9 = np.uint32(9)
_HALF, _SCALE23 = np.float32(0.5), np.float32(2.0**-23)


def gumbel_np(bits: np.ndarray) -> np.ndarray:
    """float32 G from uint32 noise words: u = ((bits >> 9) + 0.5) / 2²³ — 23 bits, so u + its half step is exact
    in float32 and below 1 (with 24 bits the largest u rounds to 1.0 and G to +inf)."""
    u = (bits >> _U9).astype(np.float32)
    u += _HALF
    u *= _SCALE23
    np.log(u, out=u)  # in place: each pass over the vocabulary allocates nothing
    np.negative(u, out=u)
    np.log(u, out=u)
    np.negative(u, out=u)
    return u


def gumbel_row_np(key: int, rollout: int, position: int, vocab: int) -> np.ndarray:
    """The float32 Gumbel noise of one (job, rollout, position) over the vocabulary."""
    a, b = position_words(job_word(key), int(rollout), int(position))
    return gumbel_np(noise_bits_np(token_words_np(vocab), a, b))


class _Scratch(threading.local):
    """Per-thread buffers by shape for :func:`choose_np` and the verifier's margins: a client draws a token every
    few milliseconds and the verifier scores 2 MiB chunks back to back; allocating a dozen fresh temporaries per
    draw or chunk (new pages, each faulted in) cost more than the arithmetic."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def arrays(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Two uint32 and two float32 arrays of ``shape`` (the same ones on every call from this thread)."""
        got = self.by_shape.get(shape)
        if got is None:
            if len(self.by_shape) >= 4:  # a chunked pass uses two shapes (full chunks, the last one)
                self.by_shape.clear()
            got = self.by_shape[shape] = (np.empty(shape, np.uint32), np.empty(shape, np.uint32),
                                          np.empty(shape, np.float32), np.empty(shape, np.float32))
        return got


_SCRATCH = _Scratch()


def _mix32_into(x: np.ndarray, t: np.ndarray) -> None:
    """:func:`mix32_u32` in place on ``x``, ``t`` a scratch array of the same shape."""
    np.right_shift(x, _U16, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _UM1, out=x)
    np.right_shift(x, _U15, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _UM2, out=x)
    np.right_shift(x, _U16, out=t)
    np.bitwise_xor(x, t, out=x)


_ONE_BITS = np.uint32(0x3F800000)  # float32 1.0: OR-ed with a 23-bit m, the bits of 1 + m·2⁻²³
_ONE_LESS_HALF_STEP = np.float32(1.0 - 2.0**-24)


def _keyed_scores_into(logits: np.ndarray, temperature: float, a: Ints, b: Ints,
                       bufs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """float32 ``logits / T + G`` for float32 logits [..., V] and uint32 (a, b) broadcastable to them, computed in
    the scratch ``bufs`` (:class:`_Scratch`); returns the scores buffer, valid until the next call.

    The same bits as the specification's steps in two passes over the vocabulary fewer (a llama.cpp client runs
    this once per token): u = (m + ½)·2⁻²³ is made as (1 + m·2⁻²³) − (1 − 2⁻²⁴) from the float32 whose mantissa
    is m — both operands and the difference exact in float32, as the conversion, the ½ and the scaling were; and
    ``logits/T − log(−log u)`` is ``logits/T + G`` exactly (negation is exact), ``logits/1`` is ``logits``."""
    x, t, g, s = bufs
    np.bitwise_xor(token_words_np(logits.shape[-1]), a, out=x)
    _mix32_into(x, t)
    np.bitwise_xor(x, b, out=x)
    _mix32_into(x, t)
    np.right_shift(x, _U9, out=x)
    np.bitwise_or(x, _ONE_BITS, out=x)
    np.subtract(x.view(np.float32), _ONE_LESS_HALF_STEP, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)  # −G
    if temperature == 1.0 and logits.dtype == np.float32:
        np.subtract(logits, g, out=s)
    else:
        np.divide(logits, np.float32(temperature), out=s, casting="same_kind")
        s -= g
    return s


def choose_np(logits: np.ndarray, temperature: float, key: int, rollout: int, position: int) -> int:
    """The keyed choice for one position from a float32 logits row (the llama.cpp client's sampler): the same
    bits as :func:`gumbel_row_np` plus ``logits / T``, computed in per-thread buffers (3.4× faster at a 152 k
    vocabulary than with temporaries)."""
    a, b = position_words(job_word(key), int(rollout), int(position))
    scores = _keyed_scores_into(logits, temperature, np.uint32(a), np.uint32(b), _SCRATCH.arrays(logits.shape))
    return int(np.argmax(scores))


# -- torch (the torch client, the co-located loop, the verifier) -----------------------------------------------
_TORCH_TOKENS: dict[tuple[str, int], Any] = {}


def _signed32(c: int) -> int:
    return c - 2**32 if c >= 2**31 else c


_SM1, _SM2 = _signed32(_M1), _signed32(_M2)


def to_i32(x: torch.Tensor) -> torch.Tensor:
    """32-bit words held in int64 → the same bits in an int32 tensor (two's complement)."""
    import torch

    return (x - ((x >> 31) & 1) * 2**32).to(torch.int32)


def mix32_i32(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` on an int32 tensor of 32-bit words: int32 multiplication wraps mod 2³² (two's complement) and
    the masks after each shift make it logical — the same bits at a quarter of the int64 path's cost, which is what
    the verifier pays over every (token, vocabulary entry) of a result."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _SM1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _SM2
    return x ^ ((x >> 16) & 0xFFFF)


def token_words_torch(vocab: int, device: Any) -> torch.Tensor:
    """``mix32(i ^ TOKEN_SALT)`` for every token id as int32 words (cached per device and vocabulary size)."""
    import torch

    key = (str(device), vocab)
    words = _TORCH_TOKENS.get(key)
    if words is None:
        words = to_i32(mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ TOKEN_SALT))
        _TORCH_TOKENS[key] = words
    return words


def noise_bits_torch(token_words: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`noise_bits` for int32 token words and broadcastable int64 (a, b): int32 words."""
    return mix32_i32(mix32_i32(token_words ^ to_i32(a)) ^ to_i32(b))


def gumbel_torch(bits: torch.Tensor) -> torch.Tensor:
    """float32 G from 32-bit noise words (int32 two's complement, or non-negative int64): the top 23 bits."""
    import torch

    u = (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def keyed_scores_torch(logits: torch.Tensor, temperature: float, keys: torch.Tensor, rollouts: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """float32 scores ``logits / T + G`` for logits [..., V] (untempered) whose leading dims match the int64
    tensors ``keys`` (job words, :func:`job_word`), ``rollouts`` and ``positions``."""
    import torch

    a, b = position_words(keys, rollouts, positions)
    if logits.device.type == "cpu":  # numpy's uint32 and float32 loops run this 4-5x faster than torch's on a CPU
        shape = tuple(logits.shape)
        fresh = (np.empty(shape, np.uint32), np.empty(shape, np.uint32), np.empty(shape, np.float32),
                 np.empty(shape, np.float32))  # not the scratch: the scores are returned to the caller
        scores = _keyed_scores_into(logits.detach().to(torch.float32).numpy(), temperature,
                                    a.numpy().astype(np.uint32)[..., None], b.numpy().astype(np.uint32)[..., None],
                                    fresh)
        return torch.from_numpy(scores)
    bits = noise_bits_torch(token_words_torch(logits.shape[-1], logits.device), a[..., None], b[..., None])
    return logits.to(torch.float32) / float(temperature) + gumbel_torch(bits)


def choose_torch(logits: torch.Tensor, temperature: float, words: torch.Tensor, rollouts: torch.Tensor,
                 position: int) -> torch.Tensor:
    """The keyed choice per row of logits [n, V] at one position: row i is rollout ``rollouts[i]`` of the job whose
    key reduces to ``words[i]`` (:func:`job_word`)."""
    import torch

    device = logits.device
    pos = torch.full((logits.shape[0],), int(position), dtype=torch.int64, device=device)
    return keyed_scores_torch(logits, temperature, words.to(device), rollouts.to(device), pos).argmax(-1)


def row_keys(rows: Sequence[tuple[int, int]], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(job words, rollout indices) tensors for rows given as (sampling key, rollout index)."""
    import torch

    return (torch.tensor([job_word(k) for k, _ in rows], dtype=torch.int64, device=device),
            torch.tensor([r for _, r in rows], dtype=torch.int64, device=device))


#: One run of keyed draws inside a completion: (sampling key, rollout index, offset of its first token in the
#: completion, token count); its tokens are positions 0, 1, … of that rollout. A plain completion is one segment
#: (the job's seed, its rollout index, 0, its length); a multi-turn episode one per turn (that turn's seed, the
#: episode's index among the turn's live episodes, where the turn's action starts, its length) — the observation
#: tokens between them were not sampled and have no margin.
Segment = tuple[int, int, int, int]


def plain_segments(key: int, lengths: Sequence[int]) -> list[list[Segment]]:
    """The segments of a job's completions of these lengths: rollout r is completion r, positions from 0."""
    return [[(int(key), r, 0, int(n))] for r, n in enumerate(lengths)]


#: Scores computed at once by :func:`margins_torch`: 2¹⁹ float32 values (2 MiB) keep its twenty-odd elementwise
#: passes in the CPU's cache; a 64 MiB chunk made them memory-bound and the check cost 40 % of a 0.5 B recompute.
MARGIN_CHUNK = 2**19


def margins_torch(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                  segments: Sequence[Sequence[Segment]], *, chunk_elements: int = MARGIN_CHUNK) -> torch.Tensor:
    """Each token's margin ``max_i s_i − s_token`` (float32, [B, T]) from untempered logits [B, T, V] of
    completions ``tokens`` [B, T], row b keyed by ``segments[b]``; 0 where no segment covers a token. Only the
    keyed positions are scored, ``chunk_elements`` scores at a time (at least one position's vocabulary)."""
    import torch

    bsz, width, vocab = logits.shape
    out = torch.zeros(bsz * width, dtype=torch.float32, device=logits.device)
    keyed = KeyedRows.of(segments, width, logits.device)
    if keyed.count:
        out[keyed.flat] = margins_of_rows(logits.detach().reshape(bsz * width, vocab), tokens.reshape(-1)[keyed.flat],
                                          temperature, keyed, chunk_elements=chunk_elements)
    return out.view(bsz, width)


class KeyedRows:
    """The keyed positions of completions padded to ``width`` columns: flat row indices ``flat`` (b·width + t) into
    the [B·width, V] logits, with each one's job word, rollout index and position among its segment's draws."""

    def __init__(self, flat: torch.Tensor, words: torch.Tensor, rollouts: torch.Tensor,
                 positions: torch.Tensor) -> None:
        self.flat, self.words, self.rollouts, self.positions = flat, words, rollouts, positions

    @property
    def count(self) -> int:
        return int(self.flat.numel())

    @classmethod
    def of(cls, segments: Sequence[Sequence[Segment]], width: int, device: Any) -> KeyedRows:
        import torch

        flat: list[int] = []
        words: list[int] = []
        rollouts: list[int] = []
        positions: list[int] = []
        for b, row in enumerate(segments):
            for key, rollout, offset, length in row:
                end = min(width, offset + length)
                if offset < 0 or end <= offset:
                    continue
                word = job_word(key)
                flat.extend(range(b * width + offset, b * width + end))
                words.extend([word] * (end - offset))
                rollouts.extend([rollout] * (end - offset))
                positions.extend(range(end - offset))
        return cls(*(torch.tensor(v, dtype=torch.int64, device=device) for v in (flat, words, rollouts, positions)))

    def within(self, start: int, stop: int) -> tuple[KeyedRows, torch.Tensor]:
        """Those whose flat index lies in [start, stop), and where they are among all of them."""
        import torch

        where = torch.nonzero((self.flat >= start) & (self.flat < stop)).squeeze(1)
        return KeyedRows(self.flat[where], self.words[where], self.rollouts[where], self.positions[where]), where


def margins_of_rows(rows: torch.Tensor, chosen_ids: torch.Tensor, temperature: float, keyed: KeyedRows, *,
                    chunk_elements: int = MARGIN_CHUNK, rows_at: torch.Tensor | None = None) -> torch.Tensor:
    """The margins (float32, [keyed.count]) of the keyed draws whose untempered logits are ``rows[rows_at]``
    (default: ``rows[keyed.flat]``), the token drawn at each being ``chosen_ids``. Each margin depends on its own
    row alone, so any grouping of rows gives the same bits (how completion_stats streams the logits)."""
    import torch

    device = rows.device
    vocab = rows.shape[-1]
    idx = keyed.flat if rows_at is None else rows_at
    w, r, t = keyed.words, keyed.rollouts, keyed.positions
    step = max(1, chunk_elements // max(1, vocab))

    def chunk(start: int) -> tuple[slice, torch.Tensor]:
        sl = slice(start, start + step)
        with torch.no_grad():
            if device.type == "cpu" and rows.dtype == torch.float32:
                # the same bits as keyed_scores_torch, in this thread's scratch: no fresh pages per chunk
                n = len(idx[sl])
                bufs = _SCRATCH.arrays((n, vocab))
                picked = torch.from_numpy(bufs[3])  # the scores buffer doubles as the gathered logits
                torch.index_select(rows, 0, idx[sl], out=picked)
                a, b = position_words(w[sl], r[sl], t[sl])
                held = _keyed_scores_into(bufs[3], temperature, a.numpy().astype(np.uint32)[:, None],
                                          b.numpy().astype(np.uint32)[:, None], bufs)
                ids = chosen_ids[sl].numpy()
                return sl, torch.from_numpy(held.max(axis=1) - held[np.arange(n), ids])
            scores = keyed_scores_torch(rows[idx[sl]], temperature, w[sl], r[sl], t[sl])
            chosen = scores.gather(1, chosen_ids[sl, None]).squeeze(1)
            return sl, scores.max(-1).values - chosen

    out = torch.empty(len(idx), dtype=torch.float32, device=device)
    starts = range(0, len(idx), step)
    if device.type == "cpu" and len(starts) > 1 and torch.get_num_threads() > 1:
        # numpy's and torch's elementwise loops release the GIL but run on one core: the chunks go to as many
        # threads as torch computes the recompute with, so the check keeps pace with the pass it follows
        # (one thread: 7.9 % of a 0.5 B recompute on two cores, bench/choice_cost.py)
        done = list(_margin_pool(torch.get_num_threads()).map(chunk, starts))
    else:
        done = [chunk(start) for start in starts]
    for sl, margin in done:
        out[sl] = margin
    return out


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _margin_pool(threads: int) -> ThreadPoolExecutor:
    """One pool per thread count, kept for the process (the verifier checks every result with it)."""
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="keyed-margins")
    return pool
