"""A llama.cpp volunteer against a real coordinator: it fetches only the GGUF form of the snapshot, generates with
llama.cpp, and its results pass verification under the llama backend class's tolerances."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import LiveCoordinator
from tests.integration.helpers import REPO, db_rows


def test_llama_client_fetches_gguf_only_and_its_results_are_accepted(live_coordinator: LiveCoordinator,
                                                                     tmp_path: Path) -> None:
    home = tmp_path / "llama-client"
    proc = subprocess.run([sys.executable, "-m", "echo_swarm", "join", live_coordinator.url, "--home", str(home),
                           "--backend", "llama", "--threads", "1", "--max-jobs", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(llama on cpu" in proc.stdout
    folder = home / "cache" / "snapshots" / live_coordinator.coordinator.run_id / "v000000"
    names = {p.name for p in folder.iterdir() if not p.name.startswith(".")}
    assert names == {"model.gguf"}, names  # no safetensors, config or tokenizer files: llama.cpp needs none
    served = live_coordinator.run_dir / "snapshots" / "v000000"
    assert (folder / "model.gguf").read_bytes() == (served / "model.gguf").read_bytes()
    rows = db_rows(live_coordinator.run_dir, "SELECT COUNT(*) FROM results")
    assert rows == [(2,)]
    rejections = db_rows(live_coordinator.run_dir, "SELECT COUNT(*) FROM rejections")
    assert rejections == [(0,)]
