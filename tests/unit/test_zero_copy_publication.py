"""The zero-copy hand-over (issue 23): a learner whose live weights already are in the publish dtype on the CPU (a
bf16 learner publishing bf16) hands them over instead of a copy. The version's files must be byte for byte those
the copy path wrote (safetensors settled by lazy publication, GGUF from the same values), publication must never
change the learner's weights, and the next optimizer update must wait until they are written — also with a
checkpoint in the same hand-over. Real files, real torch, the tiny model."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import LearnerConfig, ModelConfig
from coordinator.engine.learner import Learner, Sample
from coordinator.publish import lazy, weights_file
from coordinator.publish.checkpoints import CheckpointStore
from coordinator.publish.gguf_export import write_model_gguf
from coordinator.publish.lazy import LagRule
from coordinator.publish.publisher import Publication, Publisher
from coordinator.publish.snapshots import MANIFEST_FILE, SnapshotStore
from coordinator.publish.weights_file import StoredWeights, write_weights
from shared import crypto


def _learner(model_dir: Path, **cfg: Any) -> Learner:
    return Learner(model_dir, ModelConfig(device="cpu"),
                   LearnerConfig(**({"lr": 1e-3, "threads": 1, "precision": "bf16"} | cfg)), 1.0, gguf="f16")


def _samples(learner: Learner, seed: int) -> list[Sample]:
    import random

    rng = random.Random(seed)
    prompt = learner.encode(f"Q: {seed}+{seed}= A:")
    comps = [[rng.randrange(32, 127) for _ in range(6)] for _ in range(4)]
    old = learner.recompute([prompt] * 4, comps)
    return [Sample(prompt, c, o, o, a) for c, o, a in zip(comps, old, [1.0, -1.0, 1.0, -1.0], strict=True)]


def _mixed() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {
        "b.weight": torch.randn(37, 11, generator=g).to(torch.bfloat16),
        "a.weight": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "h": torch.randn(9, generator=g).to(torch.float16),
        "f": torch.randn(4, 4, generator=g),
        "d": torch.randn(3, generator=g).double(),
        "i": torch.arange(7, dtype=torch.int64),
        "j": torch.arange(5, dtype=torch.int32),
        "s": torch.arange(3, dtype=torch.int16),
        "u": torch.arange(6, dtype=torch.uint8),
        "k": torch.arange(2, dtype=torch.int8),
        "m": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    return out


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
def test_the_weights_file_is_byte_for_byte_what_save_file_writes(tmp_path: Path, metadata: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Same header (order by dtype then name, offsets, padding), same data, whatever the chunk size."""
    import torch
    from safetensors.torch import save_file

    tensors = _mixed()
    before = {k: v.clone() for k, v in tensors.items()}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    write_weights(tmp_path / "ours.safetensors", tensors, metadata)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    monkeypatch.setattr(weights_file, "CHUNK_ELEMENTS", 5)
    write_weights(tmp_path / "small.safetensors", tensors, metadata)
    assert (tmp_path / "small.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert all(torch.equal(before[k], v) for k, v in tensors.items())


def test_settling_a_chunk_at_a_time_never_touches_the_input_and_reads_back_row_by_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import load_file

    tensors = _mixed()
    write_weights(tmp_path / "prev.safetensors", tensors, {"format": "pt"})
    moved = {k: v.clone() for k, v in tensors.items()}
    moved["b.weight"] = (moved["b.weight"].float() * (1 + 2**-8)).to(torch.bfloat16)  # about one ulp
    moved["b.weight"][0, :3] += 1.0
    frozen = {k: v.clone() for k, v in moved.items()}
    whole = write_weights(tmp_path / "whole.safetensors", moved, {"format": "pt"},
                          LagRule(tmp_path / "prev.safetensors", 0.5))
    monkeypatch.setattr(lazy, "CHUNK_ELEMENTS", 7)
    chunked = write_weights(tmp_path / "chunked.safetensors", moved, {"format": "pt"},
                            LagRule(tmp_path / "prev.safetensors", 0.5))
    assert all(torch.equal(frozen[k], v) for k, v in moved.items())  # the input is never written to
    assert whole == chunked and whole is not None and whole.held > 0 and whole.republished >= 3
    assert (tmp_path / "whole.safetensors").read_bytes() == (tmp_path / "chunked.safetensors").read_bytes()
    published = load_file(str(tmp_path / "whole.safetensors"))
    assert torch.equal(published["b.weight"][0, :3], moved["b.weight"][0, :3])
    stored = StoredWeights(tmp_path / "whole.safetensors", ["b.weight", "f", "empty", "scalar"])
    assert list(stored) == ["b.weight", "f", "empty", "scalar"]
    assert torch.equal(stored["b.weight"][10:20], published["b.weight"][10:20])
    assert torch.equal(stored["b.weight"][30:99], published["b.weight"][30:])
    assert torch.equal(stored["f"][0:4], published["f"])
    assert torch.equal(StoredWeights(tmp_path / "whole.safetensors")["h"].reshape(-1)[2:5], published["h"][2:5])
    assert stored["empty"][0:0].shape == (0, 4) and float(stored["scalar"][0:1]) == 1.5
    (tmp_path / "prev.safetensors").unlink()  # pruned under the publisher: published whole
    assert write_weights(tmp_path / "again.safetensors", moved, {"format": "pt"},
                         LagRule(tmp_path / "prev.safetensors", 0.5)) is None


def _copy_path(state: dict[str, Any], folder: Path, previous: Path | None, tolerance: float) -> None:
    """What publication did before the zero-copy hand-over, as an independent reference: the hand-over copy settled
    in place (the rule of coordinator.publish.lazy), ``save_file``, then the GGUF written from the copy."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    if previous is not None and tolerance > 0:
        prev = load_file(str(previous))
        for name, new in state.items():
            old = prev.get(name)
            if new.dtype != torch.bfloat16 or old is None or old.dtype != new.dtype or old.shape != new.shape:
                continue
            bits = new.view(-1).view(torch.int16).numpy().view(np.uint16)
            delta = tolerance * float(torch.finfo(new.dtype).eps) * lazy._rms(bits, "bfloat16")
            near = (new.view(torch.int16) != old.view(torch.int16)) & ((new.float() - old.float()).abs() <= delta)
            new[near] = old[near]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_model_gguf(folder / "model.gguf", folder, state, "f16")


@pytest.mark.parametrize("tolerance", [0.0, 0.5])
def test_live_weights_publish_the_same_files_as_the_copy_did_and_are_left_alone(
        tmp_path: Path, tiny_model_dir: Path, tolerance: float) -> None:
    import torch

    learner = _learner(tiny_model_dir)
    store = SnapshotStore(tmp_path / "s", crypto.generate_key(), "run", anchor_every=100, lag_tolerance=tolerance)
    live = learner.model.state_dict()
    held = 0
    for v in range(3):
        if v:
            learner.train_step(_samples(learner, v))
        copy = {k: t.detach().clone() for k, t in live.items() if k != "lm_head.weight"
                or not learner.model.config.tie_word_embeddings}
        files = learner.snapshot_files("training")
        assert files.weights is not None and files.weights["model.norm.weight"].data_ptr() == \
            live["model.norm.weight"].data_ptr()  # handed over, not copied
        store.publish(v, files, now=1.0)
        assert all(torch.equal(copy[k], live[k]) for k in copy)  # publication never wrote to the learner's weights
        held += store.last_settled.held if store.last_settled is not None else 0
        ref = tmp_path / f"ref{v}"
        shutil.copytree(store.folder(v), ref, ignore=shutil.ignore_patterns("model.*", MANIFEST_FILE))
        _copy_path(copy, ref, tmp_path / f"ref{v - 1}" / "model.safetensors" if v else None, tolerance)
        ours = sorted(p.name for p in store.folder(v).iterdir() if p.name != MANIFEST_FILE
                      and not p.name.endswith(".delta"))
        assert ours == sorted(p.name for p in ref.iterdir())
        for name in ours:
            assert (store.folder(v) / name).read_bytes() == (ref / name).read_bytes(), (v, name)
    assert (held > 0) == (tolerance > 0)  # the comparison covered settled elements


def test_the_next_optimizer_update_waits_until_the_live_weights_are_written(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    """With a checkpoint due in the same hand-over (two gates, released in turn by one publisher thread): the
    step's forward and backward run, its update waits, the written version is the handed-over one, no deadlock."""
    import torch
    from safetensors.torch import load_file

    learner = _learner(tiny_model_dir)
    learner.train_step(_samples(learner, 1))
    files = learner.snapshot_files("bfloat16")
    state = learner.checkpoint_state()
    params = dict(learner.model.named_parameters())
    frozen = {n: p.detach().clone() for n, p in params.items()}
    out: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: out.update(learner.train_step(_samples(learner, 2))))
    worker.start()
    worker.join(timeout=3.0)  # a forward + backward of the tiny model takes milliseconds
    assert worker.is_alive()  # held at the optimizer step
    assert all(torch.equal(frozen[n], p) for n, p in params.items())
    publisher = Publisher(SnapshotStore(tmp_path / "s", crypto.generate_key(), "run"),
                          CheckpointStore(tmp_path / "c"))
    try:
        publisher.submit(Publication(1, files, 1.0, state)).result(timeout=120)
    finally:
        publisher.close()
    worker.join(timeout=60)
    assert not worker.is_alive() and out["publish_gate_s"] > 0
    assert any(not torch.equal(frozen[n], p) for n, p in params.items())
    written = load_file(str(tmp_path / "s" / "v000001" / "model.safetensors"))
    assert all(torch.equal(written[n], frozen[n]) for n in written)


def test_a_copy_does_not_hold_the_next_update(tiny_model_dir: Path) -> None:
    """A float32 learner publishing bfloat16 hands over a copy: its next step does not wait for the write."""
    learner = _learner(tiny_model_dir, precision="float32")
    files = learner.snapshot_files("bfloat16")
    assert files.weights is not None and {str(t.dtype) for t in files.weights.values()} == {"torch.bfloat16"}
    out = learner.train_step(_samples(learner, 1))
    assert out["publish_gate_s"] == 0.0 and not files.written.is_set()
    files.release()
