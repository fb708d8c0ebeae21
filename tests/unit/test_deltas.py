"""Delta snapshots (issue 23): the patch codec on real safetensors and GGUF files, refusals of bad patches, and the
snapshot store publishing patches against the previous version with periodic full anchors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from coordinator.publish.deltas import gguf_layout, layout, safetensors_layout, write_delta
from coordinator.publish.snapshots import SnapshotStore
from shared import crypto, wire
from shared.deltas import MAGIC, PatchError, Span, apply_patch, encode, read_header
from shared.errors import ProtocolError
from shared.hashing import sha256_file
from shared.messages import Manifest, ManifestFile, SignedManifest


def _weights(seed: int, step: int, lr: float = 1e-4) -> dict[str, np.ndarray]:
    """f32 'master' weights after ``step`` sign-like updates of size lr (an Adam-like step)."""
    rng = np.random.default_rng(seed)
    w = {"a.weight": rng.normal(0, 0.02, (300, 200)).astype(np.float32),
         "b.weight": rng.normal(0, 0.02, (1000,)).astype(np.float32),
         "norm.weight": np.ones(64, np.float32)}
    for s in range(step):
        upd = np.random.default_rng(seed * 1000 + s)
        w = {k: v + lr * np.sign(upd.normal(size=v.shape)).astype(np.float32) for k, v in w.items()}
    return w


def _save_bf16(path: Path, w: dict[str, np.ndarray], f32: tuple[str, ...] = ("norm.weight",)) -> Path:
    import torch
    from safetensors.torch import save_file

    save_file({k: torch.from_numpy(v).to(torch.float32 if k in f32 else torch.bfloat16) for k, v in w.items()},
              str(path), metadata={"format": "pt"})
    return path


def _pair(tmp: Path, lr: float = 1e-4) -> tuple[Path, Path, str, str]:
    a = _save_bf16(tmp / "a.safetensors", _weights(0, 0, lr))
    b = _save_bf16(tmp / "b.safetensors", _weights(0, 1, lr))
    return a, b, sha256_file(a), sha256_file(b)


def test_a_bf16_patch_rebuilds_the_exact_file_and_is_a_small_share_of_it(tmp_path: Path) -> None:
    a, b, sa, sb = _pair(tmp_path, lr=1e-6)
    spans = safetensors_layout(b)
    assert {s.width for s in spans} == {1, 2, 4}  # header bytes, bf16 tensors, the f32 norm
    size = write_delta(a, b, tmp_path / "p", base_sha256=sa, result_sha256=sb)
    assert size is not None and size < 0.05 * b.stat().st_size
    apply_patch(a, tmp_path / "p", tmp_path / "c", base_sha256=sa, result_sha256=sb)
    assert sha256_file(tmp_path / "c") == sb and sa != sb
    header = read_header(tmp_path / "p")
    assert (header.base, header.result, header.size) == (sa, sb, b.stat().st_size)


def test_every_width_round_trips_whatever_changes(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 4096, dtype=np.uint8)
    new = base.copy()
    new[rng.choice(4096, 300, replace=False)] = rng.integers(0, 256, 300, dtype=np.uint8)
    new[0], new[-1] = base[0] ^ 0xFF, base[-1] ^ 1  # the very first and last bytes
    (tmp_path / "a").write_bytes(base.tobytes())
    (tmp_path / "b").write_bytes(new.tobytes())
    spans = [Span(0, 8, 8), Span(8, 1000, 4), Span(1008, 2000, 2), Span(3008, 1088, 1)]
    encode(tmp_path / "a", tmp_path / "b", spans, base_sha256="0" * 64, result_sha256="1" * 64, out=tmp_path / "p")
    apply_patch(tmp_path / "a", tmp_path / "p", tmp_path / "c", base_sha256="0" * 64, result_sha256="1" * 64)
    assert (tmp_path / "c").read_bytes() == new.tobytes()


def test_gguf_layout_gives_f16_and_f32_tensors_their_widths(tmp_path: Path) -> None:
    import gguf

    def write(path: Path, shift: float) -> Path:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("tok.weight", (np.linspace(-1, 1, 4096) + shift).astype(np.float16))
        w.add_tensor("norm.weight", np.full(128, 1 + shift, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    a, b = write(tmp_path / "a.gguf", 0.0), write(tmp_path / "b.gguf", 1e-3)
    spans = gguf_layout(b)
    assert [s.width for s in spans if s.width > 1] == [2, 4] and spans == layout(b)
    sa, sb = sha256_file(a), sha256_file(b)
    assert write_delta(a, b, tmp_path / "p", base_sha256=sa, result_sha256=sb) is not None
    apply_patch(a, tmp_path / "p", tmp_path / "c", base_sha256=sa, result_sha256=sb)
    assert sha256_file(tmp_path / "c") == sb


def test_files_of_other_sizes_or_too_different_get_no_patch(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "b").write_bytes(b"x" * 101)
    assert write_delta(tmp_path / "a", tmp_path / "b", tmp_path / "p", base_sha256="0" * 64,
                       result_sha256="1" * 64) is None
    rng = np.random.default_rng(2)
    (tmp_path / "b").write_bytes(rng.integers(0, 256, 100, dtype=np.uint8).tobytes())  # all new: > half the file
    assert write_delta(tmp_path / "a", tmp_path / "b", tmp_path / "p", base_sha256="0" * 64,
                       result_sha256="1" * 64) is None
    assert not (tmp_path / "p").exists()


def _corrupt_frame(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))


def _bad_header(p: Path) -> None:
    header = read_header(p)
    spans = [list(s) for s in header.spans]
    changed = next(s for s in spans if s[3])
    changed[3] = changed[1] // changed[2] + 1  # more changes than elements
    raw = wire.pack({"base": header.base, "base_size": header.base_size, "result": header.result,
                     "size": header.size, "spans": spans})
    p.write_bytes(MAGIC + struct.pack("<I", len(raw)) + raw + p.read_bytes()[header.body_offset:])


@pytest.mark.parametrize("damage", [_corrupt_frame, _bad_header, lambda p: p.write_bytes(p.read_bytes()[:-3]),
                                    lambda p: p.write_bytes(b"not a patch")],
                         ids=["flipped-frame-byte", "header-claims-too-many", "truncated", "not-a-patch"])
def test_a_damaged_patch_is_refused_and_leaves_no_output(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    a, b, sa, sb = _pair(tmp_path)
    write_delta(a, b, tmp_path / "p", base_sha256=sa, result_sha256=sb)
    damage(tmp_path / "p")
    out = tmp_path / "c"
    try:
        apply_patch(a, tmp_path / "p", out, base_sha256=sa, result_sha256=sb)
    except PatchError:
        assert not out.exists()
    else:  # a flipped byte zstd did not notice still rebuilds the wrong file, which the hash check refuses
        assert sha256_file(out) != sb


def test_a_patch_for_another_base_or_result_is_refused(tmp_path: Path) -> None:
    a, b, sa, sb = _pair(tmp_path)
    write_delta(a, b, tmp_path / "p", base_sha256=sa, result_sha256=sb)
    with pytest.raises(PatchError, match="not"):
        apply_patch(b, tmp_path / "p", tmp_path / "c", base_sha256=sb, result_sha256=sb)
    with pytest.raises(PatchError):
        apply_patch(a, tmp_path / "p", tmp_path / "c", base_sha256=sa, result_sha256="2" * 64)
    assert not (tmp_path / "c").exists()


def _manifest(store: SnapshotStore, version: int) -> Manifest:
    signed = store.signed_manifest(version)
    assert signed is not None
    return wire.decode(wire.decode(signed, SignedManifest).manifest, Manifest)


def test_the_store_publishes_patches_against_the_previous_version_and_full_anchors(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots", crypto.generate_key(), "run", anchor_every=3)

    def files(step: int):  # type: ignore[no-untyped-def]
        def write(folder: Path) -> None:
            _save_bf16(folder / "model.safetensors", _weights(0, step))
            (folder / "config.json").write_text("{}")

        return write

    for v in range(5):
        store.publish(v, files(v), now=1.0)
    for v in range(5):
        entries = {f.path: f for f in _manifest(store, v).files}
        if v in (0, 3):  # the first version and the anchor: whole files only
            assert "model.safetensors.delta" not in entries
            continue
        delta, full = entries["model.safetensors.delta"], entries["model.safetensors"]
        previous = {f.path: f for f in _manifest(store, v - 1).files}["model.safetensors"]
        assert delta.form == "delta" and delta.base_sha256 == previous.sha256 and delta.result_sha256 == full.sha256
        assert delta.size < full.size and delta.pieces and "config.json.delta" not in entries  # unchanged: no patch
        assert store.blob_path(delta.sha256) == store.folder(v) / "model.safetensors.delta"
        rebuilt = tmp_path / f"rebuilt{v}"
        apply_patch(store.blob_path(previous.sha256), store.blob_path(delta.sha256), rebuilt,  # type: ignore[arg-type]
                    base_sha256=previous.sha256, result_sha256=full.sha256)
        assert sha256_file(rebuilt) == full.sha256
    plain = SnapshotStore(tmp_path / "plain", crypto.generate_key(), "run")  # deltas off
    for v in range(2):
        plain.publish(v, files(v), now=1.0)
    assert all(f.form != "delta" for f in _manifest(plain, 1).files)


def test_a_manifest_whose_patch_rebuilds_an_unlisted_file_does_not_decode() -> None:
    full = ManifestFile(path="model.safetensors", size=10, sha256="a" * 64)
    delta = ManifestFile(path="model.safetensors.delta", size=3, sha256="b" * 64, form="delta",
                         base_sha256="c" * 64, result_sha256="d" * 64)
    raw = wire.pack({"protocol": 5, "run_id": "r", "version": 1, "created_at": 1.0, "format": "hf-safetensors",
                     "files": [full.model_dump(), delta.model_dump()]})
    with pytest.raises(ProtocolError, match="result_sha256"):
        wire.decode(raw, Manifest)
    with pytest.raises(ValueError, match="delta"):
        ManifestFile(path="x", size=1, sha256="a" * 64, base_sha256="c" * 64)  # only a delta names a base


def test_long_spans_are_coded_in_pieces_and_applying_returns_the_rebuilt_files_sha256(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor longer than SPAN_BYTES is coded as several spans (each side then holds one piece at a time, not the
    tensor); the rebuilt file is the same, and apply_patch returns its sha256 computed as it was written."""
    from shared import deltas

    a, b, sa, sb = _pair(tmp_path, lr=1e-4)
    whole = write_delta(a, b, tmp_path / "whole", base_sha256=sa, result_sha256=sb)
    monkeypatch.setattr(deltas, "SPAN_BYTES", 4096)
    pieces = write_delta(a, b, tmp_path / "pieces", base_sha256=sa, result_sha256=sb)
    assert whole is not None and pieces is not None
    spans = read_header(tmp_path / "pieces").spans
    assert len(spans) > len(read_header(tmp_path / "whole").spans) + 20
    assert max(length for _, length, _, _, _ in spans) <= 4096
    assert {width for _, _, width, _, _ in spans} == {1, 2, 4}  # still the tensors' element widths
    for name in ("whole", "pieces"):
        digest = apply_patch(a, tmp_path / name, tmp_path / f"out-{name}", base_sha256=sa, result_sha256=sb)
        assert digest == sb == sha256_file(tmp_path / f"out-{name}")
    assert deltas.split_spans([Span(0, 10, 2)], 4) == [Span(0, 4, 2), Span(4, 4, 2), Span(8, 2, 2)]
