"""coordinator.writeback: files written inside the block are flushed while they are written, not only at the end
(the publisher's gigabytes must not pile up as dirty pages that stall every other writer on the machine)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from coordinator.writeback import flushed_while_writing


def test_files_are_flushed_while_the_block_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flushed: list[str] = []
    seen = threading.Event()
    real = os.fdatasync

    def recording(fd: int) -> None:
        flushed.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        seen.set()
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    folder = tmp_path / "v1"
    folder.mkdir()
    with flushed_while_writing(folder, every_s=0.01):
        with open(folder / "model.safetensors", "wb") as fh:
            fh.write(b"x" * 4096)
            fh.flush()
            assert seen.wait(10), "nothing was flushed while the file was being written"
        assert "model.safetensors" in flushed
    count = len(flushed)
    (folder / "after").write_bytes(b"y")
    assert len(flushed) == count  # the helper thread stopped with the block


def test_a_single_file_target_and_a_missing_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flushed = threading.Event()
    monkeypatch.setattr(os, "fdatasync", lambda fd: flushed.set())
    target = tmp_path / ".base.gguf.tmp"
    with flushed_while_writing(target, every_s=0.01):  # not created yet: skipped, no error
        target.write_bytes(b"z" * 100)
        assert flushed.wait(10)
