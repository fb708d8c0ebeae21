"""The keyed Gumbel-max sampler (shared.sampler): one specification, identical bits on Python ints, numpy and
torch, the softmax distribution, the published test vectors, and the verifier's margin check on real models."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from coordinator.core.verify import MarginTally, check_choices, choice_stats
from shared import sampler
from shared.errors import ProtocolError, Reason

REPO = Path(__file__).resolve().parents[2]

# (key, rollout, position, token id) → noise word; the same table is printed in docs/protocol.md §5b
VECTORS = [(0, 0, 0, 0), (1, 0, 0, 0), (123456789012345, 3, 7, 42), (2**63 - 1, 63, 4095, 151935)]


def _word(key: int, rollout: int, position: int, token: int) -> int:
    a, b = sampler.position_words(sampler.job_word(key), rollout, position)
    return sampler.noise_bits(sampler.mix32(token ^ sampler.TOKEN_SALT), a, b)


def test_mix32_is_a_bijection_on_a_sample_and_identical_on_every_integer_kind() -> None:
    import torch

    xs = [0, 1, 2, 3, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    ints = [sampler.mix32(x) for x in xs]
    assert len(set(ints)) == len(xs) and all(0 <= v < 2**32 for v in ints)
    assert list(sampler.mix32(np.array(xs, dtype=np.int64))) == ints
    assert list(sampler.mix32_u32(np.array(xs, dtype=np.uint32))) == ints
    assert sampler.mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == ints
    sample = np.arange(0, 2**20, dtype=np.int64) * 4093  # distinct inputs map to distinct outputs
    assert len(np.unique(sampler.mix32(sample))) == len(sample)


def test_noise_bits_agree_between_numpy_torch_and_python_over_a_large_vocabulary() -> None:
    import torch

    vocab = 151_936
    a, b = sampler.position_words(sampler.job_word(987654321), 5, 17)
    np_bits = sampler.noise_bits_np(sampler.token_words_np(vocab), a, b)
    generic = sampler.noise_bits(np.arange(vocab, dtype=np.int64), 0, 0)  # the int64 path of the same function
    assert np.array_equal(generic, sampler.mix32(sampler.mix32(np.arange(vocab, dtype=np.int64))))
    torch_bits = sampler.noise_bits_torch(sampler.token_words_torch(vocab, "cpu"), torch.tensor(a), torch.tensor(b))
    assert torch_bits.dtype == torch.int32
    assert np.array_equal(np_bits, torch_bits.numpy().view(np.uint32))  # the same 32-bit words
    wide = sampler.noise_bits(torch.arange(vocab, dtype=torch.int64) ^ sampler.TOKEN_SALT, 0, 0)  # int64 path
    assert torch.equal(sampler.mix32(wide), sampler.mix32_i32(sampler.to_i32(wide)).to(torch.int64) & 0xFFFFFFFF)
    assert all(int(np_bits[i]) == _word(987654321, 5, 17, i) for i in (0, 1, 77, vocab - 1))
    gn, gt = sampler.gumbel_np(np_bits), sampler.gumbel_torch(torch_bits).numpy()
    assert np.abs(gn - gt).max() < 1e-5  # the documented bound on the float step
    assert gn.dtype == np.float32 and np.isfinite(gn).all()
    extremes = np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32)  # the largest word must not give u = 1, G = inf
    assert np.isfinite(sampler.gumbel_np(extremes)).all()
    assert torch.isfinite(sampler.gumbel_torch(sampler.to_i32(torch.tensor(extremes.astype(np.int64))))).all()
    assert abs(gn.mean() - 0.5772) < 0.01 and abs(gn.std() - math.pi / math.sqrt(6)) < 0.01  # Gumbel(0, 1)


def test_published_test_vectors_match_the_code() -> None:
    text = (REPO / "docs" / "protocol.md").read_text()
    rows = re.findall(r"^\| `(\d+)` \| (\d+) \| (\d+) \| (\d+) \| `0x([0-9a-f]{8})` \| (-?[0-9.]+) \|", text,
                      flags=re.M)
    assert len(rows) == len(VECTORS), "docs/protocol.md §5b lists the keyed sampler's test vectors"
    for (key, rollout, position, token, word, g), vector in zip(rows, VECTORS, strict=True):
        assert (int(key), int(rollout), int(position), int(token)) == vector
        assert int(word, 16) == _word(*vector), vector
        assert abs(float(sampler.gumbel_np(np.array([int(word, 16)], dtype=np.uint32))[0]) - float(g)) < 1e-5


def test_keyed_choices_follow_the_softmax_at_the_temperature() -> None:
    logits = np.array([0.0, 1.0, 2.0, 0.5, -1.0], dtype=np.float32)
    for temperature in (1.0, 0.7):
        n = 20_000
        counts = np.bincount([sampler.choose_np(logits, temperature, 99, r, 3) for r in range(n)], minlength=5)
        p = np.exp(logits / temperature)
        p /= p.sum()
        chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
        assert chi2 < 25.0, (counts / n, p)  # 4 degrees of freedom: p ≈ 5e-5 for an honest sampler


def test_numpy_and_torch_choose_the_same_tokens() -> None:
    import torch

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 1000)).astype(np.float32)
    rollouts = torch.arange(16)
    for position in range(5):
        words = torch.full((16,), sampler.job_word(31337), dtype=torch.int64)
        t = sampler.choose_torch(torch.from_numpy(logits), 0.8, words, rollouts, position).tolist()
        n = [sampler.choose_np(logits[r], 0.8, 31337, r, position) for r in range(16)]
        assert t == n


def test_the_clients_fused_scores_are_the_specifications_bit_for_bit() -> None:
    """The client's per-token path (choose_np via _keyed_scores_into: u from the float's mantissa, −G subtracted,
    no division at T = 1) gives the very float32 scores of the specification's literal steps (gumbel_np: convert,
    add ½, scale, −log(−log u), then logits / T + G) — for every one of the 2²³ values u takes, and for whole rows
    of a 152 k vocabulary at several temperatures. A different bit here would move a keyed choice."""
    m = np.arange(2**23, dtype=np.uint32)
    literal = m.astype(np.float32)
    literal += np.float32(0.5)
    literal *= np.float32(2.0**-23)
    fused = np.subtract((m | sampler._ONE_BITS).view(np.float32), sampler._ONE_LESS_HALF_STEP)
    assert np.array_equal(fused.view(np.uint32), literal.view(np.uint32))
    rng = np.random.default_rng(5)
    vocab = 151_936
    for temperature in (1.0, 0.7, 1.3):
        for rollout, position in ((0, 0), (3, 17), (63, 4095)):
            logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
            spec = logits / np.float32(temperature) + sampler.gumbel_row_np(99, rollout, position, vocab)
            a, b = sampler.position_words(sampler.job_word(99), rollout, position)
            got = sampler._keyed_scores_into(logits, temperature, np.uint32(a), np.uint32(b),
                                             sampler._SCRATCH.arrays(logits.shape))
            assert np.array_equal(got.view(np.uint32), spec.view(np.uint32)), (temperature, rollout, position)
            assert sampler.choose_np(logits, temperature, 99, rollout, position) == int(np.argmax(spec))


def test_a_different_key_rollout_or_position_gives_different_noise() -> None:
    base = sampler.gumbel_row_np(7, 0, 0, 512)
    for other in (sampler.gumbel_row_np(8, 0, 0, 512), sampler.gumbel_row_np(7, 1, 0, 512),
                  sampler.gumbel_row_np(7, 0, 1, 512)):
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.2


def test_check_choices_refuses_beyond_the_tolerance_with_where_and_how_far() -> None:
    check_choices(choice_stats([[0.0, 0.0], [0.004]]), 0.01)
    with pytest.raises(ProtocolError) as err:
        check_choices(choice_stats([[0.0, 0.0], [0.0, 2.5, 0.3]]), 0.01)
    assert err.value.reason is Reason.CHOICE_MISMATCH and err.value.http_status == 422
    assert "completion 1, token 1" in err.value.message and "2.5 below the best" in err.value.message
    assert "2 of 5 tokens off the argmax" in err.value.message and "§5b" in err.value.message


def test_the_margin_tally_bins_passing_results_by_their_share_of_the_tolerance() -> None:
    tally = MarginTally()
    for worst in (0.0, 0.0, 0.004, 0.3, 0.5):  # tolerance 0.5: ratios 0, 0, 0.008, 0.6, 1.0
        tally.add("llama/cpu", worst, 0.5)
    tally.add("torch/cpu", 0.0, 0.02)
    cum = dict(tally.cumulative("llama/cpu"))
    assert cum["0.0"] == 2 and cum["0.01"] == 3 and cum["0.5"] == 3 and cum["0.75"] == 4 and cum["1.0"] == 5
    assert cum["+Inf"] == 5 and list(cum)[-1] == "+Inf"
    assert math.isclose(tally.sums["llama/cpu"], 0.008 + 0.6 + 1.0)
    assert dict(tally.cumulative("torch/cpu"))["0.0"] == 1


def test_an_honest_torch_result_has_zero_margins_and_a_forced_one_does_not(tiny_model_dir: Path) -> None:
    """The client's generate and the verifier's completion_stats on the same model: every honest token is the
    exact keyed argmax; replacing one token by another changes the margin at that position only."""
    import torch

    from shared.policy import completion_stats, generate, load_model

    model = load_model(tiny_model_dir).eval()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with torch.no_grad():
        samples = generate(model, prompts, group_size=4, temperature=1.0, max_tokens=8, stop_ids=[0], seed=4242,
                           pad_id=0)
        comps = [list(s.token_ids) for s in samples]
        flat = [p for p in prompts for _ in range(4)]
        stats = completion_stats(model, flat, comps, temperature=1.0, pad_id=0, share_prompts=True,
                                 segments=sampler.plain_segments(4242, [len(c) for c in comps]))
        assert stats.margins is not None and float(stats.margins.abs().max()) == 0.0
        forged = [list(c) for c in comps]
        forged[2][0] = (forged[2][0] + 1) % 200 + 1  # another first token for rollout 2
        forged_stats = completion_stats(model, flat, forged, temperature=1.0, pad_id=0, share_prompts=True,
                                        segments=sampler.plain_segments(4242, [len(c) for c in comps]))
        assert forged_stats.margins is not None and float(forged_stats.margins[2, 0]) > 0.05
        # the same honest tokens judged as another rollout (another job's noise) are off the argmax too
        swapped = completion_stats(model, flat, comps, temperature=1.0, pad_id=0, share_prompts=True,
                                   segments=sampler.plain_segments(4243, [len(c) for c in comps]))
        assert swapped.margins is not None and float(swapped.margins.max()) > 0.05


def test_episode_segments_follow_the_live_episodes_of_each_turn() -> None:
    """Three episodes of 2, 1 and 3 turns: at turn 1 the second has ended, so the third is rollout 1 there; at
    turn 2 only the third is live (rollout 0). Each turn's action starts after the earlier actions and
    observations, and is keyed by that turn's seed."""
    from shared.envs.play import episode_segments, turn_seed

    turns = [[(2, 3), (1, 4)], [(1, 2)], [(1, 1), (2, 2), (1, 0)]]
    segs = episode_segments(77, turns)
    k0, k1, k2 = (turn_seed(77, k) for k in range(3))
    assert segs == [[(k0, 0, 0, 2), (k1, 0, 5, 1)],
                    [(k0, 1, 0, 1)],
                    [(k0, 2, 0, 1), (k1, 1, 2, 2), (k2, 0, 6, 1)]]


def test_margins_are_zero_outside_the_segments() -> None:
    import torch

    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    out = sampler.margins_torch(logits, tokens, 1.0, [[(5, 0, 1, 2)], []])
    assert out[1].abs().max() == 0 and out[0, 0] == 0 and out[0, 3:].abs().max() == 0
    picked = [sampler.choose_np(logits[0, 1 + t].numpy(), 1.0, 5, 0, t) for t in range(2)]
    exact = sampler.margins_torch(logits, torch.tensor([[0, *picked, 0, 0], [0] * 5]), 1.0, [[(5, 0, 1, 2)], []])
    assert exact.abs().max() == 0  # the keyed choices at positions 0 and 1 of that segment have margin 0


def test_margins_from_threaded_chunks_equal_one_pass() -> None:
    """On a CPU with more than one torch thread the chunks are scored on a thread pool: the margins are the same
    bits as one chunk scored in one pass, whatever the chunking, and each lands at its own position."""
    import torch

    torch.manual_seed(0)
    logits = torch.randn(3, 9, 64)
    tokens = torch.randint(0, 64, (3, 9))
    segments = [[(11, 0, 0, 4), (12, 1, 5, 4)], [(11, 1, 2, 7)], [(13, 2, 0, 9)]]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threaded = sampler.margins_torch(logits, tokens, 0.7, segments, chunk_elements=64)  # one position a chunk
        torch.set_num_threads(1)
        serial = sampler.margins_torch(logits, tokens, 0.7, segments, chunk_elements=64)
    finally:
        torch.set_num_threads(before)
    whole = sampler.margins_torch(logits, tokens, 0.7, segments, chunk_elements=10**9)
    assert torch.equal(threaded, whole) and torch.equal(serial, whole)
    assert (whole[2] > 0).sum() >= 5 and whole[1, :2].abs().max() == 0  # real margins, zeros off the segments
