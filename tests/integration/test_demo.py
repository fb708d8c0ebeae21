"""`echo-swarm demo` as a newcomer runs it: separate processes, real HTTP, and a model that measurably learns."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.engine.tiny_model import SHIPPED_SHA256
from tests.integration.helpers import REPO, SHORT_DEMO_STEPS

pytestmark = pytest.mark.slow

REQUIRED = {"steps", "final_version", "accepted", "rejected", "reward_curve", "eval_before", "eval_after", "wall_s",
            "clients"}
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_demo_improves_heldout_accuracy_with_every_client_contributing(tmp_path: Path, tiny_model_dir: Path,
                                                                       store: str) -> None:
    """Alike on both stores: postgresql makes the demo start a private PostgreSQL server for the run. The SQLite
    run is the README's demo exactly as written (200 steps); the PostgreSQL one tests the store, not the length,
    and stops at SHORT_DEMO_STEPS, where the held-out gain is already several standard errors."""
    out = tmp_path / "demo"
    steps = [] if store == "sqlite" else ["--steps", str(SHORT_DEMO_STEPS)]
    proc = subprocess.run([sys.executable, "-m", "echo_swarm", "demo", "--clients", "2", "--out", str(out),
                           "--store", store, *steps], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary.keys() >= REQUIRED
    assert summary["final_version"] == summary["steps"] == len(summary["reward_curve"])
    assert summary["eval_prompts"] >= 256
    assert summary["eval_after"] - summary["eval_before"] >= 0.10, (summary["eval_before"], summary["eval_after"])
    assert summary["wall_s"] < 900
    assert len(summary["clients"]) == 2
    pids = {c["pid"] for c in summary["clients"]}
    assert len(pids) == 2 and all(c["accepted"] > 0 for c in summary["clients"]), summary["clients"]
    assert sum(c["accepted"] for c in summary["clients"]) == summary["accepted"]
    assert (out / "reward_curve.png").stat().st_size > 10_000
    assert "held-out accuracy" in proc.stdout
    assert summary["store"] == store
    # the shipped model (the same bytes on every machine), and so README's starting figure, to the digit it prints
    assert hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest() == SHIPPED_SHA256
    readme = re.search(r"\| held-out greedy accuracy \(512 prompts never trained on\) \| ([0-9.]+) → ([0-9.]+) \|",
                       (REPO / "README.md").read_text())
    assert readme is not None and f"{summary['eval_before']:.3f}" == readme[1], (summary["eval_before"], readme)


def test_cli_help_explains_every_command() -> None:
    top = subprocess.run([sys.executable, "-m", "echo_swarm", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0
    for command in ("join", "coordinator", "demo"):
        assert command in top.stdout
        sub = subprocess.run([sys.executable, "-m", "echo_swarm", command, "--help"], capture_output=True, text=True,
                             timeout=60)
        assert sub.returncode == 0 and "--" in sub.stdout


def test_coordinator_refuses_a_bad_config_with_a_clear_message(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[learner]\nprompts_per_step = 6\nlearning_rate = 0.1\n')
    proc = subprocess.run([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "learner.learning_rate" in proc.stderr and "Extra inputs are not permitted" in proc.stderr


def test_join_reports_an_unreachable_coordinator(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "echo_swarm", "join", f"http://127.0.0.1:{port}", "--home",
                           str(tmp_path / "home"), "--retries", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5, proc.stdout + proc.stderr  # shared.exit_codes.ExitCode.UNREACHABLE
    assert "Check the host and port in the URL" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "home" / "identity.key").exists()  # nothing is written before a coordinator answers


def test_demo_runs_the_reasoning_gym_task_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`echo-swarm demo --task reasoning-gym`: clients generate, the coordinator scores with reasoning-gym's own
    scorer, and the learner trains (a few steps: the learning itself is measured in docs/benchmarks.md)."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "echo_swarm", "demo", "--task", "reasoning-gym", "--steps", "3",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "reasoning-gym" and summary["final_version"] == 3
    assert summary["rejected"] == 0 and summary["accepted"] >= 6 and summary["eval_prompts"] == 64
    assert 'type = "reasoning-gym"' in (out / "run.toml").read_text()
    assert "echo-swarm demo: reasoning-gym" in proc.stdout
