"""One long-lived child process that runs llama.cpp's converters for this process, one request at a time.

Why a worker: a version of a family model published through llama.cpp's converter used to start a fresh Python
that imported torch, transformers and the converter — 2.5-16 s a version on the project's 2-core machines — while
the conversion itself takes 0.02-0.15 s on a 256-wide model (docs/benchmarks.md "Model families"). Sequential pull
waits for every version's file, so that start-up was most of a step. The child stays a separate process for the
reasons :mod:`coordinator.publish.hf_convert` gives (upstream's ``gguf`` shares its import name with the PyPI one
the coordinator uses; the converter's memory is not the learner's); it is started at the first conversion, reused,
and replaced after a failure, a timeout, a fork, or every ``max_conversions`` requests (what the converter leaves
behind in memory is returned then). Its files are byte-identical to one process per version (tests/unit/
test_converter_worker.py).

Protocol: one JSON object per line on the child's stdin, ``{"op": "model" | "lora", "args": [...]}``, and one per
line back, ``{"ok": true}`` or ``{"error": "..."}``. The child moves its own stdout onto its stderr before it
imports anything, so nothing upstream prints can be read as a reply; its stderr goes to a file emptied before each
request, so a failure is reported by the converter's own last line, as it was with one process per version.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, TypedDict

ROOT = Path(__file__).resolve().parents[2]


class ConverterError(ValueError):
    """llama.cpp's converter could not write the model; the message carries its last line."""


class Reply(TypedDict, total=False):
    """One line from the child: ``{"ok": true}``, or ``{"error": "..."}``."""

    ok: bool
    error: str


class ConverterWorker:
    """The child process and the lock that gives it one request at a time (the publisher's thread and a test's
    may convert at once: the second waits, as it would for the CPU anyway)."""

    def __init__(self, max_conversions: int = 64) -> None:
        self.max_conversions = max_conversions
        self.started = 0  # children started so far: a bench's and a test's view of reuse
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None
        self._served = 0

    @property
    def pid(self) -> int | None:
        """The running child's process id, None when there is none."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def run(self, op: str, args: list[str], *, timeout_s: float, what: str) -> None:
        """Have the child run ``op`` on ``args``; raises :class:`ConverterError` naming ``what`` when it fails, ends
        or runs past ``timeout_s`` (the child is then replaced: the next request finds a fresh one). A child found
        dead when asked (killed while idle) is replaced and the request asked again, once: conversions write a
        temporary file and rename it, so asking twice cannot leave half a file."""
        if os.getpid() != self._owner:  # a forked copy: the child and the lock belong to the parent
            self._forget()
        with self._lock:
            for attempt in (1, 2):
                proc, log = self._child()
                timed_out, reply = self._ask(proc, log, op, args, timeout_s)
                if reply is not None:
                    break
                self._stop(kill=True)
                if timed_out:
                    raise ConverterError(f"llama.cpp's converter did not finish {what} within {timeout_s:.0f} s")
                if attempt == 2:  # a child that died idle is replaced once; one that dies on this request twice
                    raise ConverterError(self._ended(proc, log, what))
            assert reply is not None
            self._served += 1
            if "error" in reply:
                last = _last_line(log) or str(reply["error"])
                self._stop(kill=True)  # whatever the failure left in the child is not the next version's
                raise ConverterError(f"llama.cpp's converter failed on {what}: {last}")
            if self._served >= self.max_conversions:
                self._stop(kill=False)

    def close(self) -> None:
        """End the child (it exits when its stdin closes)."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._stop(kill=False)
            if self._log is not None:
                self._log.close()
                self._log = None

    def _child(self) -> tuple[subprocess.Popen[str], IO[bytes]]:
        if self._proc is not None and self._proc.poll() is None and self._log is not None:
            return self._proc, self._log
        self._stop(kill=True)
        if self._log is not None:
            self._log.close()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        env.setdefault("HF_HUB_OFFLINE", "1")
        # the child's stderr, kept open across requests (emptied before each): closed with the child's successor
        self._log = tempfile.TemporaryFile(prefix="echo-swarm-converter-")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.publish.hf_convert", "--serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, close_fds=True)
        self._served = 0
        self.started += 1
        return self._proc, self._log

    @staticmethod
    def _ask(proc: subprocess.Popen[str], log: IO[bytes], op: str, args: list[str],
             timeout_s: float) -> tuple[bool, Reply | None]:
        """Send one request; (timed out, the reply or None when the child ended without one)."""
        assert proc.stdin is not None and proc.stdout is not None
        log.seek(0)
        log.truncate()
        try:
            proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            proc.stdin.flush()
        except OSError:  # the pipe broke: the child is gone
            return False, None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            return True, None
        line = proc.stdout.readline()  # the child writes each reply as one short line, flushed
        if not line:
            return False, None
        reply: Reply = json.loads(line)
        return False, reply

    @staticmethod
    def _ended(proc: subprocess.Popen[str], log: IO[bytes], what: str) -> str:
        last = _last_line(log)
        return (f"llama.cpp's converter process ended (exit {proc.returncode}) on {what}"
                + (f": {last}" if last else ""))

    def _stop(self, *, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if kill:
                proc.kill()
            elif proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    def _forget(self) -> None:
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._proc = None
        self._log = None


def _last_line(log: IO[bytes]) -> str:
    log.flush()
    log.seek(0)
    lines = [ln for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


#: This process's worker (publisher threads, benches and tests share it).
WORKER = ConverterWorker()
atexit.register(WORKER.close)
