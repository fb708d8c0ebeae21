"""The learner's checkpoints: its trainable weights and optimizer state handed to the publisher to write, and
restored from a checkpoint on resume (coordinator.publish.checkpoints has the files, coordinator.roles.resume which
one to read).

Split from coordinator/engine/learner.py (issue 33): a checkpoint is the training state only (the frozen base of a
LoRA run comes from the model folder), written without a copy — the publisher is handed references and the next
optimizer update waits for them (coordinator.engine.live_gates) — or, on FSDP ranks, as every rank's shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.engine import fsdp
from coordinator.engine.live_gates import LiveGates
from coordinator.publish.checkpoints import CheckpointState, ShardedCheckpoint

if TYPE_CHECKING:
    from torch import Tensor
    from torch.optim.optimizer import StateDict  # torch's own open shape of an optimizer's state

    from coordinator.engine.fsdp import Ranks


class LearnerCheckpoints:
    """Checkpoints of ``model``'s trainable weights and ``optimizer``'s state, on ``ranks`` (None: one device)."""

    def __init__(self, model: Any, optimizer: Any, *, ranks: Ranks | None, device: str, gates: LiveGates) -> None:
        self.model = model
        self.optimizer = optimizer
        self.ranks = ranks
        self.device = device
        self.gates = gates

    def live_state(self, version: int) -> CheckpointState:
        """References to the trainable weights and the optimizer state at ``version``, for the publisher to write
        while the next step's forward and backward passes run; that step's optimizer update waits until the
        publisher calls ``release``, so nothing is copied."""
        release = self.gates.lend_for_checkpoint().set
        weights = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        return CheckpointState(version, weights, self.optimizer.state_dict(), release)

    def sharded_state(self, version: int, staging: Path, world_size: int) -> CheckpointState:
        """On FSDP ranks: every rank writes its shards into ``staging`` now (torch.distributed.checkpoint); the
        publisher then only completes the checkpoint (coordinator.publish.checkpoints)."""
        with_optimizer = fsdp.save_checkpoint(self.model, self.optimizer, staging)
        return CheckpointState(version, {}, {}, lambda: None,
                               sharded=ShardedCheckpoint(str(staging), world_size, with_optimizer))

    def restore_sharded(self, folder: Path, with_optimizer: bool) -> None:
        """Every rank reads its shards of a checkpoint written on as many ranks."""
        fsdp.load_checkpoint(self.model, self.optimizer, Path(folder), with_optimizer)

    def restore(self, weights: dict[str, Tensor], optimizer: StateDict, version: int) -> None:
        """A single-device checkpoint's trainable weights and optimizer state, copied into the live ones."""
        import torch

        if self.ranks is not None:
            raise ValueError(f"the checkpoint of version {version} was written by a learner on one device without "
                             f"FSDP; resume with learner.world_size = 1 and learner.fsdp unset")
        params = dict(self.model.named_parameters())
        unknown = sorted(set(weights) - set(params))
        if unknown:
            raise ValueError(f"the checkpoint of version {version} has weights this model lacks: {unknown[:3]}")
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))
        self.optimizer.load_state_dict(optimizer)

    def load_optimizer(self, path: Path) -> bool:
        """A single-device optimizer state saved with torch.save; False where there is none."""
        import torch

        if not path.exists():
            return False
        if self.ranks is not None:
            raise ValueError(f"{path} is a single-device optimizer state; resume this run with learner.world_size "
                             f"= 1 and learner.fsdp unset")
        self.optimizer.load_state_dict(torch.load(path, weights_only=True, map_location=self.device))
        return True
