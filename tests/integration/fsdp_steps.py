"""Learner steps on a fixed batch, run as its own process by tests/integration/test_fsdp_learner.py.

``python -m tests.integration.fsdp_steps OUT MODEL_DIR WORLD_SIZE``: with WORLD_SIZE 1 the learner on one device
without FSDP (the reference); with N > 1 this process is rank 0 of an FSDP learner and starts the other ranks
itself (coordinator.launch.ranks.start, as the learner role does), which follow it through every operation. WORLD_SIZE
``bf16``: FSDP over one device with bf16 mixed precision and activation checkpointing, full fine-tuning only.

It writes into OUT: ``metrics.json`` (each step's loss and grad norm) and, after each step, the published form of
the weights (the snapshot files the publisher would write: gathered from the shards on N ranks): ``full-1``,
``full-2`` (full fine-tuning, two steps), ``m2po-1`` (one step with the m2po correction), ``lora-1``, ``lora-2`` (LoRA). On N ranks also ``full-2-resumed`` and
``lora-2-resumed``: a fresh learner that loads the sharded checkpoint written after step 1 and takes step 2 again.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig, LearnerConfig


def batches(tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """Step 1: nine samples (odd, so the ranks' shares differ); step 2: one sample (a rank gets none)."""
    from coordinator.engine.learner import Sample

    rng = random.Random(7)
    out = []
    for n in (9, 1):
        samples = []
        for i in range(n):
            a, b = rng.randint(1, 60), rng.randint(1, 30)
            prompt = tokenizer.encode(f"{a}+{b}=")
            completion = tokenizer.encode(f" {a + b + rng.choice((0, 0, 1))}")[: rng.randint(1, 4)]
            old = [-1.0 - 0.5 * rng.random() for _ in completion]
            samples.append(Sample(prompt, completion, old, old, rng.choice((-1.0, 1.0)) * (0.5 + i / 10)))
        out.append(samples)
    return out[0], out[1]


OFFSETS = (0.0, 0.02, 0.6, 1.2)  # behaviour logprobs this far from the model's own, in turn


def near_policy(model_dir: Path, samples: list[Any]) -> list[Any]:
    """``samples`` with behaviour logprobs the model's own plus OFFSETS in turn: the m2po step then keeps the near
    tokens and masks the far ones whatever the model (batches()'s fixed -1.0 to -1.5 lay more than m2_threshold from
    every token of some builds of the tiny model, and the step masked all of them). The model's own logprobs are
    read by plain transformers, alike in every process."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out, k = [], 0
    for s in samples:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0].float(), -1)
        n, old = len(s.prompt_ids), []
        for j, token in enumerate(s.completion_ids):
            old.append(float(logp[n - 1 + j, token]) + OFFSETS[k % len(OFFSETS)])
            k += 1
        out.append(dataclasses.replace(s, old_logprobs=old, behaviour_logprobs=old))
    return out


def write(learner: Any, folder: Path) -> None:
    """The snapshot files of the learner's current version, as the publisher writes them."""
    learner.snapshot_files("float32").write_whole(folder)


def main(out: Path, model_dir: Path, world: str) -> None:
    import torch

    from coordinator.engine import fsdp
    from coordinator.engine.learner import Learner
    from coordinator.launch import ranks as rank_start
    from coordinator.publish.checkpoints import CheckpointStore

    mixed = world == "bf16"
    world_size = 1 if mixed else int(world)
    learner_cfg = LearnerConfig(lr=1e-3, world_size=world_size, checkpoint_every_steps=1, fsdp=mixed or None,
                                mixed_precision="bf16" if mixed else "off", activation_checkpointing=mixed)
    config = CoordinatorConfig(run_dir=out / "run", learner=learner_cfg, model={"device": "cpu"})
    ranks = rank_start.start(config) if learner_cfg.sharded else None
    metrics: dict[str, list[float]] = {}

    def learner(cfg: LearnerConfig) -> Learner:
        made = Learner(model_dir, config.model, cfg, 1.0, ranks=ranks)
        # the reference computes the passes the ranks compute: the output layer whole, not a vocabulary slice at a
        # time (engine.head, the same numbers up to float rounding, which AdamW's first step turns into sign flips
        # of near-zero gradients)
        made.passes.stream_head = False
        return made

    try:
        full = learner(learner_cfg)
        first, second = batches(full.tokenizer)
        checkpoints = CheckpointStore(out / "checkpoints")
        losses = []
        for step, batch in ((1, first), (2, second)):
            m = full.train_step(batch)
            losses.append([m["loss"], m["grad_norm"]])
            write(full, out / f"full-{step}")
            if mixed:
                break
            if step == 1 and ranks is not None:
                checkpoints.write(full.checkpoint_state(checkpoints.staging(full.model_version)), 0.0)
        metrics["full"] = losses
        if mixed:
            return
        if ranks is not None:  # a restarted learner: the sharded checkpoint of version 1, then step 2 again
            resumed = learner(learner_cfg)
            info = checkpoints.info(1)
            resumed.load_sharded_checkpoint(checkpoints.folder(1), 1, info["world_size"], info["optimizer"])
            metrics["resumed"] = [[resumed.train_step(second)["loss"], 0.0]]
            write(resumed, out / "full-2-resumed")
        # the m2po correction: its mask chosen over both ranks' tokens (gathered on rank 0) as over the one device's
        m2po = learner(learner_cfg.model_copy(update={"correction": "m2po"}))
        m = m2po.train_step(near_policy(model_dir, first))
        metrics["m2po"] = [[m["loss"], m["m2po_masked_fraction"]]]
        write(m2po, out / "m2po-1")
        lora_cfg = learner_cfg.model_copy(update={"lora_rank": 4, "lr": 1e-2})
        torch.manual_seed(0)  # the same random adapters as the reference run (rank 0's reach every rank)
        adapted = learner(lora_cfg)
        lora_checkpoints = CheckpointStore(out / "lora-checkpoints")
        metrics["lora"] = [[adapted.train_step(first)["loss"], 0.0]]
        write(adapted, out / "lora-1")
        if ranks is not None:
            lora_checkpoints.write(adapted.checkpoint_state(lora_checkpoints.staging(1)), 0.0)
        metrics["lora"].append([adapted.train_step(second)["loss"], 0.0])
        write(adapted, out / "lora-2")
        if ranks is not None:  # the adapter and its optimizer state from the sharded checkpoint, then step 2
            resumed = learner(lora_cfg)
            resumed.load_sharded_checkpoint(lora_checkpoints.folder(1), 1, 2, True)
            resumed.train_step(second)
            write(resumed, out / "lora-2-resumed")
    finally:
        if ranks is not None:
            fsdp.stop(ranks)
        (out / "metrics.json").write_text(json.dumps(metrics))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
