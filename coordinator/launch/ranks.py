"""Starting the ranks of a learner or verifier group (coordinator.engine.fsdp), and the follower ranks' main.

``learner.world_size = N`` makes the learner role process (rank 0) start N-1 follower processes (``python -m
coordinator.launch.ranks CONFIG.json learner`` with RANK/WORLD_SIZE/MASTER_* set; they die with it, so the
supervisor's restart of a dead learner restarts all ranks). Under ``torchrun`` the environment already names the
ranks: rank 0 runs the role, the others follow. A verifier worker with ``verification.placement = "fsdp"`` is a
group of its own made the same way (``… CONFIG.json verifier INDEX``).

A follower builds the same Learner (or Verifier) as its rank 0 and then runs, in order, each operation rank 0 leads
(:func:`follow`): the collectives themselves are in coordinator.engine.fsdp.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig, LearnerConfig
from coordinator.engine.fsdp import IDLE_TIMEOUT, Ranks, RanksError, broadcast, stop
from coordinator.engine.learner import Learner
from coordinator.launch.children import die_with_parent
from coordinator.roles.verifier import follower_verifier
from coordinator.run.names import LEARNER, verifier_name
from shared import safe_text
from shared.policy import pick_device

logger = logging.getLogger(__name__)


def env_world_size() -> int | None:
    """WORLD_SIZE as torchrun (or a leading rank) set it, else None."""
    raw = os.environ.get("WORLD_SIZE")
    return int(raw) if raw else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_of(config: CoordinatorConfig, role: str) -> tuple[int, str, str]:
    """(ranks, device setting, what to call them in messages) of the learner's or a verifier's group."""
    if role == "learner":
        return config.learner.world_size, config.model.device, "learner"
    vcfg = config.verification
    return vcfg.world_size, config.model.device if vcfg.device == "auto" else vcfg.device, "verification"


def start(config: CoordinatorConfig, role: str = "learner", index: int = 0) -> Ranks:
    """Join (or found) the process group of the learner (``role`` "learner") or of verifier ``index`` ("verifier").
    Rank 0 of a group not started by torchrun starts the other ranks first."""
    import torch  # lazy: the supervisor and the API import this layer, and must not load torch
    import torch.distributed as dist

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
            name = LEARNER if role == LEARNER else verifier_name(index)
            path = Path(config.run_dir) / "roles" / f"{name}-ranks.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(config.model_dump_json())
            for rank in range(1, world):
                env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_WAIT_POLICY": "PASSIVE"}
                followers.append(subprocess.Popen([sys.executable, "-m", "coordinator.launch.ranks", str(path), role,
                                                   str(index)], env=env,
                                                  preexec_fn=die_with_parent))  # noqa: PLW1509
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
        return follower_verifier(ranks, config, *args)
    return Learner(Path(args[0]), config.model, LearnerConfig.model_validate(args[1]), config.sampling.temperature,
                   gguf=config.snapshots.offered(), ranks=ranks)


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
    """``python -m coordinator.launch.ranks CONFIG.json [learner | verifier INDEX]``: how rank 0 starts a follower rank."""
    # Ctrl-C reaches the whole process group: rank 0 stops this rank in order (and it dies with rank 0 anyway)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = os.environ.get("RANK", "?")
    role = argv[1] if len(argv) > 1 else "learner"
    index = int(argv[2]) if len(argv) > 2 else 0
    name = "learner-" if role == LEARNER else f"{verifier_name(index)}-"
    safe_text.configure_logging(logging.INFO, f"%(asctime)s %(levelname)s {name}rank{rank} %(name)s: %(message)s",
                                sys.stderr)
    return main_under_torchrun(CoordinatorConfig.model_validate_json(Path(argv[0]).read_text()), role, index)



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
