"""Where the client's diagnostics go, so that the panel stays readable for months.

Three sources used to write straight onto the terminal, over the live panel: llama.cpp (its C log callback prints
``llama_context: n_ctx_seq … > n_ctx_train …`` on every model load), transformers (``Loading weights: 100%|…``
progress bars, warnings) and the Python loggers. Here all three go through Python logging:

- every record at ``--log-level`` and above goes to a rotated log file (``client.log`` in the client's log folder,
  5 MB × 3 files), with its time, so a bug report can quote what happened a week ago;
- only warnings and errors reach the terminal (through the panel, as event lines), and each distinct one only
  once per run: a warning repeated on every model load is shown the first time and then only logged.

llama.cpp's callback runs on whatever thread llama.cpp logs from; it only hands the text to logging. Its levels
(ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous message) are mapped to Python's;
a message arrives in pieces (continuations, no newline) and is logged once its newline comes.
"""

from __future__ import annotations

import ctypes
import logging
import logging.handlers
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.safe_text import SafeFormatter

LOG_FILE = "client.log"
LOG_BYTES = 5 * 2**20
LOG_BACKUPS = 3
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: ggml_log_level → logging level (GGML_LOG_LEVEL_CONT, 5, continues the previous message at its level)
GGML_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
GGML_CONT = 5

#: ``extra={SHOWN: True}`` marks a record whose text the client already printed: only the log file gets it.
SHOWN = "echo_swarm_shown"
_installed: dict[str, Any] = {}  # what this process installed: handlers and the llama.cpp callback (kept alive)


class OncePerMessage(logging.Filter):
    """Passes a record the first time its message (logger, level, text) is seen; later copies are dropped (they
    still reach the log file, which has no such filter)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, int, str]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        return True


class ToDisplay(logging.Handler):
    """Hands a record to the client's display as an event line (so it scrolls above the panel, never through it)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.say = say
        self.addFilter(OncePerMessage())

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, SHOWN, False):  # the client printed it itself; the record is for the log file
            return
        try:
            self.say(f"{record.levelname.lower()}: {record.name}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 — logging must never take the client down
            self.handleError(record)


def setup(log_dir: Path, level: str, say: Callable[[str], None]) -> Path:
    """Route this process's logging to ``log_dir/client.log`` (rotated) at ``level``, and warnings and errors, once
    each, to ``say``. Replaces whatever an earlier call installed. Returns the log file's path."""
    teardown()
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / LOG_FILE
    file_handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS,
                                                        encoding="utf-8", delay=True)
    file_handler.setLevel(LEVELS[level])
    file_handler.setFormatter(SafeFormatter(FILE_FORMAT))
    display = ToDisplay(say)
    display.setLevel(max(LEVELS[level], logging.WARNING))
    root = logging.getLogger()
    for handler in list(root.handlers):  # the CLI's stderr handler would print every warning a second time
        if getattr(handler, "_echo_swarm_safe_handler", False):
            root.removeHandler(handler)
    root.addHandler(file_handler)
    root.addHandler(display)
    root.setLevel(min(LEVELS[level], logging.WARNING))
    _installed["handlers"] = [file_handler, display]
    return path


def teardown() -> None:
    root = logging.getLogger()
    for handler in _installed.pop("handlers", []):
        root.removeHandler(handler)
        handler.close()


class LlamaLog:
    """Collects llama.cpp's log pieces into lines and logs each under the ``llama.cpp`` logger."""

    def __init__(self) -> None:
        self.logger = logging.getLogger("llama.cpp")
        self._buffer = ""
        self._level = logging.INFO
        self._lock = threading.Lock()

    def __call__(self, level: int, text: bytes | None, _user_data: object) -> None:
        piece = (text or b"").decode("utf-8", "replace")
        with self._lock:
            if level != GGML_CONT:
                self._level = GGML_LEVELS.get(level, logging.INFO)
            self._buffer += piece
            if not self._buffer.endswith("\n"):
                return
            lines, self._buffer = self._buffer.rstrip("\n"), ""
            level_now = self._level
        for line in lines.split("\n"):
            if line.strip(" ."):  # progress dots are no message
                self.logger.log(level_now, "%s", line)


def route_llama_cpp() -> None:
    """Send llama.cpp's (and ggml's) log to Python logging instead of stderr. Idempotent; call after
    llama_cpp is importable (it is imported here)."""
    if "llama" in _installed:
        return
    import llama_cpp

    sink = LlamaLog()
    callback = llama_cpp.llama_log_callback(sink)  # a ctypes function pointer: must outlive every log call
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    _installed["llama"] = (sink, callback)


def quiet_transformers() -> None:
    """No progress bars from transformers or huggingface_hub, and their warnings through Python logging (so they
    reach the log file, and the terminal once). Call once transformers is imported."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:
        return
    disable_progress_bars()
