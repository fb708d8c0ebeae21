"""A private swarm (registration.mode = "invite"): `echo-swarm join` without the operator's token is refused
with a clear message and registers nothing; with `--invite` it joins and does accepted work."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import running_coordinator
from tests.integration.helpers import db_rows

REPO = Path(__file__).resolve().parents[2]
TOKEN = "swarm-invite-7f3a9c"


def join(url: str, home: Path, *extra: str, backend: str = "torch") -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "echo_swarm", "join", url, "--home", str(home), "--threads", "1",
            "--backend", backend, "--no-benchmark", "--no-panel", "--max-jobs", "1", "--retries", "2", *extra]
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})


def test_join_needs_the_invite_of_a_private_swarm(tmp_path: Path, tiny_model_dir: Path) -> None:
    registration = {"mode": "invite", "invite_sha256": [hashlib.sha256(TOKEN.encode()).hexdigest()]}
    with running_coordinator(tmp_path, tiny_model_dir, sections={"registration": registration}) as live:
        # refused at registration, whatever the backend: llama.cpp's, which loads in a fraction of torch's seconds
        refused = join(live.url, tmp_path / "stranger", backend="llama")
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert "registration_closed" in refused.stderr and "invite" in refused.stderr  # errors on stderr
        wrong = join(live.url, tmp_path / "guesser", "--invite", "not-the-token", backend="llama")
        assert wrong.returncode == 3 and "not valid" in wrong.stderr, wrong.stderr
        assert db_rows(live.run_dir, "SELECT COUNT(*) FROM clients") == [(0,)]

        invited = join(live.url, tmp_path / "friend", "--invite", TOKEN)
        assert invited.returncode == 0, invited.stdout + invited.stderr
        assert db_rows(live.run_dir, "SELECT COUNT(*), SUM(accepted) FROM clients") == [(1, 1)]
