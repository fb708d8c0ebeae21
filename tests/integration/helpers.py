"""Helpers for integration tests: real coordinator and client processes on 127.0.0.1, a minimal signed
protocol client written against docs/protocol.md (not the production client), and condition waits."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.store.tmpfs import run_folder
from shared import crypto, wire
from shared.messages import ErrorBody, Message

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
#: Where tests leave files for a person to look at (the pages' screenshots): test-artifacts/, or a folder of
#: each copy's own under `make test-twice` (ECHO_SWARM_TEST_ARTIFACTS), so two runs never write one file
ARTIFACTS = Path(os.environ.get("ECHO_SWARM_TEST_ARTIFACTS") or REPO / "test-artifacts")


#: Learner steps of the demos that test something other than the demo's length (the store, the backends). The
#: README's demo gains +0.17 held-out accuracy by step 25 (0.350 → 0.520; 256 prompts, one standard error of a
#: difference ≈ 0.044): at 50 steps (two evaluations) the +0.10 asserted is well inside what it reaches.
SHORT_DEMO_STEPS = 50


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        tick.wait(interval)


class Proc:
    """A child process with its output captured to a file; optionally waits for a line to appear."""

    def __init__(self, argv: list[str], log: Path, ready: str | None = None, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 — closed in stop()
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._ready_text = ready
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     cwd=REPO, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self.lines.append(line)
            if self._ready_text and self._ready_text in line:
                self.ready.set()
        self.ready.set()  # also wake waiters when the process ends

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.lines)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._pump.join(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def stop_all(*procs: Proc) -> None:
    """Stop every process a test started (each by its own PID), in the order given."""
    for p in procs:
        p.stop()


def write_config(path: Path, run_dir: Path, model_dir: Path, port: int = 0, top: dict[str, Any] | None = None,
                 **sections: dict[str, Any]) -> Path:
    """A small, fast run config: 2 jobs of 2 prompts × 4 samples per step, 64 held-out prompts.
    ``top`` holds top-level keys (sync_mode, max_staleness); keyword arguments are [sections]."""
    base: dict[str, dict[str, Any]] = {
        "model": {"path": str(model_dir)},
        "server": {"host": "127.0.0.1", "port": port},
        "learner": {"max_steps": 4, "prompts_per_step": 4, "group_size": 4, "eval_every": 0, "eval_size": 64,
                    "threads": 1},
        "jobs": {"prompts_per_job": 2, "lease_timeout_s": 60.0, "long_poll_s": 2.0},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    def toml(v: Any) -> str:  # lists and tables inline, e.g. task.rewards = [{function = "f.py:f"}]
        if isinstance(v, list):
            return "[" + ", ".join(toml(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + "}"
        return json.dumps(v) if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else str(v)

    lines = [f'run_dir = "{run_dir}"'] + [f"{k} = {toml(v)}" for k, v in (top or {}).items()]
    for name, values in base.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {toml(v)}" for k, v in values.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def start_coordinator(config: Path, log: Path, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    proc = Proc([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(config)], log,
                ready="listening on ", env=env)
    proc.ready.wait(180)
    out = proc.output()
    assert "listening on " in out, f"coordinator did not start:\n{out[-3000:]}"
    url = out.split("listening on ")[1].split()[0]
    return proc, url


def start_client(url: str, home: Path, log: Path, *extra: str) -> Proc:
    return Proc([sys.executable, "-m", "echo_swarm", "join", url, "--home", str(home), "--threads", "1", *extra], log)


def get_status(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/status", timeout=10) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError):
        return None


@functools.cache
def server_errors(url: str) -> float:
    """The 5xx replies /metrics counts (echo_swarm_http_requests, every route)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r'^echo_swarm_http_requests_total\{[^}]*status="5\d\d"[^}]*\} '
                                                      r'(\S+)$', text, re.M))


def _nonce_db(run_dir: Path) -> Path:
    """Where a run keeps its replay-protection database (coordinator.store.store.Store.nonce_path); the run's tmpfs
    folder is found once per run directory (finding it writes its owner file and sweeps orphans: ~8 ms)."""
    folder = run_folder(run_dir / "coordinator.sqlite")
    return folder / "nonces.sqlite" if folder is not None else run_dir / "coordinator-nonces.sqlite"


def db_queries(run_dir: Path, *queries: str | tuple[str, tuple[Any, ...]]) -> list[list[tuple[Any, ...]]]:
    """Several reads of the coordinator's database through one read-only connection (WAL lets a reader in while
    the coordinator writes): each query is SQL or (SQL, parameters)."""
    conn = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True, timeout=10)
    nonces = _nonce_db(run_dir)
    try:
        if nonces.exists():  # replay protection has its own file
            conn.execute("ATTACH DATABASE ? AS n", (f"file:{nonces}?mode=ro",))
        return [conn.execute(*((q, ()) if isinstance(q, str) else q)).fetchall() for q in queries]
    finally:
        conn.close()


def db_rows(run_dir: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the coordinator's database (one query)."""
    return db_queries(run_dir, (sql, params))[0]


def perturbed_copy(src: Path, dst: Path, scale: float) -> None:
    """A second 'version': the same model with every weight nudged, saved as a Hugging Face folder."""
    import torch

    from shared.policy import load_model

    shutil.copytree(src, dst)
    model = load_model(src)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(str(dst), safe_serialization=True)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not yet reaped by its parent, is not)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False


def started_rank_pids(log: Path, role: str) -> list[int]:
    """Follower rank pids a role's rank 0 logged starting (coordinator.launch.ranks), oldest first."""
    return [int(p) for p in re.findall(rf"started {re.escape(role)} ranks 1\.\.1 \(pids \[(\d+)\]\)", log.read_text())]


class RawClient:
    """Speaks the protocol with nothing but urllib, msgpack and Ed25519, as a third-party client would."""

    def __init__(self, url: str, key: Ed25519PrivateKey | None = None) -> None:
        self.url = url
        self.key = key or crypto.generate_key()
        self.public_key = crypto.public_bytes(self.key)
        self.client_id = crypto.client_id_for(self.public_key)

    def envelope(self, path: str, body: Message | bytes, *, timestamp: float | None = None) -> bytes:
        raw = body if isinstance(body, bytes) else wire.encode(body)
        return wire.encode(crypto.sign_request(self.key, path, raw, timestamp=timestamp or time.time()))

    def send(self, path: str, data: bytes, timeout: float = 60) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/msgpack"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def post(self, path: str, body: Message | bytes) -> tuple[int, bytes]:
        return self.send(path, self.envelope(path, body))

    @staticmethod
    def error(raw: bytes) -> ErrorBody:
        return wire.decode(raw, ErrorBody)
