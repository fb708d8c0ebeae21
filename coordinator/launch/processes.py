"""The process layout: the API, the learner and the verifiers as separate processes around the run's store.

``echo-swarm coordinator`` (layout ``processes``) runs :func:`supervise`: it starts one learner, ``verification.
workers`` verifiers and the API as child processes (``python -m coordinator.launch.main ROLE CONFIG.json``), forwards
SIGINT/SIGTERM to them, and restarts a role that dies (a crash, an OOM kill, ``kill -9``) — the store holds everything
accepted, so the restarted role catches up from it. A role that fails again and again, or fails its start-up
for a reason a restart cannot fix (exit code ``CONFIG_ERROR``), stops the run with exit code 1.

A verifier with ``verification.placement = "fsdp"`` is a group of processes: the child the supervisor starts is its
rank 0 and starts the others (coordinator.launch.ranks), which die with it, so restarting the child restarts the group.

Each role can also be started on its own (``echo-swarm coordinator --role verifier --index 1``), e.g. to add a
verifier on another GPU of the same host: it joins the run through the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.engine import fsdp
from coordinator.launch.children import die_with_parent
from coordinator.launch.ranks import main_under_torchrun
from coordinator.launch.ranks import start as start_ranks
from coordinator.launch.serve import serve
from coordinator.roles import p2p
from coordinator.roles.learner import LearnerRole
from coordinator.roles.verifier import VerifierWorker
from coordinator.run.names import API, LEARNER, P2P, ROLES, api_name, verifier_name
from coordinator.run.runfiles import RunFiles
from coordinator.run.workqueue import Bell
from shared.exit_codes import ExitCode

logger = logging.getLogger(__name__)

#: Exit code of a role whose start-up failed for a reason a restart cannot fix (bad model folder, bad config).
CONFIG_ERROR = int(ExitCode.USAGE)
#: A role that dies this many times within RESTART_WINDOW_S stops the run.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
#: Seconds a role has to exit after SIGTERM before it is killed.
STOP_GRACE_S = 30.0


def _install_stop(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _until(stop: asyncio.Event, work: asyncio.Task[Any]) -> None:
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, work], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not work.done():
        work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work


async def run_learner(config: CoordinatorConfig) -> int:
    ranks = None
    if config.learner.sharded or fsdp_env():  # rank 0 of the learner's FSDP ranks (coordinator.launch.ranks)
        try:
            ranks = start_ranks(config)
        except ValueError as exc:
            logger.critical("learner could not start its ranks: %s", exc)
            return CONFIG_ERROR
    files = RunFiles.open(config)
    stop = asyncio.Event()
    _install_stop(stop)
    bell = Bell()
    bell.connect(Path(config.run_dir), LEARNER)
    learner = LearnerRole(config, files.store, bell, files.snapshots, files.task, ranks=ranks)
    try:
        try:
            await learner.start()
        except (FileNotFoundError, ValueError) as exc:
            logger.critical("learner could not start: %s", exc)
            return CONFIG_ERROR
        work = asyncio.create_task(learner.run(), name="learner-loop")
        await _until(stop, work)
        if work.cancelled():
            return 0
        return 0 if work.exception() is None else 1
    finally:
        await learner.stop()
        bell.close()
        files.close()


async def run_verifier(config: CoordinatorConfig, index: int) -> int:
    ranks = None
    if config.verification.placement == "fsdp":  # rank 0 of this worker's FSDP group (coordinator.launch.ranks)
        try:
            ranks = start_ranks(config, "verifier", index)
        except ValueError as exc:
            logger.critical("%s could not start its ranks: %s", verifier_name(index), exc)
            return CONFIG_ERROR
    files = RunFiles.open(config)
    stop = asyncio.Event()
    _install_stop(stop)
    bell = Bell()
    bell.connect(Path(config.run_dir), verifier_name(index))
    worker = VerifierWorker(config, files.store, bell, files.snapshots, files.task, index=index, ranks=ranks)
    try:
        start = asyncio.create_task(worker.start())
        await _until(stop, start)
        if start.cancelled():
            return 0
        await _until(stop, asyncio.create_task(worker.run(), name=worker.name))
        return 0
    finally:
        worker.close()
        bell.close()
        files.close()
        if ranks is not None:
            fsdp.stop(ranks)


async def run_p2p(config: CoordinatorConfig) -> int:
    stop = asyncio.Event()
    _install_stop(stop)
    return await p2p.run_role(config, stop)


def fsdp_env() -> bool:
    """Whether torchrun started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE") or 1) > 1


def run_role(config: CoordinatorConfig, role: str, index: int = 0, parent: int | None = None) -> int:
    """One role in this process (the CLI's ``--role``; the supervisor's children, which stop with ``parent``)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; use {', '.join(ROLES[:-1])} or {ROLES[-1]}")
    if role == LEARNER and fsdp_env() and int(os.environ.get("RANK") or 0) > 0:
        return main_under_torchrun(config)  # torchrun's ranks 1..N-1 only compute: no store, no role lock
    name = verifier_name(index) if role == "verifier" else api_name(index) if role == API else role

    async def body() -> int:
        watcher = asyncio.create_task(_watch_parent(parent), name="parent-watch") if parent is not None else None
        try:
            if role == API:
                return await serve(config, all_roles=False, name=name)
            if role == LEARNER:
                return await run_learner(config)
            if role == P2P:
                return await run_p2p(config)
            return await run_verifier(config, index)
        finally:
            if watcher is not None:
                watcher.cancel()

    try:
        with role_lock(config.run_dir, name):
            return asyncio.run(body())
    except RoleLocked as exc:
        logger.critical("%s", exc)
        return CONFIG_ERROR


class _Child:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None
        self.deaths: deque[float] = deque()
        self.done = False  # exited on purpose (the learner after the last step)

    def start(self) -> None:
        # torch's OpenMP threads busy-wait between parallel regions by default; with the learner and verifiers in
        # separate processes sharing the cores that spinning starves the others (unless the operator chose)
        env = {"OMP_WAIT_POLICY": "PASSIVE"} | os.environ
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=die_with_parent)  # noqa: PLW1509
        logger.info("started %s (pid %d)", self.name, self.proc.pid)


def _role_argv(config_path: Path, role: str, index: int = 0) -> list[str]:
    return [sys.executable, "-m", "coordinator.launch.main", role, str(config_path), str(index), str(os.getpid())]


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logger.critical("the supervisor (pid %d) is gone; stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


class RoleLocked(RuntimeError):
    """Another process already runs this role of this run."""


@contextlib.contextmanager
def role_lock(run_dir: Path, name: str, wait_s: float = 30.0) -> Any:
    """Hold run_dir/roles/NAME.lock while this process runs the role: two learners (or two APIs) on one run would
    corrupt it. The OS drops the lock when the holder dies, however it dies; a restart waits up to ``wait_s`` for
    a dying predecessor to let go."""
    import fcntl

    path = Path(run_dir) / "roles" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        give_up = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > give_up:
                    raise RoleLocked(f"another process runs the {name} role of {run_dir} (lock {path}); stop it "
                                     f"first, or use another run directory") from None
                time.sleep(0.2)
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_config(config: CoordinatorConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(config.model_dump_json())
    os.replace(tmp, path)


def supervise(config: CoordinatorConfig) -> int:
    """Run every role as its own process until SIGINT/SIGTERM (exit 0) or a role that cannot run (exit 1)."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "roles" / "config.json"
    _write_config(config, config_path)
    (run_dir / "endpoint.json").unlink(missing_ok=True)
    children = [_Child(LEARNER, _role_argv(config_path, LEARNER))]
    children += [_Child(verifier_name(i), _role_argv(config_path, "verifier", i))
                 for i in range(config.verification.workers)]
    if config.p2p.enabled:  # hivemind imports torch: its peer gets a process of its own, not the API's
        children.append(_Child(P2P, _role_argv(config_path, P2P)))
    api = _Child(API, _role_argv(config_path, API))
    children.append(api)
    stopping = {"flag": False}

    def _stop(_sig: int, _frame: Any) -> None:
        stopping["flag"] = True

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for child in children:
            child.start()
        pinned_port = False
        while not stopping["flag"]:
            if not pinned_port and config.server.port == 0 and (run_dir / "endpoint.json").exists():
                # a restarted API must listen where clients already connect
                port = int(json.loads((run_dir / "endpoint.json").read_text())["port"])
                config = config.model_copy(update={"server": config.server.model_copy(update={"port": port})})
                _write_config(config, config_path)
                pinned_port = True
            for child in children:
                assert child.proc is not None
                rc = child.proc.poll()
                if rc is None or child.done:
                    continue
                if child.name == LEARNER and rc == 0:
                    child.done = True
                    logger.info("learner finished the run; the API and verifiers keep serving")
                    continue
                if rc in (CONFIG_ERROR, ExitCode.PORT_IN_USE):
                    logger.critical("%s cannot start (see its log above); stopping the run", child.name)
                    return int(ExitCode.PORT_IN_USE) if rc == ExitCode.PORT_IN_USE else 1
                now = time.monotonic()
                child.deaths.append(now)
                while child.deaths and child.deaths[0] < now - RESTART_WINDOW_S:
                    child.deaths.popleft()
                if len(child.deaths) > MAX_RESTARTS:
                    logger.critical("%s died %d times in %.0f s; stopping the run", child.name, len(child.deaths),
                                    RESTART_WINDOW_S)
                    return 1
                logger.warning("%s (pid %d) exited with %s; restarting it", child.name, child.proc.pid, rc)
                child.start()
            time.sleep(0.2)
        return code
    finally:
        _stop_all(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_all(children: list[_Child]) -> None:
    live = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in reversed(live):  # the API first: no new work while the others stop
        assert child.proc is not None
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in live:
        assert child.proc is not None
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", child.name, STOP_GRACE_S)
            child.proc.kill()
            child.proc.wait()
