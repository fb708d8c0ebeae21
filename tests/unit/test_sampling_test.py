"""The sampling test (coordinator.core.verify.sampling_stats / check_sampling, shared.policy.completion_stats):
honest samples of a distribution pass, greedy decoding and forced tokens are refused with ``sampling_mismatch``.

The pure check is exercised on synthetic per-position distributions (so every moment is exact), the recompute
on the real tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import ConfigError, VerificationConfig, load_config
from coordinator.core.trust import is_invalidating
from coordinator.core.verify import SamplingStats, TokenStats, check_sampling, sampling_stats
from shared.errors import HTTP_STATUS, ProtocolError, Reason

CFG = VerificationConfig()
VOCAB = 48


def _positions(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` per-position log-distributions over VOCAB tokens, from nearly deterministic to near-uniform (as a
    language model's are: most positions sharp, some open)."""
    scale = rng.choice([0.5, 2.0, 5.0, 12.0], size=(n, 1))
    logits = rng.standard_normal((n, VOCAB)) * scale
    logits -= logits.max(axis=1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def _result(rng: np.random.Generator, pick: str, completions: int = 64, length: int = 4) -> TokenStats:
    """A result of ``completions`` × ``length`` tokens whose tokens are chosen by ``pick``:
    'sample' (honest), 'greedy' (argmax) or 'forced' (uniformly random tokens, the attacker's choice)."""
    lps, ents, vars_, tops = [], [], [], []
    for _ in range(completions):
        logp = _positions(rng, length)
        p = np.exp(logp)
        if pick == "sample":
            tokens = [int(rng.choice(VOCAB, p=row / row.sum())) for row in p]
        elif pick == "greedy":
            tokens = [int(row.argmax()) for row in logp]
        else:
            tokens = [int(t) for t in rng.integers(0, VOCAB, size=length)]
        h = -(p * logp).sum(axis=1)
        v = (p * (-logp - h[:, None]) ** 2).sum(axis=1)
        lps.append([float(logp[i, t]) for i, t in enumerate(tokens)])
        ents.append([float(x) for x in h])
        vars_.append([float(x) for x in v])
        tops.append([float(x) for x in logp.max(axis=1)])
    return TokenStats(lps, ents, vars_, tops)


def _check(stats: SamplingStats) -> None:
    check_sampling(stats, z_low=CFG.sampling_z_low, z_high=CFG.sampling_z_high, top_z=CFG.sampling_top_z,
                   min_tokens=CFG.sampling_min_tokens, temperature=1.0)


def test_honest_samples_pass_and_z_is_standard_normal() -> None:
    rng = np.random.default_rng(7)
    zs, tops = [], []
    for _ in range(300):
        stats = sampling_stats(_result(rng, "sample"), 0.0)
        _check(stats)  # never refused
        zs.append(stats.z)
        tops.append(stats.z_top)
    for z in (np.asarray(zs), np.asarray(tops)):
        assert abs(z.mean()) < 0.2 and 0.8 < z.std() < 1.2, (z.mean(), z.std())


@pytest.mark.parametrize(("pick", "side"), [("greedy", "more predictable"), ("forced", "less likely")])
def test_greedy_and_forced_tokens_are_refused(pick: str, side: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(20):
        stats = sampling_stats(_result(rng, pick), CFG.sampling_var_floor)
        with pytest.raises(ProtocolError) as err:
            _check(stats)
        assert err.value.reason is Reason.SAMPLING_MISMATCH
        assert side in err.value.message and "full softmax at the job's temperature" in err.value.message
        if pick == "greedy":
            assert stats.z < CFG.sampling_z_low and stats.z_top > CFG.sampling_top_z and stats.top_rate == 1.0
        else:
            assert stats.z > CFG.sampling_z_high and stats.z_top < -CFG.sampling_top_z


def test_small_results_are_not_judged() -> None:
    n = CFG.sampling_min_tokens - 4
    rows = n // 4
    stats = sampling_stats(TokenStats([[-0.1] * 4] * rows, [[2.0] * 4] * rows, [[1.0] * 4] * rows,
                                      [[-0.1] * 4] * rows), CFG.sampling_var_floor)
    assert stats.n_tokens == n and stats.z < CFG.sampling_z_low
    _check(stats)  # too few tokens for z to mean anything: passes


def test_a_deterministic_policy_gives_a_finite_z_of_zero() -> None:
    """Where the policy is certain, honest and greedy agree; the variance floor keeps z finite and near 0 even
    with float rounding in the entropy."""
    n = 200
    rows = n // 4
    stats = sampling_stats(TokenStats([[-1e-7] * 4] * rows, [[2e-7] * 4] * rows, [[0.0] * 4] * rows,
                                      [[-1e-7] * 4] * rows), CFG.sampling_var_floor)
    assert stats.n_tokens == n and math.isfinite(stats.z) and abs(stats.z) < 1e-3 and abs(stats.z_top) < 1e-3
    _check(stats)
    alone = sampling_stats(TokenStats([[-1e-7]], [[2e-7]], [[0.0]], [[0.0]]), 0.0)
    assert (alone.z, alone.z_top) == (0.0, 0.0)  # no variance at all: 0


def test_z_is_the_standardised_surprisal_excess() -> None:
    stats = sampling_stats(TokenStats([[-1.0, -3.0]], [[1.5, 1.5]], [[0.5, 1.5]], [[-1.0, -0.5]]), 0.25)
    assert stats.z == pytest.approx((4.0 - 3.0) / math.sqrt(2.0 + 2 * 0.25))
    assert (stats.n_tokens, stats.mean_surprisal, stats.mean_entropy) == (2, 2.0, 1.5)
    p1, p2 = math.exp(-1.0), math.exp(-0.5)  # the first token is the likeliest, the second is not
    assert stats.z_top == pytest.approx((1 - p1 - p2) / math.sqrt(p1 * (1 - p1) + p2 * (1 - p2) + 2 * 0.25))
    assert (stats.top_rate, stats.expected_top_rate) == (0.5, pytest.approx((p1 + p2) / 2))


def test_the_reason_is_a_422_that_counts_against_the_client() -> None:
    assert HTTP_STATUS[Reason.SAMPLING_MISMATCH] == 422
    assert Reason.SAMPLING_MISMATCH.value == "sampling_mismatch"
    assert is_invalidating(Reason.SAMPLING_MISMATCH)


def test_thresholds_must_bracket_zero(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[verification]\nsampling_z_low = 3.0\n")
    with pytest.raises(ConfigError, match="sampling_z_low"):
        load_config(path)
    assert load_config(None, {"verification.sampling_check": False}).verification.sampling_check is False


def test_completion_stats_matches_logprobs_and_the_distribution(tiny_model_dir: Path) -> None:
    """completion_stats gives completion_logprobs' numbers bit for bit, and the entropy and surprisal variance
    of the tempered distribution computed directly from the logits."""
    import torch

    from shared.policy import completion_logprobs, completion_stats, load_model

    model = load_model(tiny_model_dir).eval()
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    completions = [[20, 21, 22], [23], [24, 25, 26, 27, 28]]
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            lp, mask = completion_logprobs(model, prompts, completions, temperature=temperature, pad_id=0)
            lp2, ent, var, top, mask2, margins = completion_stats(model, prompts, completions,
                                                                  temperature=temperature, pad_id=0)
            assert margins is None  # no sampling keys given
            assert torch.equal(lp, lp2) and torch.equal(mask, mask2)
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
                ids = torch.tensor([p + c])
                logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(c)].double() / temperature
                logq = torch.log_softmax(logits, -1)
                h = -(logq.exp() * logq).sum(-1)
                v = (logq.exp() * logq**2).sum(-1) - h**2
                assert torch.allclose(ent[i, : len(c)].double(), h, atol=1e-4)
                assert torch.allclose(var[i, : len(c)].double(), v, atol=1e-4)
                assert torch.allclose(top[i, : len(c)].double(), logq.max(-1).values, atol=1e-4)
                assert torch.allclose(lp[i, : len(c)].double(), logq.gather(1, torch.tensor(c)[:, None])[:, 0],
                                      atol=1e-4)


def test_shared_prompts_give_the_plain_pass_numbers(tiny_model_dir: Path) -> None:
    """GRPO groups (each prompt repeated, prompts of different lengths, completions of different lengths, one
    empty): running each prompt once and the completions on its cache gives the plain pass's logprobs, entropy,
    variance and top logprob up to float rounding, in the same rows."""
    import torch

    from shared.policy import completion_stats, load_model

    model = load_model(tiny_model_dir).eval()
    groups = {(5, 6, 7, 8): [[20, 21, 22], [23], [24, 25, 26, 27, 28], []], (9, 10): [[30, 31], [32, 33, 34], [35],
                                                                                    [36, 37, 38, 39]]}
    prompts = [list(p) for p, cs in groups.items() for _ in cs]
    completions = [c for cs in groups.values() for c in cs]
    prompts.insert(3, [40, 41, 42])  # a prompt of its own between two groups' rows
    completions.insert(3, [43, 44])
    with torch.no_grad():
        plain = completion_stats(model, prompts, completions, temperature=0.7, pad_id=0)
        shared = completion_stats(model, prompts, completions, temperature=0.7, pad_id=0, share_prompts=True)
    assert torch.equal(plain[4], shared[4])  # the same mask
    for a, b in zip(plain[:4], shared[:4], strict=True):
        assert torch.allclose(a * plain[4], b * shared[4], atol=1e-5), (a - b).abs().max()


def test_shared_prompts_give_the_plain_pass_gradients(tiny_model_dir: Path) -> None:
    """The learner's use: a loss over the completions' logprobs has the same value and the same gradient in every
    parameter whether each group's prompt runs once (its KV cache copied, gradients flowing back through it) or
    once per completion."""
    import torch

    from shared.policy import completion_logprobs, load_model

    model = load_model(tiny_model_dir)
    model.train()
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 3
    completions = [[20, 21, 22], [23], [24, 25, 26, 27], [30, 31], [32, 33, 34], [35]]
    weights = torch.tensor([0.5, -1.0, 2.0, 1.5, -0.5, 1.0])[:, None]

    def loss_and_grads(share: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logp, mask = completion_logprobs(model, prompts, completions, temperature=0.9, pad_id=0, share_prompts=share)
        loss = (logp * mask * weights).sum() / mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain = loss_and_grads(False)
    shared_loss, shared = loss_and_grads(True)
    assert torch.allclose(plain_loss, shared_loss, atol=1e-6)
    assert plain.keys() == shared.keys() and len(plain) > 10
    for name, g in plain.items():
        assert torch.allclose(g, shared[name], atol=1e-6, rtol=1e-4), name
