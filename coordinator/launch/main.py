"""Entry point of `echo-swarm coordinator`: serve one run until interrupted — every role as its own process
(coordinator.launch.processes.supervise), all roles in this one, or a single role (``--role``)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.launch import preflight
from coordinator.launch.processes import CONFIG_ERROR, RoleLocked, fsdp_env, role_lock, run_role, supervise
from coordinator.launch.serve import serve
from coordinator.memory import return_freed_memory
from coordinator.run.names import API, LEARNER, api_name, verifier_name
from shared import safe_text

logger = logging.getLogger(__name__)


def run(config: CoordinatorConfig, role: str = "all", index: int = 0, parent: int | None = None) -> int:
    return_freed_memory()  # before any tensor is allocated: every role's peak is what it holds (coordinator.memory)
    if parent is None:  # started by the operator (a supervisor's own children were checked before it started them)
        try:
            preflight.check(config, role)
        except preflight.PreflightError as exc:  # one line, before any role starts or anything is written
            print(f"error: {exc.message}", file=sys.stderr, flush=True)
            return int(exc.code)
    label = "" if role == "all" else f"{role}{index if role == 'verifier' else ''} "
    # every record one line, client text escaped (issue 13); on stderr and in the run's logs/ (one file a process)
    fmt = f"%(asctime)s %(levelname)s {label}%(name)s: %(message)s"
    safe_text.configure_logging(logging.INFO, fmt, sys.stderr)
    log_file = Path(config.run_dir) / "logs" / f"{log_name(config, role, index)}.log"
    try:
        safe_text.log_to_file(log_file, fmt)
    except OSError as exc:  # the run can go on without it; stderr still has every line
        logger.warning("not writing %s (%s): the log goes to stderr only", log_file, exc)
    if fsdp_env() and role != LEARNER:  # torchrun's ranks are the learner's; the other roles run once
        logger.critical("started as one of several torch.distributed ranks (WORLD_SIZE is set): only the learner "
                        "runs on ranks; use --role learner under torchrun and start the API and verifiers on their "
                        "own (--role api, --role verifier)")
        return CONFIG_ERROR
    if role != "all":
        return run_role(config, role, index, parent)
    if config.layout == "one-process" or config.sync_mode == "colocated":
        try:
            with role_lock(config.run_dir, LEARNER), role_lock(config.run_dir, API), \
                    role_lock(config.run_dir, verifier_name(0)):
                return asyncio.run(serve(config))
        except RoleLocked as exc:
            logger.critical("%s", exc)
            return CONFIG_ERROR
    return supervise(config)


def log_name(config: CoordinatorConfig, role: str, index: int) -> str:
    """The process's log file name in ``<run_dir>/logs``: "coordinator" for a one-process run, "supervisor" for
    the processes layout's parent, else the role's own name (api, learner, verifier0, p2p …; a learner rank of
    torchrun past the first, learner-rank<R>)."""
    if role == "all":
        return "coordinator" if config.layout == "one-process" or config.sync_mode == "colocated" else "supervisor"
    if role == LEARNER and fsdp_env() and int(os.environ.get("RANK") or 0) > 0:
        return f"learner-rank{os.environ['RANK']}"
    return f"verifier{index}" if role == "verifier" else api_name(index) if role == API else role


def main(argv: list[str]) -> int:
    """``python -m coordinator.launch.main ROLE CONFIG.json [INDEX [PARENT]]``: how coordinator.launch.processes.
    supervise starts its children."""
    role, config_path = argv[0], Path(argv[1])
    index = int(argv[2]) if len(argv) > 2 else 0
    parent = int(argv[3]) if len(argv) > 3 else None
    config = CoordinatorConfig.model_validate_json(config_path.read_text())
    return run(config, role, index, parent)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
