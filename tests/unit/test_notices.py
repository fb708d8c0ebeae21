"""Notices (issue 34): the board is the run's, signed with its key, and strict; the store keeps the newest 16 and
writes nothing for a notice the wire would refuse; the client compares release numbers as numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.run import notices
from coordinator.store.store import Store
from shared import crypto, wire
from shared.errors import SignatureError
from shared.messages import MAX_NOTICES, Notice, NoticeBoard, SignedNotices
from shared.records import open_notices, sign_notices
from swarm_client.notices import below, describe


def _board(run_id: str = "run1") -> NoticeBoard:
    return NoticeBoard(run_id=run_id, issued_at=10.0, notices=[
        Notice(notice_id=1, at=5.0, kind="operator", text="hello"),
        Notice(notice_id=2, at=6.0, kind="update", text="update please", min_client_version="0.5")])


def test_a_board_opens_only_with_the_runs_key_for_its_run_and_untouched() -> None:
    key, other = crypto.generate_key(), crypto.generate_key()
    signed = sign_notices(key, _board())
    assert open_notices(signed, crypto.public_bytes(key), "run1") == _board()
    with pytest.raises(SignatureError):
        open_notices(signed, crypto.public_bytes(other), "run1")
    with pytest.raises(ValueError, match="a notice board of run 'run1', not 'run2'"):
        open_notices(signed, crypto.public_bytes(key), "run2")
    tampered = bytearray(signed.board)
    tampered[-3] ^= 1
    with pytest.raises(SignatureError):
        open_notices(SignedNotices(board=bytes(tampered), signature=signed.signature), crypto.public_bytes(key), "run1")
    # a job's signature over the same bytes is not a board's (domain separation)
    job_sig = crypto.sign(key, crypto.JOB_DOMAIN, signed.board)
    with pytest.raises(SignatureError):
        open_notices(SignedNotices(board=signed.board, signature=job_sig), crypto.public_bytes(key), "run1")


@pytest.mark.parametrize("fields", [
    {"text": ""}, {"text": "x" * 501}, {"text": "a\nb"}, {"text": "\x1b[2J"}, {"text": "\u202eevil"},
    {"kind": "update"}, {"min_client_version": "1.0"}, {"kind": "update", "min_client_version": "1.x"},
    {"kind": "shout"}, {"notice_id": 0},
])
def test_a_notice_the_wire_refuses(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Notice.model_validate({"notice_id": 1, "at": 1.0, "kind": "operator", "text": "ok"} | fields)


def test_a_board_carries_at_most_16_notices_and_decodes_strictly() -> None:
    many = [Notice(notice_id=i, at=1.0, kind="operator", text="x") for i in range(1, MAX_NOTICES + 2)]
    with pytest.raises(ValidationError):
        NoticeBoard(run_id="r", issued_at=1.0, notices=many)
    raw = wire.encode(_board())
    assert wire.decode(raw, NoticeBoard) == _board()


def test_the_store_keeps_the_newest_16_and_writes_nothing_for_a_refused_notice(tmp_path: Path) -> None:
    store = Store(tmp_path / "run.sqlite")
    try:
        for i in range(MAX_NOTICES + 3):
            notices.publish(store, float(i), f"n{i}", "operator")
        kept = notices.current(store)
        assert [n.notice_id for n in kept] == list(range(4, MAX_NOTICES + 4))  # ids keep growing
        before = store.get_meta(notices.NOTICES_KEY)
        with pytest.raises(ValidationError):
            notices.publish(store, 1.0, "", "operator")
        with pytest.raises(ValidationError):
            notices.publish(store, 1.0, "needs", "update", None)
        assert store.get_meta(notices.NOTICES_KEY) == before
        assert notices.withdraw(store, 5) and not notices.withdraw(store, 5)
        assert 5 not in [n.notice_id for n in notices.current(store)]
        assert notices.publish(store, 2.0, "next", "run").notice_id == MAX_NOTICES + 4
        key = crypto.generate_key()
        board = open_notices(notices.signed_board(store, key, "r1", 3.0), crypto.public_bytes(key), "r1")
        assert board.notices[-1].text == "next" and len(board.notices) == MAX_NOTICES
    finally:
        store.close()


@pytest.mark.parametrize(("version", "minimum", "older"), [
    ("0.4.9", "0.5", True), ("0.5", "0.5", False), ("0.10", "0.9", False), ("1.0.0", "1", False),
    ("0.5.0rc1", "0.5", False), ("source", "9.9", False)])
def test_release_numbers_compare_as_numbers(version: str, minimum: str, older: bool) -> None:
    assert below(version, minimum) is older


def test_an_update_notice_says_whether_this_client_must_update() -> None:
    notice = Notice(notice_id=3, at=1.0, kind="update", text="new sampler", min_client_version="0.5")
    assert describe(notice, "0.4.0").endswith("(needs echo-swarm 0.5 or newer; this client is 0.4.0: please update "
                                              "(pip install -U echo-swarm))")
    assert describe(notice, "0.5.1").endswith("this client (0.5.1) is recent enough)")


def test_a_finished_run_is_announced_once(tmp_path: Path) -> None:
    """coordinator.run.notices.announce_finished: a ``run`` notice at the last step; a learner restarted after it
    (which reaches the same state again) publishes none."""
    store = Store(tmp_path / "run.sqlite")
    try:
        notices.publish(store, 1.0, "hello", "operator")
        notice = notices.announce_finished(store, 2.0, 200)
        assert notice is not None and notice.kind == "run" and "trained 200 policy versions" in notice.text
        assert notices.announce_finished(store, 3.0, 200) is None
        assert [(n.kind, n.notice_id) for n in notices.current(store)] == [("operator", 1), ("run", 2)]
    finally:
        store.close()
