"""The learner's critical path (issue 12): publication from a copy of the weights on the publisher's thread,
checkpoints every N steps with replay, snapshots in a configured dtype, evaluation from a published snapshot,
and the run-level shared base folder of snapshots. Real files, real torch, the tiny model."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import ArithmeticTaskConfig, LearnerConfig, ModelConfig, load_config
from coordinator.engine.learner import Learner, Sample
from coordinator.publish.checkpoints import CheckpointState, CheckpointStore, ShardedCheckpoint
from coordinator.publish.publisher import Publication, Publisher
from coordinator.publish.snapshots import SnapshotFiles, SnapshotStore
from shared import crypto, wire
from shared.hashing import sha256_file
from shared.messages import Manifest, SignedManifest


def _learner(model_dir: Path, **cfg: Any) -> Learner:
    return Learner(model_dir, ModelConfig(device="cpu"), LearnerConfig(**({"lr": 1e-2, "threads": 1} | cfg)), 1.0,
                   gguf="off")


def _samples(learner: Learner, seed: int) -> list[Sample]:
    """A batch with non-zero advantages: four completions of one prompt, rewarded 1, 0, 1, 0."""
    import random

    rng = random.Random(seed)
    prompt = learner.encode(f"Q: {seed}+{seed}= A:")
    comps = [[rng.randrange(32, 127) for _ in range(6)] for _ in range(4)]
    old = learner.recompute([prompt] * 4, comps)
    advs = [1.0, -1.0, 1.0, -1.0]
    return [Sample(prompt, c, o, o, a) for c, o, a in zip(comps, old, advs, strict=True)]


def _manifest(store: SnapshotStore, version: int) -> Manifest:
    signed = store.signed_manifest(version)
    assert signed is not None
    return wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)


def _params(learner: Learner) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def test_snapshot_in_bfloat16_is_the_rounded_learner_and_loads_as_a_model(tmp_path: Path,
                                                                          tiny_model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from shared.policy import load_model

    learner = _learner(tiny_model_dir)
    files = learner.snapshot_files("bfloat16")
    before = _params(learner)
    learner.train_step(_samples(learner, 1))  # the learner moves on: the hand-over holds a copy
    folder = tmp_path / "v"
    folder.mkdir()
    files.write_into(folder)
    state = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in state or not learner.model.config.tie_word_embeddings
    for name, value in state.items():
        assert torch.equal(value, before[name].to(torch.bfloat16)), name
    assert json.loads((folder / "config.json").read_text()).get("dtype",
           json.loads((folder / "config.json").read_text()).get("torch_dtype")) == "bfloat16"
    model = load_model(folder)  # an ordinary Hugging Face folder: config, tokenizer, weights
    assert next(model.parameters()).dtype == torch.float32
    assert (folder / "tokenizer.json").exists()


def test_publish_dtype_training_means_the_models_own(tiny_model_dir: Path) -> None:
    learner = _learner(tiny_model_dir)
    assert learner.publish_dtype("training") == "float32"
    assert learner.publish_dtype("float16") == "float16"


def test_shared_base_file_is_written_once_listed_in_every_manifest_and_survives_prune(tmp_path: Path) -> None:
    key = crypto.generate_key()
    store = SnapshotStore(tmp_path / "snapshots", key, "run1")
    writes: list[Path] = []

    def base(path: Path) -> None:
        writes.append(path)
        path.write_bytes(b"frozen base" * 1000)

    def own(tag: bytes) -> Any:
        def write(folder: Path) -> None:
            (folder / "adapter.gguf").write_bytes(tag)

        return write

    for v in range(3):
        store.publish(v, SnapshotFiles(own(b"adapter %d" % v), {"base.gguf": base}), now=1.0)
    assert len(writes) == 1  # written once per run
    base_path = store.base_dir / "base.gguf"
    digest = sha256_file(base_path)
    for v in range(3):
        entries = {f.path: f for f in _manifest(store, v).files}
        assert entries["base.gguf"].sha256 == digest and entries["base.gguf"].form == "gguf-base"
        assert "adapter.gguf" in entries and not (store.folder(v) / "base.gguf").exists()
    assert store.blob_path(digest) == base_path  # served by sha256 like any file
    store.prune({2})
    assert base_path.exists() and store.blob_path(digest) == base_path
    # a restart: the base folder is kept, its interrupted temporaries are not
    (store.base_dir / ".base.gguf.deadbeef.tmp").write_bytes(b"half")
    again = SnapshotStore(tmp_path / "snapshots", key, "run1")
    again.reconcile([2])
    assert base_path.exists() and not list(store.base_dir.glob("*.tmp"))
    assert again.blob_path(digest) == base_path and again.signed_manifest(2) is not None


def test_a_version_may_not_write_a_file_it_also_shares(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run1")
    def mine(folder: Path) -> None:
        (folder / "base.gguf").write_bytes(b"x")

    def shared(path: Path) -> None:
        path.write_bytes(b"y")

    files = SnapshotFiles(mine, {"base.gguf": shared})
    with pytest.raises(ValueError, match="base.gguf"):
        store.publish(1, files, now=1.0)
    assert not store.folder(1).exists() and store.signed_manifest(1) is None


def test_publisher_writes_the_checkpoint_first_then_the_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    learner = _learner(tiny_model_dir)
    learner.train_step(_samples(learner, 1))
    snapshots = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run1")
    checkpoints = CheckpointStore(tmp_path / "checkpoints")
    publisher = Publisher(snapshots, checkpoints)
    try:
        order: list[str] = []
        files = learner.snapshot_files("float32")
        state = learner.checkpoint_state()
        released = threading.Event()

        def release() -> None:
            order.append("released")
            released.set()
            state.release()

        def write(folder: Path) -> None:
            order.append("snapshot")
            files.write_into(folder)

        pub = Publication(1, SnapshotFiles(write), 1.0,
                          CheckpointState(state.version, state.weights, state.optimizer, release))
        done = publisher.submit(pub).result(timeout=120)
    finally:
        publisher.close()
    assert order == ["released", "snapshot"]
    assert done.version == 1 and done.publish_s > 0 and done.checkpoint_s > 0 and done.snapshot_bytes > 0
    assert snapshots.signed_manifest(1) is not None and checkpoints.latest(1) == 1
    weights = load_file(str(checkpoints.folder(1) / "weights.safetensors"))
    live = dict(learner.model.named_parameters())
    assert set(weights) == {n for n, p in live.items() if p.requires_grad}


def test_optimizer_step_waits_for_the_checkpoint_write(tiny_model_dir: Path) -> None:
    """The checkpoint is written from the live tensors: the next step's update must wait until they are read."""
    import torch

    learner = _learner(tiny_model_dir)
    learner.train_step(_samples(learner, 1))
    state = learner.checkpoint_state()
    frozen = {n: p.detach().clone() for n, p in state.weights.items()}
    out: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: out.update(learner.train_step(_samples(learner, 2))))
    worker.start()
    worker.join(timeout=3.0)  # a forward + backward of the tiny model takes milliseconds
    assert worker.is_alive()  # held at the optimizer step
    assert all(torch.equal(frozen[n], p) for n, p in state.weights.items())
    state.release()
    worker.join(timeout=60)
    assert not worker.is_alive() and out["checkpoint_gate_s"] > 0
    assert any(not torch.equal(frozen[n], p) for n, p in state.weights.items())


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_checkpoint_plus_replay_reproduces_the_weights_and_optimizer_exactly(tmp_path: Path, tiny_model_dir: Path,
                                                                             precision: str) -> None:
    """The resume semantics: load the checkpoint at version c, retrain the recorded batches c+1..k in order. With
    learner.precision = "bf16" too: the stochastic rounding follows from the seed and the step count."""
    import torch

    a = _learner(tiny_model_dir, precision=precision)
    batches = [_samples(a, s) for s in range(4)]
    a.train_step(batches[0])
    store = CheckpointStore(tmp_path / "checkpoints")
    store.write(a.checkpoint_state(), now=1.0)  # version 1
    for b in batches[1:]:
        a.train_step(b)
    assert a.model_version == 4
    b_ = _learner(tiny_model_dir, precision=precision)
    weights, optimizer = store.load(store.latest(4) or 0, "cpu")
    b_.load_checkpoint(weights, optimizer, 1)
    for b in batches[1:]:
        b_.train_step(b)
    assert b_.model_version == 4
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b_.model.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b_.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    assert {p.dtype for p in b_.model.parameters()} == {torch.bfloat16 if precision == "bf16" else torch.float32}


def test_checkpoint_store_keeps_the_newest_at_or_below_current(tmp_path: Path, tiny_model_dir: Path) -> None:
    learner = _learner(tiny_model_dir)
    store = CheckpointStore(tmp_path / "checkpoints")
    for v in (0, 3, 6):
        learner.model_version = v
        store.write(learner.checkpoint_state(), now=float(v))
    (store.root / ".tmp-v9-abc").mkdir()  # a write a crash interrupted
    (store.folder(7)).mkdir()  # no checkpoint.json: incomplete
    assert store.latest(5) == 3 and store.latest(6) == 6 and store.latest(100) == 6
    store.prune(6)
    assert sorted(p.name for p in store.root.iterdir()) == [".tmp-v9-abc", "v000006"]
    store.prune(5, startup=True)  # restart at version 5: checkpoint 6 belongs to a version never recorded
    assert list(store.root.iterdir()) == []


def test_crash_between_publication_and_commit_leaves_nothing_behind(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A kill after the publisher wrote version 2 (and its checkpoint) but before the database recorded it:
    the restart (reconcile with the recorded versions, prune checkpoints at start-up) removes both."""
    learner = _learner(tiny_model_dir)
    key = crypto.generate_key()
    snapshots = SnapshotStore(tmp_path / "snapshots", key, "run1")
    checkpoints = CheckpointStore(tmp_path / "checkpoints")
    publisher = Publisher(snapshots, checkpoints)
    try:
        for v in (0, 1, 2):
            learner.model_version = v
            publisher.submit(Publication(v, learner.snapshot_files(), 1.0, learner.checkpoint_state())).result(60)
    finally:
        publisher.close()
    recorded = [0, 1]  # the crash came before version 2's transaction
    again = SnapshotStore(tmp_path / "snapshots", key, "run1")
    again.reconcile(recorded)
    CheckpointStore(tmp_path / "checkpoints").prune(max(recorded), startup=True)
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["v000000", "v000001"]
    assert again.signed_manifest(2) is None
    assert checkpoints.latest(100) == 1


def test_evaluator_scores_the_published_snapshot_off_the_learner(tmp_path: Path, tiny_model_dir: Path) -> None:
    from coordinator.engine.evaluation import Evaluator
    from coordinator.tasks.builtin import ArithmeticTask

    task = ArithmeticTask(ArithmeticTaskConfig())
    learner = _learner(tiny_model_dir)
    folder = tmp_path / "v0"
    folder.mkdir()
    learner.snapshot_files("float32").write_into(folder)
    items = task.heldout[:130]
    evaluator = Evaluator(task, items, 8)
    yields: list[int] = []
    yielding = Evaluator(task, items, 8, yield_to=lambda: yields.append(1))  # before the load and each batch
    try:
        out = evaluator.submit(0, folder).result(timeout=120)
        polite = yielding.submit(0, folder).result(timeout=120)
    finally:
        evaluator.close()
        yielding.close()
    assert out.version == 0 and out.n == 130 and out.seconds > 0
    assert out.accuracy == learner.evaluate(task, items, 8)
    assert evaluator.eval_s_total == out.seconds
    assert len(yields) == 1 + 2  # the load, then batches of 128 and 2 prompts
    assert abs(polite.accuracy - out.accuracy) <= 2 / 130  # other batch shapes: at most a float-rounding tie apart


def test_config_refuses_no_checkpoint_trigger_and_knows_the_dtypes() -> None:
    from coordinator.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        load_config(None, {"learner.checkpoint_every_steps": 0, "learner.checkpoint_every_s": 0})
    with pytest.raises(ConfigError, match="snapshots.dtype"):
        load_config(None, {"snapshots.dtype": "int8"})
    cfg = load_config(None, {"snapshots.dtype": "bfloat16", "learner.checkpoint_every_steps": 0})
    assert cfg.snapshots.dtype == "bfloat16" and cfg.learner.checkpoint_every_s > 0


def test_a_reading_process_serves_a_shared_file_after_the_publisher_pruned_the_version_it_indexed(
        tmp_path: Path) -> None:
    """The API (a reader) indexed v0 and v1, whose config.json is the same file; the learner's publisher (the writer,
    another process) then prunes v0. The reader must still serve that file, from v1, not answer 404."""
    key = crypto.generate_key()
    writer = SnapshotStore(tmp_path / "snapshots", key, "run1")
    reader = SnapshotStore(tmp_path / "snapshots", key, "run1")

    def files(tag: bytes) -> Any:
        def write(folder: Path) -> None:
            (folder / "config.json").write_bytes(b'{"same": "every version"}')
            (folder / "model.safetensors").write_bytes(tag)

        return write

    for v in range(2):
        writer.publish(v, files(b"weights %d" % v), now=1.0)
    reader.observe([0, 1])
    shared = sha256_file(writer.folder(1) / "config.json")
    own0 = sha256_file(writer.folder(0) / "model.safetensors")
    writer.prune({1})
    assert reader.blob_path(shared) == writer.folder(1) / "config.json"
    assert reader.blob_path(own0) is None  # only in the pruned version: gone
    assert reader.signed_manifest(0) is None  # and the reader no longer offers that version


def test_sharded_checkpoint_is_completed_by_the_publisher_and_refused_on_another_world_size(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """A learner on FSDP ranks hands over a folder its ranks already wrote (torch.distributed.checkpoint); the
    checkpoint store completes it (checkpoint.json says format 2 and the world size, then the rename). A learner
    with another world size refuses it and says which to use."""
    store = CheckpointStore(tmp_path / "checkpoints")
    staging = store.staging(3)
    staging.mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(b"shard")  # what the ranks wrote
    state = CheckpointState(3, {}, {}, lambda: None, sharded=ShardedCheckpoint(str(staging), 2, True))
    store.write(state, now=1.0)
    assert store.latest(3) == 3 and not staging.exists()
    info = store.info(3)
    assert (info["format"], info["world_size"], info["optimizer"]) == (2, 2, True)
    learner = _learner(tiny_model_dir)
    with pytest.raises(ValueError, match=r"written by a learner on 2 FSDP ranks.*learner\.world_size = 2"):
        learner.load_sharded_checkpoint(store.folder(3), 3, 2, True)


def test_one_process_can_observe_the_index_while_its_publisher_thread_publishes_and_prunes(tmp_path: Path) -> None:
    """The one-process layout: the publisher's thread indexes and prunes versions while the event loop observes
    the same SnapshotStore (the verifier worker does every two seconds). Observing must never see the index change
    under it (a "dictionary changed size during iteration" once ended the worker's loop, and evaluations stopped)."""
    store = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run1")
    published: list[int] = []
    failures: list[BaseException] = []

    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"w" * 64)

    def publisher() -> None:
        try:
            for version in range(150):
                store.publish(version, write, 0.0)
                published.append(version)
                store.prune({version - 1, version})
        except BaseException as exc:  # noqa: BLE001 — reported by the test
            failures.append(exc)

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        while thread.is_alive():
            store.observe(list(published))
            store.blob_path("0" * 64)
    finally:
        thread.join()
    assert failures == []
    assert store.signed_manifest(149) is not None and store.signed_manifest(100) is None
