"""shared/safe_text.py and the schema that uses it: client strings that would act on a log or a terminal are
refused at decode (schema_invalid, naming the field); whatever reaches a log anyway stays one escaped record."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from typing import Any

import pydantic
import pytest

from shared import PROTOCOL_VERSION, wire
from shared.errors import ProtocolError, Reason
from shared.messages import ClientProfile, ErrorBody, Info, RegisterRequest
from shared.safe_text import CONTINUATION, SafeFormatter, check_printable, escape, first_unsafe

from .factories import profile

FORGED = "\n2026-11-30 23:59:59,000 CRITICAL coordinator.api.app: learner loop stopped"
CLEAR = "\x1b[2J\x1b[H"
OSC8 = "\x1b]8;;https://evil.example\x07click\x1b]8;;\x07"

# Every class of character the rule refuses, by name: each one forges a line, moves the cursor, starts an escape
# sequence or reorders what a person reads.
UNSAFE = {
    "newline": "\n", "carriage return": "\r", "tab": "\t", "nul": "\x00", "escape": "\x1b", "bell": "\x07",
    "backspace": "\x08", "vertical tab": "\x0b", "form feed": "\x0c", "del": "\x7f", "c1 nel": "\x85",
    "c1 csi": "\x9b", "c1 osc": "\x9d", "arabic letter mark": "\u061c", "lrm": "\u200e", "rlm": "\u200f",
    "lre": "\u202a", "rlo": "\u202e", "lri": "\u2066", "pdi": "\u2069", "line separator": "\u2028",
    "paragraph separator": "\u2029", "lone surrogate": "\ud800",
}

# What honest clients send (swarm_client/hardware.py builds these), and names people pick: all must pass.
HONEST = [
    "cpu", "mps", "cuda:NVIDIA GeForce RTX 3060", "cuda:NVIDIA H100 80GB HBM3", "cuda:AMD Radeon RX 7900 XTX",
    "Linux x86_64", "Darwin arm64", "Windows AMD64", "echo-swarm 0.1.0", "echo-swarm (source)",
    "NVIDIA GeForce RTX 4090 Laptop GPU", "Apple silicon", "Zoë's box", "東京-GPU-01", "مختبر", "עברית",
    "🦀 crab", "👩‍💻 dev", "🏳️‍🌈", "x" * 64, "a [b] {c} <d> \\e", "",
]


# ---- the character rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("char", UNSAFE.values(), ids=UNSAFE.keys())
def test_unsafe_characters_are_found_and_escaped(char: str) -> None:
    text = f"ab{char}cd"
    assert first_unsafe(text) == (2, char)
    shown = escape(text)
    assert first_unsafe(shown) is None and shown.startswith("ab") and shown.endswith("cd")
    assert "\\" in shown  # written as a visible escape, not dropped
    with pytest.raises(ValueError, match=rf"character 3 is U\+{ord(char):04X}"):
        check_printable(text)


@pytest.mark.parametrize("text", HONEST)
def test_honest_text_passes_unchanged(text: str) -> None:
    assert first_unsafe(text) is None
    assert escape(text) == text
    assert check_printable(text) == text


def test_escape_forms() -> None:
    assert escape("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert escape(CLEAR) == "\\x1b[2J\\x1b[H"
    assert escape("\x85\u202e\u2028") == "\\x85\\u202e\\u2028"


# ---- at the schema: every client-supplied string ---------------------------------------------------------
PROFILE_FIELDS = ["name", "device", "platform", "software", "gpu"]


def register_bytes(profile_fields: dict[str, Any], invite: str = "") -> bytes:
    """A RegisterRequest as a hostile client would encode it: plain msgpack, no local validation."""
    body = profile().model_dump() | profile_fields
    return wire.pack({"public_key": b"k" * 32, "profile": body, "invite": invite})


@pytest.mark.parametrize("field", PROFILE_FIELDS)
@pytest.mark.parametrize("payload", [FORGED, CLEAR, OSC8, "name\u202egnp.exe", "a\u2028b"],
                         ids=["forged-log-line", "clear-screen", "osc8-link", "bidi-override", "line-separator"])
def test_profile_text_with_control_characters_is_schema_invalid(field: str, payload: str) -> None:
    value = payload[:60]
    with pytest.raises(ProtocolError) as info:
        wire.decode(register_bytes({field: value}), RegisterRequest)
    err = info.value
    assert err.reason is Reason.SCHEMA and err.http_status == 422
    assert f"RegisterRequest.profile.{field}:" in err.message  # which field
    assert "printable text" in err.message  # what to do
    assert first_unsafe(err.message) is None  # the refusal itself carries no raw control character


def test_invite_with_control_characters_is_schema_invalid() -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode(register_bytes({}, invite="tok\r\nen"), RegisterRequest)
    assert info.value.reason is Reason.SCHEMA and "RegisterRequest.invite:" in info.value.message


@pytest.mark.parametrize("field", PROFILE_FIELDS)
def test_honest_profile_values_still_decode(field: str) -> None:
    for text in HONEST:
        value = text[:64] if field == "name" else text
        decoded = wire.decode(register_bytes({field: value}, invite="inv-2f9a_TOKEN"), RegisterRequest)
        assert getattr(decoded.profile, field) == value


def test_the_reference_clients_own_profile_passes() -> None:
    from swarm_client.hardware import Gpu, Hardware
    from swarm_client.hardware import profile as build_profile

    hw = Hardware(cpu_count=8, memory_gb=31.2, gpus=(Gpu("NVIDIA GeForce RTX 3060", 12.0),), apple_silicon=False,
                  disk_free_gb=100.0)
    built = build_profile("torch", "cpu", "alice", hw, 123.4)
    assert wire.decode(wire.encode(RegisterRequest(public_key=b"k" * 32, profile=built)), RegisterRequest).profile == built


def test_the_rule_also_holds_for_locally_built_messages() -> None:
    with pytest.raises(pydantic.ValidationError):
        ClientProfile(name="x\x1b[2J", backend="torch", device="cpu", platform="p", cpu_count=1, memory_gb=1.0,
                      software="s")


def test_coordinator_strings_a_client_decodes_are_checked_too() -> None:
    # ShortText is one type: a coordinator's Info cannot smuggle an escape sequence into the volunteer's terminal.
    info = {"protocol": PROTOCOL_VERSION, "run_id": "abc\x1b]0;pwned\x07", "coordinator_public_key": b"k" * 32,
            "current_version": 0, "sync_mode": "sequential-pull", "task": "arithmetic", "finished": False,
            "server_time": 1.0}
    with pytest.raises(ProtocolError) as err:
        wire.decode(wire.pack(info), Info)
    assert "Info.run_id:" in err.value.message
    # An error message is free text (≤ 2048, may span lines): decoded as is, escaped where it is shown.
    assert wire.decode(wire.pack({"error": "rate_limited", "message": "a\nb"}), ErrorBody).message == "a\nb"


# ---- logs: one record per line -----------------------------------------------------------------------
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
FMT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def capture(fmt: str = FMT) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SafeFormatter(fmt))
    log = logging.getLogger(f"test_safe_text.{id(stream)}")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return log, stream


def assert_records(text: str, n: int) -> list[str]:
    """Exactly ``n`` records: every line at column 0 is a record, everything else is a continuation line."""
    lines = text.splitlines()
    records = [line for line in lines if not line.startswith(CONTINUATION)]
    assert len(records) == n, lines
    assert all(RECORD.match(line) for line in records), records
    assert "\x1b" not in text and "\r" not in text and first_unsafe(text.replace("\n", "")) is None
    return records


@pytest.mark.parametrize("where", ["message", "args"])
def test_a_forged_record_in_client_text_stays_one_escaped_line(where: str) -> None:
    log, stream = capture()
    name = "mallory" + FORGED + CLEAR + "\u202e"
    if where == "message":
        log.info("registered client " + name.replace("%", "%%"))
    else:
        log.info("registered client %s (%s, %s)", name, "torch", "cuda:\r\x1b]8;;http://x\x07")
    (line,) = assert_records(stream.getvalue(), 1)
    assert "\\n2026-11-30 23:59:59,000 CRITICAL coordinator.api.app: learner loop stopped" in line
    assert "\\x1b[2J\\x1b[H" in line and "\\u202e" in line
    assert " CRITICAL " not in line.split(": ", 1)[0]  # the level the reader sees is the real one


def test_an_exception_message_cannot_start_a_record() -> None:
    log, stream = capture()
    try:
        raise ValueError("bad device " + FORGED + CLEAR)
    except ValueError:
        log.exception("internal error handling %s %s", "POST", "/v1/register")
    out = stream.getvalue()
    (record,) = assert_records(out, 1)
    assert record.endswith("internal error handling POST /v1/register")
    rest = out.splitlines()[1:]
    assert rest[0] == CONTINUATION + "Traceback (most recent call last):"
    assert any("CRITICAL coordinator.api.app: learner loop stopped" in line for line in rest)  # kept, but indented
    assert any("\\x1b[2J" in line for line in rest)


def test_stack_info_is_indented_too() -> None:
    log, stream = capture()
    log.warning("with stack", stack_info=True)
    out = stream.getvalue()
    assert_records(out, 1)
    assert out.splitlines()[1] == CONTINUATION + "Stack (most recent call last):"


def test_another_handlers_cached_traceback_is_not_reused_raw() -> None:
    log, stream = capture()
    plain = io.StringIO()
    other = logging.StreamHandler(plain)
    other.setFormatter(logging.Formatter(FMT))
    log.handlers.insert(0, other)  # a plain formatter runs first and caches record.exc_text
    try:
        raise RuntimeError("x" + FORGED)
    except RuntimeError:
        log.exception("boom")
    assert any(line.startswith("2026-11-30") for line in plain.getvalue().splitlines())  # the attack, unescaped
    assert_records(stream.getvalue(), 1)


def test_configure_logging_is_what_the_entry_points_install() -> None:
    """In a fresh interpreter, as `echo-swarm` starts: the CLI installs the safe handler, the coordinator's run()
    reconfigures it (INFO, timestamps), and a record carrying a forged line and an escape stays one line."""
    script = (
        "import logging, sys\n"
        "from shared.safe_text import configure_logging\n"
        "configure_logging(logging.WARNING, '%(levelname)s %(name)s: %(message)s')\n"
        f"configure_logging(logging.INFO, {FMT!r}, sys.stderr)\n"
        "assert len(logging.getLogger().handlers) == 1\n"
        f"logging.getLogger('coordinator.api.service').info('registered client %s', {('x' + FORGED + CLEAR)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    (line,) = assert_records(done.stderr, 1)
    assert " INFO coordinator.api.service: registered client x\\n2026-11-30" in line


def test_configure_logging_leaves_foreign_handlers_alone() -> None:
    script = (
        "import io, logging\n"
        "from shared.safe_text import SafeFormatter, configure_logging\n"
        "logging.basicConfig(stream=io.StringIO())\n"
        "configure_logging(logging.INFO, '%(message)s')\n"
        "(h,) = logging.getLogger().handlers\n"
        "assert not isinstance(h.formatter, SafeFormatter)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
