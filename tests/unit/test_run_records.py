"""The records that cross a role boundary (coordinator.run.records): encoded once by the writer, read by attribute
by the reader, and an older run's payloads still read after an upgrade (a restart replays recorded steps)."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.engine.learner import LearnerDescription
from coordinator.engine.verifier import VerifierDescription
from coordinator.run.names import API, LEARNER, P2P
from coordinator.run.records import (
    AcceptedResult,
    LearnerProgress,
    LearnerReport,
    P2PReport,
    ProcessReport,
    VerifierReport,
)
from coordinator.store.store import Store
from shared import wire


def test_an_accepted_result_round_trips_with_and_without_a_loss_mask() -> None:
    plain = AcceptedResult(completions=[[5, 6], [7]], behaviour_logprobs=[[-0.5, -1.0], [-2.0]],
                           recomputed_logprobs=[[-0.4, -1.1], [-2.1]], finish_reasons=["stop", "length"],
                           logprob_mean_abs_diff=0.1, reward_means={"last_number": 0.5})
    assert AcceptedResult.decode(plain.encode()) == plain
    assert "loss_mask" not in wire.unpack(plain.encode())  # a single-turn result stores no mask
    episodes = AcceptedResult(completions=[[5, 9, 6]], behaviour_logprobs=[[-0.5, -3.0, -1.0]],
                              recomputed_logprobs=[[-0.4, -3.0, -1.1]], finish_reasons=["stop"],
                              logprob_mean_abs_diff=0.0, reward_means={"episode": 1.0}, loss_mask=[[1, 0, 1]])
    decoded = AcceptedResult.decode(episodes.encode())
    assert decoded == episodes and decoded.loss_mask == [[1, 0, 1]]


def test_a_payload_of_an_older_run_still_decodes() -> None:
    """Before per-reward means (and for single-turn jobs, always) a payload had fewer keys: the learner's replay of a
    recorded step must still read it."""
    old = wire.pack({"completions": [[1, 2]], "behaviour_logprobs": [[-1.0, -1.0]],
                     "recomputed_logprobs": [[-1.0, -0.9]], "finish_reasons": ["stop"],
                     "logprob_mean_abs_diff": 0.05})
    result = AcceptedResult.decode(old)
    assert result.completions == [[1, 2]] and result.recomputed_logprobs == [[-1.0, -0.9]]
    assert result.reward_means == {} and result.loss_mask is None


def _learner_report(**fields: object) -> LearnerReport:
    base: dict[str, Any] = dict(target=3, version=2, in_training=["j1"], busy_s=1.5, last_error=None, publishing=[3],
                                last_checkpoint=2, snapshot_dtype="float32", trained_version=3, parameters=1000,
                                device="cpu", vocab_size=64)
    return LearnerReport(**(base | fields))


def test_a_role_report_is_a_record_never_a_hand_built_dict(tmp_path: Path) -> None:
    """Issue 33: the store's role status takes only a report record, so a report whose keys a reader does not expect
    (a misspelt ``busy_S``, a missing ``target``) cannot be written — it is refused where it is built, in the
    writer's process, before anything reaches the store."""
    store = Store(tmp_path / "coordinator.sqlite")
    try:
        with pytest.raises(TypeError, match="a role report is a record of coordinator.run.records, not a dict"):
            store.role_status.set(LEARNER, {"pid": 1, "at": 2.0, "target": 3})  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match="busy_S"):
            _learner_report(busy_S=1.0)  # a misspelt field
        with pytest.raises(ValidationError, match="target"):
            LearnerReport(version=2, in_training=[], busy_s=0.0, last_error=None, publishing=[],  # type: ignore[call-arg]
                          last_checkpoint=None, snapshot_dtype=None, trained_version=None)
        assert store.role_status.all() == {}
        report = _learner_report()
        store.role_status.set(LEARNER, report)
        stored = store.role_status.get(LEARNER)
        assert stored is not None and LearnerReport.model_validate(stored) == report  # one codec, both ways
        assert stored["pid"] == os.getpid() and stored["vocab_size"] == 64  # stamped; served as docs/protocol.md §4
        assert LearnerProgress.model_validate(stored).target == 3  # the API's view of it
        store.role_status.set(P2P, P2PReport(peer_id="12D3Koo", maddrs=["/ip4/127.0.0.1/tcp/1"]))
        p2p = store.role_status.get(P2P)
        assert p2p is not None and P2PReport.model_validate(p2p).peer_id == "12D3Koo"
        store.role_status.set(API, ProcessReport(started_at=5.0))
        assert set(store.role_status.all()) == {LEARNER, P2P, API}
    finally:
        store.close()


def test_the_reports_declare_what_their_engines_describe() -> None:
    """VerifierReport and LearnerReport repeat the keys of their engine's description (the engine and the run files
    do not import each other): the same names with the same types (the learner's None until its model is built),
    so a figure an engine adds cannot be refused at the role's first report."""
    described = typing.get_type_hints(VerifierDescription)
    declared = {name: f.annotation for name, f in VerifierReport.model_fields.items()}
    assert {name: declared.get(name) for name in described} == described
    learner = {name: f.annotation for name, f in LearnerReport.model_fields.items()}
    assert {name: learner.get(name) for name in typing.get_type_hints(LearnerDescription)} == {
        name: t | None for name, t in typing.get_type_hints(LearnerDescription).items()}
