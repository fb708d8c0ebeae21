"""The GRPO learner: the trained policy and the operations the learner role and the FSDP ranks call on it.

It composes collaborators, each handed what it uses (issue 33 split it):

- coordinator.engine.objective: the loss per token and its off-policy corrections (the module docstring has the
  formulas), and :class:`Sample`, what a step trains on;
- coordinator.engine.passes: the batch through the model — micro-batches across ranks, token logprobs, masks and
  π_b, the output layer's plan;
- coordinator.engine.policy_step: the optimizer and one step (backward passes, clipping, the update);
- coordinator.engine.snapshot_export: a version's files for the publisher;
- coordinator.engine.learner_checkpoints: checkpoints written and restored;
- coordinator.engine.live_gates: what the optimizer update waits for while the publisher writes live tensors.

What stays here is the model's making (the folder's weights, a LoRA adapter, FSDP's shards), the version counter
and the operations rank 0 *leads* (coordinator.engine.fsdp: the other ranks call the same method by name on their
own Learner, so those names are this class's). The learner's model is touched only by the learner's thread;
verification, publication and evaluation read published snapshots or copies handed over after a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine import fsdp, lora
from coordinator.engine.evaluation import greedy_accuracy, pad_id
from coordinator.engine.fsdp import single_rank
from coordinator.engine.learner_checkpoints import LearnerCheckpoints
from coordinator.engine.live_gates import LiveGates
from coordinator.engine.objective import OWN_CLASS, Sample, on_policy, second_moment_keep, token_objective
from coordinator.engine.passes import MICRO_BATCH, TokenPasses
from coordinator.engine.policy_step import PolicyStep, make_optimizer
from coordinator.engine.snapshot_export import SnapshotExport
from coordinator.publish.checkpoints import CheckpointState
from coordinator.publish.snapshots import SnapshotFiles
from coordinator.tasks.base import Task, TaskItem
from shared.policy import load_model, load_tokenizer, pick_device, stop_token_ids

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim.optimizer import StateDict  # torch's own open shape of an optimizer's state

    from coordinator.engine.fsdp import Ranks

# the objective's and the passes' names, where the learner's callers have always found them
__all__ = ["MICRO_BATCH", "OWN_CLASS", "Learner", "LearnerDescription", "Sample", "on_policy", "second_moment_keep",
           "token_objective"]


class LearnerDescription(TypedDict):
    """What the learner role's report says of its model (coordinator.roles.learner)."""

    parameters: int
    device: str
    vocab_size: int


def _load_policy(model_dir: Path, adapter_dir: Path | None, lora_on: bool, device: str, dtype: str) -> Any:
    """The policy to train: the model folder's, or a LoRA version's base (its adapter is loaded once wrapped), or
    — LoRA switched off mid-run — that base with the adapter merged."""
    if adapter_dir is not None and not lora_on:
        return lora.load_version_model(model_dir, adapter_dir, device, dtype)
    if adapter_dir is not None:
        return lora.load_base_model(model_dir, device, dtype)
    return load_model(model_dir, device, dtype)


def _trainable_model(model_dir: Path, adapter_dir: Path | None, cfg: LearnerConfig, ranks: Ranks | None, device: str,
                     dtype: str) -> Any:
    """The policy as trained, in train mode: loaded, with activation checkpointing where configured, wrapped in
    LoRA adapters (a resumed version's loaded into them) and sharded over the FSDP ranks."""
    lora_on = cfg.lora_rank > 0
    model = _load_policy(model_dir, adapter_dir, lora_on, device, dtype)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_on:
        model = lora.wrap(model, cfg)
        if adapter_dir is not None:
            lora.load_adapter(model, adapter_dir)
    if ranks is not None:  # every rank holds the whole model until here; now each keeps its shards
        if lora_on and adapter_dir is None:  # fresh adapters are random: every rank takes rank 0's
            fsdp.from_leader(ranks, [p for p in model.parameters() if p.requires_grad])
        fsdp.shard(model, ranks, cfg.mixed_precision)
    model.train()
    return model


class Learner:
    def __init__(self, model_dir: Path, model_cfg: ModelConfig, cfg: LearnerConfig, temperature: float,
                 gguf: str | Sequence[str] = "off", ranks: Ranks | None = None) -> None:
        """``gguf``: the precisions of the GGUF forms published with every version (snapshots.offered(), the
        default first; one name, or "off" / () for none). ``ranks``: this process's place among the learner's FSDP
        ranks (coordinator.engine.fsdp), None on one device without FSDP. On rank 0 of several, the other ranks
        build the same learner from ``model_dir``."""
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        fsdp.lead(ranks, "init", str(model_dir), cfg.model_dump(mode="json"))
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.temperature = temperature
        self.ranks = ranks
        self.device = ranks.device if ranks is not None else pick_device(model_cfg.device)
        gguf = ((gguf,) if gguf != "off" else ()) if isinstance(gguf, str) else tuple(gguf)
        self.lora = cfg.lora_rank > 0
        # a LoRA version folder (resuming a run) holds an adapter: the model is its base plus that adapter
        adapter_dir = Path(model_dir) if lora.is_adapter_folder(Path(model_dir)) else None
        if adapter_dir is not None:
            model_dir = lora.base_folder_for(adapter_dir)
        self.tokenizer = load_tokenizer(model_dir)
        dtype = "bfloat16" if cfg.precision == "bf16" else model_cfg.dtype
        self.model = _trainable_model(Path(model_dir), adapter_dir, cfg, ranks, self.device, dtype)
        self.pad_id = pad_id(self.tokenizer)
        # each GRPO group's prompt runs once per micro-batch, its KV cache copied to the group's completions (a
        # group repeats its prompt group_size times). Not where the cache is not a plain one: activation
        # checkpointing turns it off, peft's wrapper hides its name, FSDP ranks must all run the same passes
        self.passes = TokenPasses(self.model, ranks=ranks, lora=self.lora, temperature=temperature,
                                  pad_id=self.pad_id,
                                  share_prompts=not (cfg.activation_checkpointing or self.lora or ranks is not None))
        self.stop_ids = stop_token_ids(self.tokenizer)
        if not self.stop_ids:
            raise ValueError(f"the tokenizer in {model_dir} defines no end-of-sequence token; set eos_token in its "
                             f"tokenizer_config.json so completions can stop")
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        gates = LiveGates()
        self.optimizer: Any = make_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg,
                                             fused=ranks is None and torch.device(self.device).type in ("cpu", "cuda"))
        self.step = PolicyStep(self.model, self.optimizer, self.passes, cfg, ranks=ranks, device=self.device,
                               gates=gates)
        self.export = SnapshotExport(self.model, self.tokenizer, Path(model_dir), gguf=gguf, lora=self.lora,
                                     ranks=ranks, gates=gates)
        self.checkpoints = LearnerCheckpoints(self.model, self.optimizer, ranks=ranks, device=self.device, gates=gates)
        self.model_version = 0

    # -- prompts ------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- the current policy's logprobs (benches and tests; results are verified by coordinator.engine.verifier) ------
    def recompute(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Logprobs of each completion token under the learner's current weights, no gradient."""
        single_rank(self.ranks, "Learner.recompute")
        return self.passes.recompute(prompts, completions)

    # -- training (led: the other ranks step too) -----------------------------------------------------------
    def train_step(self, samples: list[Sample]) -> dict[str, float | dict[str, float]]:
        """One GRPO step on ``samples`` (coordinator.engine.policy_step); the learner is then one version on."""
        fsdp.lead(self.ranks, "train_step", samples)
        metrics = self.step.run(samples)
        self.model_version += 1
        return metrics

    # -- publication (coordinator.publish.publisher; coordinator.engine.snapshot_export) ------------------------
    def save_model(self, folder: Path) -> None:
        """Write a version: the Hugging Face folder, plus its GGUF forms (one per offered precision)."""
        single_rank(self.ranks, "Learner.save_model (the publisher's snapshot_files gathers the shards)")
        self.export.save_model(folder)

    def publish_dtype(self, configured: str) -> str:
        """The dtype snapshots are written in: ``snapshots.dtype``, where "training" means the model's own."""
        return self.export.publish_dtype(configured)

    def snapshot_files(self, dtype: str = "training") -> SnapshotFiles:
        """On the learner thread, right after a step: what the publisher needs to write this version while the
        learner goes on training (led: on FSDP ranks every rank gathers the shards, rank 0 keeps them)."""
        fsdp.lead(self.ranks, "snapshot_files", dtype)
        return self.export.snapshot_files(dtype)

    # -- checkpoints (coordinator.publish.checkpoints; coordinator.engine.learner_checkpoints) --------------------
    def checkpoint_state(self, staging: Path | None = None) -> CheckpointState:
        """The trainable weights and the optimizer state at this version, for the publisher to write: references
        on one device (the next optimizer update waits for them); on FSDP ranks every rank writes its shards into
        ``staging`` now (led), and the publisher only completes the checkpoint."""
        if self.ranks is None:
            return self.checkpoints.live_state(self.model_version)
        if staging is None:
            raise ValueError("a sharded checkpoint needs a staging folder")
        fsdp.lead(self.ranks, "checkpoint_state", staging)
        return self.checkpoints.sharded_state(self.model_version, staging, self.ranks.world_size)

    def load_sharded_checkpoint(self, folder: Path, version: int, world_size: int, with_optimizer: bool) -> None:
        """Restore a sharded checkpoint (written on ``world_size`` ranks) on every rank; then at ``version``."""
        mine = self.ranks.world_size if self.ranks is not None else 1
        if self.ranks is None or world_size != mine:
            raise ValueError(f"the checkpoint of version {version} was written by a learner on {world_size} FSDP "
                             f"ranks and this learner has {mine if self.ranks is not None else 'no FSDP ranks'}; "
                             f"resume with learner.world_size = {world_size} (the run's own setting)")
        fsdp.lead(self.ranks, "load_sharded_checkpoint", folder, version, world_size, with_optimizer)
        self.checkpoints.restore_sharded(folder, with_optimizer)
        self.model_version = version

    def load_checkpoint(self, weights: dict[str, Tensor], optimizer: StateDict, version: int) -> None:
        """Restore a checkpoint's trainable weights and optimizer state; the learner is then at ``version``."""
        self.checkpoints.restore(weights, optimizer, version)
        self.model_version = version

    def load_optimizer(self, path: Path) -> bool:
        return self.checkpoints.load_optimizer(path)

    def evaluate(self, task: Task, items: list[TaskItem], max_tokens: int) -> float:
        single_rank(self.ranks, "Learner.evaluate (the verifiers evaluate published versions)")
        return greedy_accuracy(self.model, self.tokenizer, task, items, max_tokens)

    def describe(self) -> LearnerDescription:
        n = sum(p.numel() for p in self.model.parameters())
        return {"parameters": n, "device": self.device, "vocab_size": self.vocab_size}
