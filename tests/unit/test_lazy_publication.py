"""Lazy publication (issue 23; coordinator/publish/lazy.py, ``snapshots.lag_tolerance``): a bf16 element is
republished only when the learner's weight moved more than the tolerance from what was published; the learner's
float32 master keeps every update, the published lag stays bounded, anchors resync, and every patch still rebuilds
exactly the published file. Also: the hand-over copy is freed as soon as the files are written, whatever happens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator.config import SnapshotConfig
from coordinator.publish.lazy import LagRule, Settled
from coordinator.publish.publisher import Publication, Publisher
from coordinator.publish.snapshots import SnapshotFiles, SnapshotStore
from coordinator.publish.weights_file import write_weights
from shared import crypto, wire
from shared.deltas import apply_patch
from shared.hashing import sha256_file
from shared.messages import Manifest, SignedManifest

EPS = 2.0**-7  # bfloat16's machine epsilon


def _master(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 200, generator=g) * 0.02, "norm.weight": torch.ones(64)}


def _files(master: dict[str, Any]) -> SnapshotFiles:
    """A hand-over as the learner makes it: the master rounded to bf16 (norms kept in f32), which the store writes
    as ``model.safetensors``."""
    import torch

    state = {k: v.to(torch.float32 if k == "norm.weight" else torch.bfloat16, copy=True) for k, v in master.items()}
    return SnapshotFiles(lambda folder: None, weights=state)


def settle(weights: dict[str, Any], previous: Path, tolerance: float, cap: float | None = None) -> Settled:
    """The rule applied to ``weights`` on their way to a file, as the store does; ``weights`` then hold what was
    written (the writer itself never changes its input: checked here too)."""
    import torch
    from safetensors.torch import load_file

    before = {k: v.clone() for k, v in weights.items()}
    out = previous.with_name(previous.name + ".next")
    done = write_weights(out, weights, {"format": "pt"}, LagRule(previous, tolerance, cap))
    assert done is not None
    assert all(torch.equal(before[k], v) for k, v in weights.items())
    weights.update(load_file(str(out)))
    return done


def _published(store: SnapshotStore, version: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(store.folder(version) / "model.safetensors"))


def _entries(store: SnapshotStore, version: int) -> dict[str, Any]:
    signed = store.signed_manifest(version)
    assert signed is not None
    return {f.path: f for f in wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest).files}


def _delta(master: dict[str, Any]) -> float:
    import torch

    rounded = master["a.weight"].to(torch.bfloat16).float()
    return 0.5 * EPS * float(rounded.square().mean().sqrt())


def test_an_element_within_the_tolerance_is_held_one_beyond_is_republished_and_the_patch_rebuilds_it(
        tmp_path: Path) -> None:
    import torch

    store = SnapshotStore(tmp_path / "s", crypto.generate_key(), "run", anchor_every=100, lag_tolerance=0.5)
    master = _master()
    store.publish(0, _files(master), now=1.0)
    v0 = _published(store, 0)["a.weight"]
    # every weight takes a small step (Adam's ~lr), a few a large one
    master["a.weight"] += 2e-5
    master["a.weight"][0, :10] += 0.01
    master["norm.weight"] += 1e-6
    kept_master = {k: v.clone() for k, v in master.items()}
    files = _files(master)
    store.publish(1, files, now=1.0)
    assert store.last_settled is not None and store.last_settled.held > 0 and store.last_settled.republished > 0
    published = _published(store, 1)
    rounded = master["a.weight"].to(torch.bfloat16)
    delta = _delta(master)
    gap = (rounded.float() - v0.float()).abs()
    held = (rounded != v0) & (gap <= delta)
    assert int(held.sum()) > 1000  # small weights whose rounding moved, held back
    assert torch.equal(published["a.weight"][held], v0[held])
    assert torch.equal(published["a.weight"][~held], rounded[~held])  # the rest, the large steps included
    assert torch.equal(published["a.weight"][0, :10], rounded[0, :10])
    assert torch.equal(published["norm.weight"], master["norm.weight"])  # float32: nothing rounded, nothing held
    assert all(torch.equal(master[k], kept_master[k]) for k in master)  # the master keeps every update
    assert not files.weights and files.written.is_set()  # the hand-over copy was freed once written
    entries = _entries(store, 1)
    full, patch = entries["model.safetensors"], entries["model.safetensors.delta"]
    base = _entries(store, 0)["model.safetensors"]
    out = tmp_path / "rebuilt"
    digest = apply_patch(store.folder(0) / "model.safetensors", store.folder(1) / "model.safetensors.delta", out,
                         base_sha256=base.sha256, result_sha256=full.sha256)
    assert digest == full.sha256 == sha256_file(out)
    assert patch.size < full.size


def test_the_lag_is_bounded_a_drifting_weight_is_republished_and_an_anchor_resyncs(tmp_path: Path) -> None:
    """Error feedback: every version follows the rule exactly against the previous published version; a small
    weight that keeps drifting is held while its drift is within δ and republished once past it; the published
    value is never more than δ + ulp/2 from the master; an anchor publishes the exact rounding."""
    import torch

    store = SnapshotStore(tmp_path / "s", crypto.generate_key(), "run", anchor_every=12, lag_tolerance=0.5)
    master = _master(1)
    sign = torch.sign(torch.randn(300, 200, generator=torch.Generator().manual_seed(2)))
    master["a.weight"][1, 0], sign[1, 0] = 0.001, 1.0  # ulp 2^-17 ≈ 7.6e-6: its rounding moves at every step
    store.publish(0, _files(master), now=1.0)
    previous = _published(store, 0)["a.weight"]
    small: list[float] = []
    for v in range(1, 13):
        master["a.weight"] += 1e-5 * sign  # a steady drift of lr per step, as Adam's first steps
        store.publish(v, _files(master), now=1.0)
        published = _published(store, v)["a.weight"]
        rounded = master["a.weight"].to(torch.bfloat16)
        delta = _delta(master)
        if v == 12:  # the anchor: the exact rounding, published whole
            assert torch.equal(published, rounded) and "model.safetensors.delta" not in _entries(store, v)
            break
        expect = torch.where((rounded.float() - previous.float()).abs() > delta, rounded, previous)
        assert torch.equal(published, expect), v
        _, exponent = torch.frexp(master["a.weight"])
        half_ulp = torch.pow(2.0, (exponent - 9).float())  # bf16 keeps 8 significant bits
        assert bool(((published.float() - master["a.weight"]).abs() <= delta + half_ulp + 1e-12).all()), v
        small.append(float(published[1, 0]))
        previous = published
    moved = [i for i in range(1, len(small)) if small[i] != small[i - 1]]
    assert small[0] == small[1] == float(torch.tensor(0.001).to(torch.bfloat16))  # held at first, though it moved
    assert moved and 1e-5 * (moved[0] + 1) > 0.5 * EPS * 0.02 * 0.9  # republished once it drifted ~δ


def test_tolerance_zero_publishes_every_rounding_exactly(tmp_path: Path) -> None:
    import torch

    store = SnapshotStore(tmp_path / "s", crypto.generate_key(), "run", anchor_every=100, lag_tolerance=0.0)
    master = _master()
    store.publish(0, _files(master), now=1.0)
    master["a.weight"] += 2e-5
    store.publish(1, _files(master), now=1.0)
    assert store.last_settled is None
    assert torch.equal(_published(store, 1)["a.weight"], master["a.weight"].to(torch.bfloat16))


def test_settle_leaves_tensors_the_previous_file_lacks_or_shapes_differently(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    previous = tmp_path / "p.safetensors"
    save_file({"a": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.bfloat16)},
              str(previous))
    weights = {"a": torch.full((4, 4), 1e-4, dtype=torch.bfloat16), "b": torch.full((4,), 1e-4, dtype=torch.bfloat16),
               "c": torch.full((2,), 1e-4, dtype=torch.bfloat16)}
    done = settle(weights, previous, tolerance=0.5)  # 'a' is held (its RMS is 1e-4: δ is tiny), 'b', 'c' are not
    assert done.elements == 16
    assert torch.equal(weights["b"], torch.full((4,), 1e-4, dtype=torch.bfloat16))
    assert torch.equal(weights["c"], torch.full((2,), 1e-4, dtype=torch.bfloat16))
    big = {"a": torch.full((4, 4), 1e-4, dtype=torch.bfloat16)}
    big["a"][0, 0] = 1.0  # the RMS (0.25) makes δ ≈ 1e-3: the 1e-4 moves are held, the 1.0 is not
    done = settle(big, previous, tolerance=0.5)
    assert (done.held, done.republished) == (15, 1)
    assert float(big["a"][0, 0]) == 1.0 and not bool(big["a"].view(-1)[1:].any())


def test_the_hand_over_copy_is_released_even_when_publication_fails(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s", crypto.generate_key(), "run", anchor_every=100, lag_tolerance=0.5)
    publisher = Publisher(store, checkpoints=None)  # type: ignore[arg-type]  # no checkpoint is due
    files = _files(_master())

    def broken(folder: Path) -> None:
        raise OSError("disk full")

    failing = SnapshotFiles(broken, weights=files.weights)
    try:
        with pytest.raises(OSError, match="disk full"):
            publisher.submit(Publication(0, failing, 1.0)).result(timeout=60)
    finally:
        publisher.close()
    assert failing.written.is_set() and not failing.weights


@pytest.mark.parametrize("value", [-0.1, 16.5])
def test_config_refuses_a_tolerance_out_of_range_and_says_why(value: float) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="lag_tolerance must be between 0"):
        SnapshotConfig(lag_tolerance=value)
    assert SnapshotConfig().lag_tolerance == 0.5


def test_gguf_is_written_block_by_block_with_the_same_bytes(tmp_path: Path, tiny_model_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed GGUF export converts a few rows at a time; the file is the same as converting whole tensors."""
    import torch
    from safetensors.torch import load_file

    from coordinator.publish import gguf_export

    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    for precision in ("f16", "q8_0"):
        whole, rows = tmp_path / f"whole-{precision}.gguf", tmp_path / f"rows-{precision}.gguf"
        gguf_export.write_model_gguf(whole, tiny_model_dir, state, precision)
        monkeypatch.setattr(gguf_export, "CHUNK_ELEMENTS", 37)  # less than one row: one row at a time
        gguf_export.write_model_gguf(rows, tiny_model_dir, state, precision)
        monkeypatch.undo()
        assert sha256_file(whole) == sha256_file(rows)


def test_the_threshold_is_capped_at_lag_steps_times_lr(tmp_path: Path) -> None:
    """snapshots.lag_steps: δ never exceeds lag_steps × lr, so a weight is held back by at most that many steps of
    its movement however large its tensor's RMS; the store takes the cap from the config (lag_steps × learner.lr)."""
    import torch
    from safetensors.torch import save_file

    from coordinator.config import load_config
    from coordinator.run.runfiles import RunFiles

    previous = tmp_path / "p.safetensors"
    base = torch.full((4, 4), 0.5, dtype=torch.bfloat16)
    save_file({"a": base}, str(previous))
    moved = base.clone()
    moved.view(-1)[:8] = torch.tensor(0.5 + 2**-8).to(torch.bfloat16)  # one ulp (2^-8) up: |Δ| = 3.9e-3
    uncapped = {"a": moved.clone()}
    assert settle(uncapped, previous, tolerance=1.0).held == 8  # δ = 2^-7 × 0.5 ≈ 3.9e-3: all held
    capped = {"a": moved.clone()}
    assert settle(capped, previous, tolerance=1.0, cap=1e-3).republished == 8  # δ = 1e-3: all republished
    assert torch.equal(capped["a"], moved)
    config = load_config(None, {"run_dir": str(tmp_path / "run"), "learner": {"lr": 2e-5},
                                "snapshots": {"lag_steps": 4}})
    files = RunFiles.open(config)
    try:
        assert files.snapshots.lag_cap == pytest.approx(8e-5) and files.snapshots.lag_tolerance == 0.5
    finally:
        files.close()
