"""The learner's memory (issue 23; bench/learner_memory.py measures it at 0.5 B): a tied embedding's gradients
are summed in place with the same result as autograd's own sum, the gradients are freed after the optimizer step,
and AdamW runs fused on a CPU (no per-tensor temporaries)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine.learner import Learner, Sample


def _learner(folder: Path) -> Learner:
    torch.manual_seed(0)
    return Learner(folder, ModelConfig(device="cpu"), LearnerConfig(lr=1e-3, threads=1), temperature=1.0)


def _batch(learner: Learner) -> list[Sample]:
    rng = random.Random(0)
    eos = learner.stop_ids[0]  # the tiny model's padding id too: its rows get no lookup gradient
    prompts = [[rng.randrange(32, 127) for _ in range(5)] for _ in range(2)]
    out = []
    for i in range(6):
        completion = [rng.randrange(32, 127) for _ in range(3 + i % 3)] + [eos]
        out.append(Sample(prompts[i % 2] + [eos] * (i % 2), completion, [-1.0] * len(completion),
                          [-1.0] * len(completion), advantage=1.0 if i % 2 else -1.0))
    return out


def _gradients(learner: Learner) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}

    def keep(*_: object) -> None:
        grads.update({k: p.grad.detach().clone() for k, p in learner.model.named_parameters() if p.grad is not None})

    learner.optimizer.register_step_pre_hook(keep)
    learner.train_step(_batch(learner))
    return grads


def test_the_tied_embeddings_gradient_is_autograds_own_and_the_step_frees_the_gradients(tiny_model_dir: Path) -> None:
    summed = _learner(tiny_model_dir)
    assert summed.passes.tied is not None and summed.model.config.tie_word_embeddings
    plain = _learner(tiny_model_dir)
    assert plain.passes.tied is not None
    plain.passes.tied.remove()  # autograd's own sum of the gradients of every use of the weight
    ours, reference = _gradients(summed), _gradients(plain)
    assert ours.keys() == reference.keys() and "model.embed_tokens.weight" in ours
    for name, grad in reference.items():
        assert torch.allclose(ours[name], grad, atol=1e-6, rtol=1e-5), name
    assert bool(ours["model.embed_tokens.weight"][summed.stop_ids[0]].any())  # the output layer's part is there
    assert all(p.grad is None for p in summed.model.parameters())  # freed after the step
    assert summed.optimizer.param_groups[0]["fused"] is True


def test_sampling_and_recomputes_leave_the_lookup_alone(tiny_model_dir: Path) -> None:
    learner = _learner(tiny_model_dir)
    batch = _batch(learner)
    learner.recompute([s.prompt_ids for s in batch], [s.completion_ids for s in batch])  # under no_grad
    assert all(p.grad is None for p in learner.model.parameters())
    assert learner.passes.tied is not None


def test_the_step_reports_each_sampling_class_distance_from_the_policy(tiny_model_dir: Path) -> None:
    """policy_mismatch_kl: per class that sampled the batch's rollouts, the k3 estimate of KL(π_b ‖ πθ) over its
    tokens — 0 for rollouts whose π_b is the policy's own logprobs, positive for one whose π_b differs (a quantised
    llama.cpp client's recompute)."""
    from shared.policy import completion_logprobs

    learner = _learner(tiny_model_dir)
    eos = learner.stop_ids[0]
    prompt, completion = [81, 58, 32, 50, 43, 50, 61, 32, 65, 58], [52, 53, eos]
    with torch.no_grad():
        lp, _ = completion_logprobs(learner.model, [prompt], [completion], temperature=1.0, pad_id=eos)
    own = lp[0, : len(completion)].tolist()
    shifted = [x - 0.3 for x in own]  # another model's logprobs of the same tokens
    metrics = learner.train_step([Sample(prompt, completion, own, own, 1.0),
                                  Sample(prompt, completion, shifted, shifted, -1.0, source="llama-q4_K_M")])
    mismatch = metrics["policy_mismatch_kl"]
    assert set(mismatch) == {"torch", "llama-q4_K_M"}
    assert abs(mismatch["torch"]) < 1e-6
    assert abs(mismatch["llama-q4_K_M"] - (math.exp(0.3) - 0.3 - 1)) < 1e-5  # k3 at log r = 0.3 on every token
