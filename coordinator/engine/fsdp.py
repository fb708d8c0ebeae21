"""The learner on N ranks: torch.distributed process groups and FSDP2 (``fully_shard``) over the model.

Why this shape: only rank 0 runs the learner role (store, publication, checkpoints' bookkeeping); ranks 1…N-1 only
compute. Every operation that touches the sharded model is a collective, so all ranks must run the same
operations in the same order. Rank 0's :class:`coordinator.engine.learner.Learner` therefore *leads*: before such an
operation it broadcasts its name and arguments (the batch included) with ``broadcast_object_list``, and every other
rank runs :func:`follow`, which receives each one and calls the same method on its own Learner. Nothing else
passes between the ranks, so a follower needs no store, no network beyond the process group, no run files but the
model folder and the checkpoint folder.

Who starts the ranks: ``learner.world_size = N`` makes the learner role process (rank 0) start N-1 follower
processes (``python -m coordinator.engine.fsdp CONFIG.json learner`` with RANK/WORLD_SIZE/MASTER_* set; they die with it,
so the supervisor's restart of a dead learner restarts all ranks). Under ``torchrun`` the environment already names
the ranks: rank 0 runs the role, the others follow. Backend: gloo on CPU, NCCL on CUDA (object messages then use
a separate gloo group, so the batch never has to visit the GPU).

A verifier worker with ``verification.placement = "fsdp"`` is a group of its own made the same way (``… CONFIG.json
verifier INDEX``, ``verification.world_size`` ranks): its rank 0 leads a :class:`coordinator.engine.verifier.Verifier`
exactly as the learner's leads a Learner (:func:`follow` builds whichever the role names).

The batch is split across ranks (data parallel, as FSDP is): each rank takes every N-th sample, the loss is
normalised by the whole batch's token count, and gradients are summed rather than averaged across ranks, so one
step on N ranks equals one step on one device up to float summation order.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.config import CoordinatorConfig

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


def env_world_size() -> int | None:
    """WORLD_SIZE as torchrun (or a leading rank) set it, else None."""
    raw = os.environ.get("WORLD_SIZE")
    return int(raw) if raw else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    from coordinator.launch.processes import _die_with_parent as die

    die()


def _group_of(config: CoordinatorConfig, role: str) -> tuple[int, str, str]:
    """(ranks, device setting, what to call them in messages) of the learner's or a verifier's group."""
    if role == "learner":
        return config.learner.world_size, config.model.device, "learner"
    vcfg = config.verification
    return vcfg.world_size, config.model.device if vcfg.device == "auto" else vcfg.device, "verification"


def start(config: CoordinatorConfig, role: str = "learner", index: int = 0) -> Ranks:
    """Join (or found) the process group of the learner (``role`` "learner") or of verifier ``index`` ("verifier").
    Rank 0 of a group not started by torchrun starts the other ranks first."""
    import torch
    import torch.distributed as dist

    from shared.policy import pick_device

    size, setting, key = _group_of(config, role)
    world = env_world_size()
    kind = pick_device(setting)
    first = int(kind.partition(":")[2] or 0) if kind.startswith("cuda") else 0  # "cuda:K": ranks on cuda:K…
    if kind.startswith("cuda") and first + (world or size) > torch.cuda.device_count():
        raise RanksError(f"{world or size} {role} ranks from cuda:{first} on need as many GPUs, one each; this host "
                         f"has {torch.cuda.device_count()}: lower {key}.world_size" +
                         (f" or {key}.device" if first else ""))
    followers: list[subprocess.Popen[bytes]] = []
    if world is None:  # not under torchrun: this is rank 0, and it starts the others
        world = size
        port = _free_port()
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                           "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)})
        if world > 1:
            name = role if role == "learner" else f"verifier-{index}"
            path = Path(config.run_dir) / "roles" / f"{name}-ranks.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(config.model_dump_json())
            for rank in range(1, world):
                env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_WAIT_POLICY": "PASSIVE"}
                followers.append(subprocess.Popen([sys.executable, "-m", "coordinator.engine.fsdp", str(path), role,
                                                   str(index)], env=env,
                                                  preexec_fn=_die_with_parent))  # noqa: PLW1509
            logger.info("started %s ranks 1..%d (pids %s)", name, world - 1, [p.pid for p in followers])
    elif size not in (1, world):
        raise RanksError(f"{key}.world_size is {size} but torchrun started {world} ranks; "
                         f"set {key}.world_size = {world} (or leave it at 1 under torchrun)")
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if kind.startswith("cuda"):  # rank r on cuda:(K + r) for a configured "cuda:K" (K = 0 for "cuda")
        index = first if world == 1 else first + local_rank
        torch.cuda.set_device(index)
        device, backend = f"cuda:{index}", "nccl"
    elif kind == "cpu":
        device, backend = "cpu", "gloo"
    else:
        raise RanksError(f"{role} ranks need cuda or cpu, not {kind!r}: set {key}.device" if role != "learner" else
                         f"the learner on ranks needs model.device cpu or cuda, not {kind!r}")
    if world == 1:  # FSDP over one device: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=IDLE_TIMEOUT)
    else:
        dist.init_process_group(backend, timeout=IDLE_TIMEOUT)
    objects = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend == "nccl" else dist.group.WORLD
    logger.info("%s rank %d of %d on %s (%s)", role, rank, world, device, backend)
    return Ranks(rank, world, local_rank, device, objects, followers)


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


def follow(ranks: Ranks, config: CoordinatorConfig, role: str = "learner") -> int:
    """Ranks 1…N-1: build the learner (or verifier) when rank 0 does, then run each operation rank 0 leads until
    told to stop."""
    target: Any = None
    while True:
        name, args = broadcast(ranks)
        if name == "stop":
            return 0
        if name == "init":  # what rank 0 builds its learner or verifier from
            target = _build(ranks, config, role, args)
            continue
        assert target is not None, f"rank 0 led {name!r} before building the {role}"
        getattr(target, name)(*args)


def _build(ranks: Ranks, config: CoordinatorConfig, role: str, args: tuple[Any, ...]) -> Any:
    if role == "verifier":
        from coordinator.roles.verifier import follower_verifier

        return follower_verifier(ranks, config, *args)
    from coordinator.config import LearnerConfig
    from coordinator.engine.learner import Learner

    return Learner(Path(args[0]), config.model, LearnerConfig.model_validate(args[1]), config.sampling.temperature,
                   gguf=config.snapshots.gguf, ranks=ranks)


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


def full_tensors(named: Iterable[tuple[str, Any]], keep: bool, dtype: Any = None) -> dict[str, Any]:
    """Gather sharded tensors to full ones (a collective: every rank, same order); ``keep`` ranks get CPU
    copies (in ``dtype`` for floating-point tensors when given), the others an empty dict."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
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


def main_under_torchrun(config: CoordinatorConfig, role: str = "learner", index: int = 0) -> int:
    """A follower rank: rank 0 started it with RANK etc. set, or torchrun did."""
    try:
        ranks = start(config, role, index)
    except RanksError as exc:
        logger.critical("%s rank could not start: %s", role, exc)
        return 2
    try:
        return follow(ranks, config, role)
    finally:
        stop(ranks)


def main(argv: list[str]) -> int:
    """``python -m coordinator.engine.fsdp CONFIG.json [learner | verifier INDEX]``: how rank 0 starts a follower rank."""
    from coordinator.config import CoordinatorConfig
    from shared import safe_text

    # Ctrl-C reaches the whole process group: rank 0 stops this rank in order (and it dies with rank 0 anyway)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = os.environ.get("RANK", "?")
    role = argv[1] if len(argv) > 1 else "learner"
    index = int(argv[2]) if len(argv) > 2 else 0
    name = "learner-" if role == "learner" else f"verifier-{index}-"
    safe_text.configure_logging(logging.INFO, f"%(asctime)s %(levelname)s {name}rank{rank} %(name)s: %(message)s",
                                sys.stderr)
    return main_under_torchrun(CoordinatorConfig.model_validate_json(Path(argv[0]).read_text()), role, index)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
