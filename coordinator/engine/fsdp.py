"""The learner on N ranks: torch.distributed process groups and FSDP2 (``fully_shard``) over the model.

Why this shape: only rank 0 runs the learner role (store, publication, checkpoints' bookkeeping); ranks 1…N-1 only
compute. Every operation that touches the sharded model is a collective, so all ranks must run the same
operations in the same order. Rank 0's :class:`coordinator.engine.learner.Learner` therefore *leads*: before such an
operation it broadcasts its name and arguments (the batch included) with ``broadcast_object_list``, and every other
rank runs :func:`coordinator.launch.ranks.follow`, which receives each one and calls the same method on its own
Learner. Nothing else
passes between the ranks, so a follower needs no store, no network beyond the process group, no run files but the
model folder and the checkpoint folder.

Who starts the ranks, and what a follower runs, is composition (coordinator.launch.ranks): ``learner.world_size =
N`` makes the learner role process (rank 0) start N-1 follower processes, or ``torchrun`` names them. Backend: gloo
on CPU, NCCL on CUDA (object messages then use a separate gloo group, so the batch never has to visit the GPU).

A verifier worker with ``verification.placement = "fsdp"`` is a group of its own made the same way
(``verification.world_size`` ranks): its rank 0 leads a :class:`coordinator.engine.verifier.Verifier` exactly as the
learner's leads a Learner.

The batch is split across ranks (data parallel, as FSDP is): each rank takes every N-th sample, the loss is
normalised by the whole batch's token count, and gradients are summed rather than averaged across ranks, so one
step on N ranks equals one step on one device up to float summation order.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

#: A follower waits for rank 0's next command while the learner waits for results, which may take hours; a dead
#: peer is still noticed at once (its connection closes), so the group's timeout only bounds a hung peer.
IDLE_TIMEOUT = datetime.timedelta(days=7)
#: Seconds followers get to exit after rank 0 tells them to stop.
STOP_GRACE_S = 30.0


class RanksError(ValueError):
    """The ranks cannot be set up as configured (a ValueError: the learner role exits with CONFIG_ERROR)."""


@dataclass
class Ranks:
    """This process's place in the learner's process group."""

    rank: int
    world_size: int
    local_rank: int
    device: str  # this rank's device: "cpu" or "cuda:<local rank>"
    objects: Any  # the process group that carries pickled commands (gloo)
    followers: list[subprocess.Popen[bytes]]  # the ranks this process started (rank 0 only)

    @property
    def leader(self) -> bool:
        return self.rank == 0


def broadcast(ranks: Ranks, obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=ranks.objects)
    return box[0]


def lead(ranks: Ranks | None, name: str, *args: Any) -> None:
    """On rank 0 of several: tell the followers to run ``<their Learner or Verifier>.<name>(*args)`` (a no-op
    elsewhere)."""
    if ranks is not None and ranks.leader and ranks.world_size > 1:
        broadcast(ranks, (name, args))


def gather(ranks: Ranks, obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0 (None on the others)."""
    import torch.distributed as dist

    out: list[Any] | None = [None] * ranks.world_size if ranks.leader else None
    dist.gather_object(obj, out, dst=0, group=ranks.objects)
    return out


def broken(ranks: Ranks, what: str) -> None:
    """Rank 0, after a collective failed or a follower exited: the group is out of step and cannot be brought back
    in (a rank may sit in a collective the others will never join), so this process exits at once — its followers
    die with it (PR_SET_PDEATHSIG) and the supervisor restarts the whole group. Exiting by ``os._exit`` because a
    thread blocked in a collective would keep an orderly shutdown waiting forever."""
    dead = [(p.pid, p.returncode) for p in ranks.followers if p.poll() is not None]
    logger.critical("%s; ranks that exited: %s; stopping this group so that it restarts whole", what, dead or "none")
    logging.shutdown()
    os._exit(1)


def followers_alive(ranks: Ranks | None) -> bool:
    """Whether every rank this process started still runs (True where it started none)."""
    return ranks is None or all(p.poll() is None for p in ranks.followers)


def stop(ranks: Ranks) -> None:
    """Rank 0: release the followers and the process group (followers that hang are killed)."""
    import torch.distributed as dist

    if ranks.leader:
        try:
            lead(ranks, "stop")
        except Exception:  # a follower already gone: the others die with this process anyway
            logger.warning("could not tell the other ranks to stop", exc_info=True)
        for proc in ranks.followers:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("rank (pid %d) did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
    if dist.is_initialized():
        dist.destroy_process_group()


# -- the model ------------------------------------------------------------------------------------------------
def _blocks(model: Any) -> list[Any]:
    """The transformer blocks, each its own FSDP unit (one all-gather per block, freed after it)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names or type(m).__name__.endswith("DecoderLayer")]


def shard(model: Any, ranks: Ranks, mixed_precision: str) -> None:
    """FSDP2 over the model in place: each block, then the root (embeddings, norm, tied output layer).
    ``mixed_precision`` "bf16": parameters gathered and computed in bf16, gradients reduced and the optimizer
    stepped in float32 (the sharded parameters stay float32)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for block in _blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def from_leader(ranks: Ranks, tensors: list[Any]) -> None:
    """Overwrite ``tensors`` in place with rank 0's values (before sharding: each rank holds them whole)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)


def full_tensors(named: Iterable[tuple[str, Any]], keep: bool, dtype: Any = None) -> dict[str, Tensor]:
    """Gather sharded tensors to full ones (a collective: every rank, same order); ``keep`` ranks get CPU
    copies (in ``dtype`` for floating-point tensors when given), the others an empty dict."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Tensor] = {}
    for name, tensor in named:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            target = dtype if dtype is not None and full.is_floating_point() else full.dtype
            out[name] = full.detach().to("cpu", dtype=target, copy=True)
    return out


def all_reduce(ranks: Ranks, values: list[float], op: str) -> list[float]:
    """Sum or max of per-rank metrics across the ranks (over the gloo group: CPU floats)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=ranks.objects)
    return [float(v) for v in t.tolist()]


def single_rank(ranks: Ranks | None, what: str) -> None:
    """Refuse an operation only rank 0 would run (its collectives would wait for the other ranks forever)."""
    if ranks is not None and ranks.world_size > 1:
        raise RuntimeError(f"{what} is not available on a learner with {ranks.world_size} FSDP ranks")


# -- sharded checkpoints (torch.distributed.checkpoint) ---------------------------------------------------------
def save_checkpoint(model: Any, optimizer: Any, folder: Path) -> bool:
    """Every rank writes its shards of the trainable weights (and the optimizer state, once it has any) into
    ``folder``; returns whether the optimizer state was written. A fresh optimizer is left out: reading its
    state through torch.distributed.checkpoint would take a zero step and so shift Adam's step count."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    with_optimizer = bool(optimizer.state)
    if with_optimizer:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model, options=opts)}
    dcp.save(state, checkpoint_id=str(folder))
    return with_optimizer


def load_checkpoint(model: Any, optimizer: Any, folder: Path, with_optimizer: bool) -> None:
    """Every rank reads its shards of a checkpoint written by :func:`save_checkpoint` on as many ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    # the frozen base (LoRA) is not in the checkpoint: it comes from the model folder, so loading is not strict;
    # a trainable tensor the checkpoint lacks still fails in dcp.load
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    if with_optimizer:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(folder))  # fills msd and osd in place
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=opts)
    else:
        msd = get_model_state_dict(model, options=opts)
        dcp.load({"model": msd}, checkpoint_id=str(folder))
        set_model_state_dict(model, msd, options=opts)
