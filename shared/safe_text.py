"""Untrusted text stays data: which characters a client may send, and how text is made safe to print or log.

A volunteer controls every string it sends (its display name, device, platform, software, invite). Once such a
string reaches a log file or a terminal, some characters stop being data: a newline starts what looks like a new
log record (a forged ``CRITICAL ... learner loop stopped``), a carriage return overwrites the line shown, an
escape sequence (ESC, or C1 CSI/OSC) clears the screen, retitles the window or plants a hyperlink, and Unicode
bidi overrides and line/paragraph separators reorder or break what the operator reads. Two defences, both here:

- **At the schema** (:func:`check_printable`, used by ``shared.messages``): client-supplied strings that have no
  business holding such characters refuse them, with ``schema_invalid``.
- **At every output** (:func:`escape`, :class:`SafeFormatter`, :func:`configure_logging`): whatever reaches a log
  or a terminal anyway (an old database, a coordinator message, an exception text) is shown with each such
  character replaced by a visible escape (``\\n``, ``\\x1b``, ``\\u202e``), so one log record is one line and
  nothing is interpreted by the terminal.

Nothing here imports more than the standard library, so that every part of the project can use it.
"""

from __future__ import annotations

import logging
import logging.handlers
import re
import sys
from pathlib import Path
from typing import TextIO

UNSAFE_CHARS = re.compile(
    "["
    "\x00-\x1f\x7f"  # C0 controls (tab and newline included) and DEL
    "\x80-\x9f"  # C1 controls: NEL (U+0085) breaks lines, CSI (U+009B) and OSC (U+009D) start escape sequences
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # bidi marks, embeddings, overrides and isolates
    "\u2028\u2029"  # line and paragraph separators
    "\ud800-\udfff"  # lone surrogates (cannot be encoded as UTF-8)
    "]"
)
"""Characters that make text act on a log or a terminal instead of being read. Letters, digits, punctuation,
spaces, emoji (with zero-width joiners and variation selectors) and every script stay allowed."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

CONTINUATION = "  | "
"""Prefix of every line after a log record's first (traceback, stack): a line at column 0 is always a record."""


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every :data:`UNSAFE_CHARS` character written as a visible escape (``\\n``, ``\\x1b``,
    ``\\u202e``). For display only: backslashes already in the text are left as they are, so the result is safe
    to print but not meant to be parsed back."""
    return UNSAFE_CHARS.sub(_visible, text)


def first_unsafe(text: str) -> tuple[int, str] | None:
    """(index, character) of the first :data:`UNSAFE_CHARS` character in ``text``, or None if it has none."""
    match = UNSAFE_CHARS.search(text)
    return None if match is None else (match.start(), match.group())


def check_printable(text: str) -> str:
    """Pydantic validator for client-supplied strings: ``text`` unchanged, or ValueError naming the first unsafe
    character, where it is, and what to send instead (the field name is added by the schema's error location)."""
    found = first_unsafe(text)
    if found is None:
        return text
    index, char = found
    raise ValueError(f"character {index + 1} is U+{ord(char):04X} ({escape(char)}), a control, bidi or "
                     f"line-separator character, which this field does not accept; send printable text only")


class SafeFormatter(logging.Formatter):
    """A formatter whose every record starts on a line of its own and holds no character that acts on a terminal.

    The record's line (message and arguments included, wherever they came from) is :func:`escape`-d, so a newline
    in it becomes ``\\n`` and the record stays one line. A traceback or stack (``logger.exception``) keeps its
    lines, which people read, but each is escaped and prefixed with :data:`CONTINUATION`: an exception message
    that carries a newline and a fake record ends up on an indented ``  | `` line, never at column 0.
    """

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        lines = [escape(self.formatMessage(record))]
        # Not record.exc_text: that cache may hold another formatter's unescaped rendering, and writing it would
        # hand ours to the others.
        blocks = [self.formatException(record.exc_info)] if record.exc_info else []
        if not blocks and record.exc_text:
            blocks.append(record.exc_text)
        if record.stack_info:
            blocks.append(self.formatStack(record.stack_info))
        lines += [CONTINUATION + escape(line) for block in blocks for line in block.split("\n")]
        return "\n".join(lines)


def configure_logging(level: int, fmt: str, stream: TextIO | None = None) -> None:
    """Log to ``stream`` (stderr) through a :class:`SafeFormatter` at ``level``: what every entry point calls (the
    ``echo-swarm`` CLI first, then the coordinator or the client with their own level and format), so that no log
    line written by this project can be forged by the text it records.

    Like ``logging.basicConfig`` it leaves a root logger that already has handlers of its own alone (an embedding
    application's or a test runner's logging wins); a handler this function installed is reconfigured instead."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, logging.StreamHandler) and getattr(h, _OURS, False)]
    if root.handlers and not ours:
        return
    if not ours:
        created = logging.StreamHandler(stream if stream is not None else sys.stderr)
        setattr(created, _OURS, True)
        root.addHandler(created)
        ours = [created]
    for handler in ours:
        if stream is not None:
            handler.setStream(stream)
        handler.setFormatter(SafeFormatter(fmt))
    root.setLevel(level)


_OURS = "_echo_swarm_safe_handler"
_FILE = "_echo_swarm_log_file"


def log_to_file(path: Path, fmt: str, *, max_bytes: int = 10 * 2**20, backups: int = 5) -> None:
    """Also write this process's log records to ``path`` (rotated at ``max_bytes``, ``backups`` kept), through a
    :class:`SafeFormatter`: an operator's record of the run that outlives the terminal. One file per process —
    rotating a file that several processes append to loses lines — and a later call replaces an earlier one."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, _FILE, False)]:
        root.removeHandler(handler)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8",
                                                   delay=True)
    setattr(handler, _FILE, True)
    handler.setFormatter(SafeFormatter(fmt))
    root.addHandler(handler)
