"""Peer row for ``bench/sync_modes.py``: Hugging Face TRL's GRPOTrainer on echo-swarm's model, task, reward and
hyper-parameters, evaluated with echo-swarm's own held-out code at the same cadence.

Why a peer: the sync-mode table compares echo-swarm with itself; a widely used GRPO implementation trained on
exactly the same problem shows whether the co-located baseline is a fair one (neither slower to learn nor
slower per step than a standard trainer on this machine).

What is matched (see ``trl_args``): the tiny model and its byte-level tokenizer loaded the way the learner
loads them, the arithmetic task's training split as the prompt pool and its reward function, the held-out
greedy accuracy on the same 512 prompts (``coordinator.engine.evaluation.greedy_accuracy``), and every learner and
sampling hyper-parameter. What cannot be matched exactly is listed in ``KNOWN_DIFFERENCES``.

    python bench/trl_peer.py --steps 40 --out bench-out/trl   # one run on its own; prints the result JSON

Needs the ``bench`` extra (``pip install -e '.[bench]'``; install trl with care not to replace torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.config import ArithmeticTaskConfig, LearnerConfig, SamplingConfig  # noqa: E402

logger = logging.getLogger(__name__)

LEARNER_THREADS = 2  # as the co-located row of bench/sync_modes.py

KNOWN_DIFFERENCES = [
    "advantage scale: TRL divides by the Bessel-corrected group std + 1e-4, echo-swarm by the population std + "
    "1e-6, so TRL's advantages are sqrt(7/8) ≈ 0.935 × ours for groups of 8; AdamW is invariant to a constant "
    "gradient scale (up to its eps 1e-8) but the grad-norm clip at 1.0 can bind at different steps",
    "prompt order: TRL shuffles the training split once per epoch (sampling without replacement, seeded by "
    "`seed`); echo-swarm draws 8 distinct prompts per job from a hash of (seed, job number); same distribution, "
    "different prompts",
    "sampling RNG: TRL samples with transformers' generate from the global torch RNG (seeded by `seed`); "
    "echo-swarm with its own per-job torch.Generator; same distribution, different draws",
    "busy fraction: TRL's optimisation time is each step's wall time minus generation and reward scoring "
    "(forward, backward, clip, AdamW step); echo-swarm's learner times the same work but also recomputes the "
    "behaviour logprobs for verification outside it",
]


def trl_args(seed: int, steps: int, out_dir: Path, learner: LearnerConfig | None = None,
             sampling: SamplingConfig | None = None) -> dict[str, Any]:
    """Keyword arguments for ``trl.GRPOConfig`` that reproduce echo-swarm's learner (defaults of
    ``coordinator.config``). Pure: no TRL import, so the mapping can be read and checked on its own."""
    learner = learner or LearnerConfig()
    sampling = sampling or SamplingConfig()
    return {
        # optimiser: AdamW (torch defaults β=(0.9, 0.999), eps 1e-8), constant lr, no warm-up, one update per batch
        "learning_rate": learner.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
        "weight_decay": learner.weight_decay,
        "max_grad_norm": learner.max_grad_norm,
        "max_steps": steps,
        "num_iterations": 1,
        # batch: prompts_per_step groups of group_size samples, all in one optimiser step
        "num_generations": learner.group_size,
        "per_device_train_batch_size": learner.prompts_per_step * learner.group_size,
        "gradient_accumulation_steps": 1,
        # objective: clipped ratio (inert with one update per batch), no KL, token-mean over the whole batch,
        # advantages normalised within each group
        "epsilon": learner.clip_eps,
        "beta": 0.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "mask_truncated_completions": False,
        # sampling: the full softmax at the temperature, at most max_tokens new tokens
        "temperature": sampling.temperature,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "max_completion_length": sampling.max_tokens,
        # machine: float32 on CPU (TRL defaults to bf16), no activation checkpointing (TRL defaults to it)
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "seed": seed,
        "shuffle_dataset": True,
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
        # bookkeeping: nothing written or reported beyond what this bench records itself
        "output_dir": str(out_dir / "trl"),
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 10**9,
        "disable_tqdm": True,
        "log_completions": False,
    }


def run_trl(seed: int, steps: int, out_dir: Path, eval_every: int, threads: int = LEARNER_THREADS) -> dict[str, Any]:
    """Train ``steps`` optimiser steps with TRL's GRPOTrainer; evaluate held-out greedy accuracy at step 0,
    every ``eval_every`` steps and at the end. Returns the keys of ``sync_modes.measure`` that apply."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from coordinator.engine.evaluation import greedy_accuracy
    from coordinator.engine.tiny_model import ensure_tiny_model
    from coordinator.tasks.base import TaskItem
    from coordinator.tasks.builtin import ArithmeticTask
    from shared.policy import load_model, load_tokenizer

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    learner, sampling = LearnerConfig(), SamplingConfig()
    task = ArithmeticTask(ArithmeticTaskConfig())
    heldout = task.heldout[: learner.eval_size]
    model_dir = ensure_tiny_model()
    tokenizer = load_tokenizer(model_dir)  # the learner's loader: AutoTokenizer would re-tokenise differently
    model = load_model(model_dir, "cpu", "float32")
    train = Dataset.from_dict({"prompt": [it.prompt for it in task.train], "answer": [it.answer for it in task.train]})

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
        return [task.reward(TaskItem(p, a), c) for p, a, c in zip(prompts, answer, completions, strict=True)]

    evals: list[tuple[int, float, float]] = []  # (step, accuracy, seconds since t0)
    clock: dict[str, float] = {"t0": 0.0, "gen": 0.0, "busy": 0.0, "step_start": 0.0, "last_step_end": 0.0}

    def evaluate(step: int) -> None:
        acc = greedy_accuracy(model, tokenizer, task, heldout, sampling.max_tokens)
        evals.append((step, acc, time.monotonic() - clock["t0"]))
        logger.info("trl seed %d step %d: held-out greedy accuracy %.3f", seed, step, acc)

    class Timed(GRPOTrainer):  # type: ignore[misc]
        """Separates generation + reward scoring from optimisation in each step's wall time."""

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            g0 = time.monotonic()
            try:
                return super()._generate_and_score_completions(*a, **kw)
            finally:
                clock["gen"] += time.monotonic() - g0

    class Cadence(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock["step_start"], clock["gen"] = time.monotonic(), 0.0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.monotonic()
            clock["busy"] += now - clock["step_start"] - clock["gen"]
            clock["last_step_end"] = now
            step = state.global_step
            if step >= steps or (eval_every and step % eval_every == 0):
                evaluate(step)

    trainer = Timed(model=model, reward_funcs=reward, args=GRPOConfig(**trl_args(seed, steps, out_dir, learner,
                                                                                 sampling)),
                    train_dataset=train, processing_class=tokenizer, callbacks=[Cadence()])
    if trainer.model is not model:
        raise RuntimeError("TRL wrapped the model; evaluate the trainer's model instead")
    clock["t0"] = time.monotonic()
    evaluate(0)
    trainer.train()
    wall = clock["last_step_end"] - clock["t0"]
    samples_per_step = learner.prompts_per_step * learner.group_size
    result = {
        "accuracy_by_samples": [[s * samples_per_step, acc] for s, acc, _ in evals],
        "accuracy_by_wall_s": [[at, acc] for _, acc, at in evals],
        "eval_before": evals[0][1],
        "eval_after": evals[-1][1],
        "improvement": evals[-1][1] - evals[0][1],
        "wall_s": wall,
        "learner_busy_fraction": clock["busy"] / wall if wall > 0 else 0.0,
        "steps": steps,
        "seed": seed,
    }
    (out_dir / "trl_peer.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0, help="seeds TRL's prompt order, sampling and initialisation")
    ap.add_argument("--steps", type=int, default=200, help="optimiser steps (16 prompts × 8 samples each)")
    ap.add_argument("--eval-every", type=int, default=25, help="held-out evaluation every N steps")
    ap.add_argument("--threads", type=int, default=LEARNER_THREADS, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=Path("bench-out/trl"), help="writes trl_peer.json here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install 'trl>=1.16,<2' --no-deps, then its missing dependencies "
              "(see the 'bench' extra in pyproject.toml) so that torch is not replaced", file=sys.stderr)
        return 2
    print(json.dumps(run_trl(args.seed, args.steps, args.out, args.eval_every, args.threads), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
