"""llama.cpp's converters in one long-lived child (coordinator.publish.converter_worker): versions converted one after
another are served by the same child and are byte for byte the files one process per version writes (the model
converter and the LoRA adapter converter); a conversion that fails, runs past its time or loses its child is
reported in one line and the next conversion gets a fresh child."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.engine.family_models import BY_NAME, build_family_model
from coordinator.publish.converter_worker import ConverterWorker
from coordinator.publish.hf_convert import VENDOR, ConverterError, convert, convert_lora

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_process(args: list[str]) -> None:
    """A conversion as the coordinator ran each one before the worker: a fresh Python per file."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[ConverterWorker]:
    """A worker of the test's own (the module-level one is shared by everything else in the process)."""
    from coordinator.publish import hf_convert

    own = ConverterWorker()
    monkeypatch.setattr(hf_convert, "WORKER", own)
    yield own
    own.close()


def test_versions_are_converted_by_one_child_into_the_files_one_process_per_version_writes(
        tmp_path: Path, worker: ConverterWorker) -> None:
    gemma, phi = (build_family_model(BY_NAME[n], tmp_path / n) for n in ("gemma3", "phi3"))
    for k, folder in enumerate((gemma, phi, gemma)):
        convert(folder, tmp_path / f"{k}.gguf")
    assert worker.started == 1 and worker.pid is not None
    assert not list(tmp_path.glob("*.tmp"))
    for folder, served in ((gemma, "0.gguf"), (phi, "1.gguf")):
        _one_process(["-m", "coordinator.publish.hf_convert", str(folder), str(tmp_path / "alone.gguf"), "f16"])
        assert _sha(tmp_path / served) == _sha(tmp_path / "alone.gguf"), folder.name
    assert _sha(tmp_path / "0.gguf") == _sha(tmp_path / "2.gguf")


def test_a_lora_adapter_converted_by_the_child_is_the_file_upstreams_script_writes(
        tmp_path: Path, worker: ConverterWorker) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from coordinator.config import LearnerConfig
    from coordinator.engine import lora

    family = BY_NAME["phi3"]  # fused qkv and gate/up: the converter splits the adapter's factors too
    base = build_family_model(family, tmp_path / "base")
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(str(base)),
                      LearnerConfig(lora_rank=4, lora_targets=list(family.linear)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    snap = lora.adapter_snapshot(model)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(snap.tensors, str(adapter / lora.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (adapter / lora.ADAPTER_CONFIG).write_bytes(snap.config_json)

    convert_lora(base, adapter, tmp_path / "served.gguf")
    convert_lora(base, adapter, tmp_path / "again.gguf")
    assert worker.started == 1
    _one_process([str(VENDOR / "convert_lora_to_gguf.py"), "--base", str(base), "--outfile",
                  str(tmp_path / "alone.gguf"), "--outtype", "f16", str(adapter)])
    assert _sha(tmp_path / "served.gguf") == _sha(tmp_path / "alone.gguf") == _sha(tmp_path / "again.gguf")


def test_a_failed_a_timed_out_and_a_lost_conversion_each_leave_a_fresh_child_for_the_next(
        tmp_path: Path, worker: ConverterWorker) -> None:
    folder = build_family_model(BY_NAME["qwen3"], tmp_path / "qwen3")
    convert(folder, tmp_path / "first.gguf")
    first = worker.pid

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(ConverterError, match="llama.cpp's converter failed on .*broken: .*NoSuchForCausalLM") as err:
        convert(tmp_path / "broken", tmp_path / "broken.gguf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "broken.gguf").exists() and not list(tmp_path.glob("*.tmp"))
    convert(folder, tmp_path / "after_failure.gguf")
    assert worker.pid not in (None, first) and worker.started == 2

    with pytest.raises(ConverterError, match="did not finish .*qwen3 within 0 s"):  # no conversion takes 1 ms
        convert(folder, tmp_path / "late.gguf", timeout_s=0.001)
    assert not (tmp_path / "late.gguf").exists()
    convert(folder, tmp_path / "after_timeout.gguf")
    assert worker.started == 3

    lost = worker.pid
    assert lost is not None
    os.kill(lost, signal.SIGKILL)  # the child this test's worker started
    convert(folder, tmp_path / "after_loss.gguf")
    assert worker.started == 4 and worker.pid != lost
    hashes = {_sha(tmp_path / f"{n}.gguf") for n in ("first", "after_failure", "after_timeout", "after_loss")}
    assert len(hashes) == 1


def test_a_child_is_replaced_after_its_share_of_conversions(tmp_path: Path, worker: ConverterWorker) -> None:
    worker.max_conversions = 2
    folder = build_family_model(BY_NAME["olmo2"], tmp_path / "olmo2")
    pids = []
    for k in range(3):
        convert(folder, tmp_path / f"{k}.gguf")
        pids.append(worker.pid)
    assert pids[0] is not None and pids[1] is None  # the second request ended the first child's share
    assert pids[2] not in (None, pids[0]) and worker.started == 2
