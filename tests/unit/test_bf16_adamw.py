"""learner.precision = "bf16" (coordinator.engine.bf16_adamw): stochastic rounding is unbiased, one step brackets
torch's float32 AdamW, small updates accumulate as in float32 where round-to-nearest loses them, every bit follows
from the seed and the optimizer state (a checkpoint replays exactly), and the config refuses what it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.config import ConfigError, LearnerConfig, ModelConfig, load_config
from coordinator.engine import bf16_adamw
from coordinator.engine.bf16_adamw import StochasticBf16AdamW, round_stochastically


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above each float32 value (equal when it is representable)."""
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)  # towards zero
    carry = torch.where((bits & 0xFFFF) != 0, 65536, 0).to(torch.int32)
    up = ((bits & -65536) + carry).view(torch.float32)  # away from zero
    return torch.minimum(down, up), torch.maximum(down, up)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 20, generator=gen) * 0.02
    lo, hi = _neighbours(x.clone())
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_stochastically(out, x.clone(), noise)
    got = out.float()
    assert bool(((got == lo) | (got == hi)).all())
    ulp = (hi - lo)[hi != lo]
    err = (got - x)[hi != lo]
    # each error is at most one place, and they cancel: the mean is ~0 (standard error ≈ ulp / √(6n))
    assert float((err.abs() <= ulp).float().mean()) == 1.0
    assert abs(float((err / ulp).mean())) < 5 / (6 * err.numel()) ** 0.5 * 2
    nearest = x.to(torch.bfloat16).float()
    assert not torch.equal(got, nearest)  # not round-to-nearest


def _pair(n: int, lr: float, decay: float = 0.0, seed: int = 0
          ) -> tuple[torch.nn.Parameter, torch.nn.Parameter, StochasticBf16AdamW, torch.optim.AdamW]:
    """The same bfloat16 start as a bf16 parameter with StochasticBf16AdamW and a float32 one with torch's AdamW."""
    gen = torch.Generator().manual_seed(seed)
    start = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    p16 = torch.nn.Parameter(start.clone())
    p32 = torch.nn.Parameter(start.float())
    return p16, p32, StochasticBf16AdamW([p16], lr=lr, weight_decay=decay, seed=seed), \
        torch.optim.AdamW([p32], lr=lr, weight_decay=decay)


def test_each_step_brackets_torch_adamw_from_the_same_state() -> None:
    """From the same weights and moments (bfloat16 values, exact in float32), torch's float32 AdamW step lands
    between two bfloat16 values; the bf16 step stores one of those two, for the weights and both moments."""
    import copy

    n = 3 * bf16_adamw.CHUNK // 2 + 7  # two chunks, the second partial
    p16, _, opt16, _ = _pair(n, lr=1e-3, decay=0.01)
    for step in range(3):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(5 + step)).to(torch.bfloat16)
        ref = torch.nn.Parameter(p16.detach().float())
        ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
        ref_opt.load_state_dict(copy.deepcopy(opt16.state_dict()))  # torch casts the moments to float32
        p16.grad, ref.grad = grad.clone(), grad.float()
        opt16.step()
        ref_opt.step()
        mine, theirs = opt16.state[p16], ref_opt.state[ref]
        for got, want in ((p16, ref), (mine["exp_avg"], theirs["exp_avg"]), (mine["exp_avg_sq"], theirs["exp_avg_sq"])):
            lo, hi = _neighbours(want.detach().clone())
            assert bool(((got.detach().float() == lo) | (got.detach().float() == hi)).all()), step
    state = opt16.state_dict()["state"][0]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    assert int(state["step"]) == 3


def test_small_updates_add_up_as_in_float32_where_round_to_nearest_loses_them() -> None:
    """lr 1e-5 on weights of ~0.02 (bfloat16's spacing there is 6e-5 to 1.2e-4): 300 steps of a constant gradient
    sign move float32 weights by ~3e-3; stochastic rounding moves them the same on average, round-to-nearest
    bfloat16 (torch's AdamW over bf16 weights) barely at all."""
    n = 1 << 16
    p16, p32, opt16, opt32 = _pair(n, lr=1e-5)
    nearest = torch.nn.Parameter(p16.detach().clone())
    opt_nearest = torch.optim.AdamW([nearest], lr=1e-5, weight_decay=0.0)
    start = p32.detach().clone()
    grad = torch.randn(n, generator=torch.Generator().manual_seed(9))
    for _ in range(300):
        p16.grad, p32.grad, nearest.grad = grad.to(torch.bfloat16), grad.clone(), grad.to(torch.bfloat16)
        opt16.step()
        opt32.step()
        opt_nearest.step()
    moved32 = (p32.detach() - start).abs().mean()
    moved16 = (p16.detach().float() - start).abs().mean()
    moved_nearest = (nearest.detach().float() - start).abs().mean()
    assert float(moved32) == pytest.approx(3e-3, rel=0.05)
    assert float(moved16) == pytest.approx(float(moved32), rel=0.03)
    assert float(moved_nearest) < 0.2 * float(moved32)
    # without bias in the direction of travel; element by element the bf16 weights random-walk around the float32
    # ones (each rounding adds an independent error below one place, 1.2e-4 here: √300 × a third of it ≈ 7e-4)
    gap = p16.detach().float() - p32.detach()
    direction = torch.sign(p32.detach() - start)
    assert abs(float((gap * direction).mean())) < 0.02 * float(moved32)
    assert float(gap.abs().mean()) < 7e-4


def test_the_same_seed_gives_the_same_bits_and_a_state_dict_resumes_exactly() -> None:
    n = 5000
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in range(6)]

    def run(opt: StochasticBf16AdamW, p: torch.Tensor, steps: list[torch.Tensor]) -> None:
        for g in steps:
            p.grad = g.clone()
            opt.step()

    a, _, opt_a, _ = _pair(n, lr=1e-3, decay=0.01, seed=3)
    run(opt_a, a, grads)
    b, _, opt_b, _ = _pair(n, lr=1e-3, decay=0.01, seed=3)
    run(opt_b, b, grads[:2])
    saved_weights, saved_state = b.detach().clone(), opt_b.state_dict()
    torch.save(saved_state, "/dev/null")  # what the checkpoint writes is plain tensors
    c = torch.nn.Parameter(saved_weights)
    opt_c = StochasticBf16AdamW([c], lr=1e-3, weight_decay=0.01, seed=3)
    opt_c.load_state_dict(saved_state)
    run(opt_c, c, grads[2:])
    assert torch.equal(a.detach(), c.detach())
    assert torch.equal(opt_a.state_dict()["state"][0]["exp_avg_sq"], opt_c.state_dict()["state"][0]["exp_avg_sq"])
    d, _, opt_d, _ = _pair(n, lr=1e-3, decay=0.01, seed=3)
    opt_d.seed = 4
    run(opt_d, d, grads)
    assert not torch.equal(a.detach(), d.detach())  # the rounding noise follows the seed


def test_a_float32_checkpoint_resumes_with_bfloat16_moments() -> None:
    p32 = torch.nn.Parameter(torch.randn(100))
    opt32 = torch.optim.AdamW([p32], lr=1e-3)
    p32.grad = torch.randn(100)
    opt32.step()
    p16 = torch.nn.Parameter(p32.detach().to(torch.bfloat16))
    opt16 = StochasticBf16AdamW([p16], lr=1e-3)
    opt16.load_state_dict(opt32.state_dict())
    assert opt16.state[p16]["exp_avg"].dtype == torch.bfloat16
    p16.grad = torch.randn(100).to(torch.bfloat16)
    opt16.step()
    assert int(opt16.state[p16]["step"]) == 2


def test_float32_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="bfloat16 parameters"):
        StochasticBf16AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)


def test_config_refuses_bf16_precision_on_fsdp_or_lora_and_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match="learner.mixed_precision = 'bf16'"):
        load_config(None, {"learner.precision": "bf16", "learner.world_size": 2})
    with pytest.raises(ConfigError, match="learner.precision = 'float32'"):
        load_config(None, {"learner.precision": "bf16", "learner.lora_rank": 4})
    with pytest.raises(ConfigError, match="learner.precision"):
        load_config(None, {"learner.precision": "fp8"})
    assert load_config(None, {"learner.precision": "bf16"}).learner.precision == "bf16"


def test_a_bf16_learner_trains_bfloat16_weights_and_publishes_them_as_they_are(tiny_model_dir: Path) -> None:
    from coordinator.engine.learner import Learner, Sample

    learner = Learner(tiny_model_dir, ModelConfig(device="cpu"), LearnerConfig(precision="bf16", lr=1e-2, threads=1),
                      1.0, gguf="off")
    assert {p.dtype for p in learner.model.parameters()} == {torch.bfloat16}
    assert learner.publish_dtype("training") == "bfloat16"
    prompt = learner.encode("Q: 1+2= A:")
    comps = [[40, 41, 42], [43, 44], [45], [46, 47]]
    old = learner.recompute([prompt] * 4, comps)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    metrics = learner.train_step([Sample(prompt, c, o, o, a) for c, o, a in zip(comps, old, [1.0, -1.0, 1.0, -1.0],
                                                                                  strict=True)])
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in learner.model.named_parameters())
    state = learner.optimizer.state_dict()["state"]
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.bfloat16}
    assert all(p.grad is None for p in learner.model.parameters())  # freed as applied: not held past the step


def test_the_disk_preflight_counts_bf16_snapshots_of_a_bf16_learner(tiny_model_dir: Path) -> None:
    from coordinator.launch.preflight import model_weight_count, version_bytes

    weights = model_weight_count(tiny_model_dir)
    f32 = load_config(None, {"snapshots.gguf": "off"})
    bf16 = load_config(None, {"snapshots.gguf": "off", "learner.precision": "bf16"})
    assert version_bytes(f32, tiny_model_dir) == 4 * weights
    assert version_bytes(bf16, tiny_model_dir) == 2 * weights  # snapshots.dtype "training" is the learner's bf16
