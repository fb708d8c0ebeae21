"""`echo-swarm join` that keeps a journal of what it was told, for the fault tests: the production join loop
(swarm_client.runner.Runner with the torch backend, from the settings `join` builds from its flags) appending one JSON line per result the
coordinator answered "accepted" — job, lease, policy version — flushed and fsynced before the loop goes on. A fault
test then checks the store against what each client was told, not against what the store says it holds.

    python -m tests.faults.acking_client ACKS.jsonl URL --home DIR [--p2p]

``--p2p`` joins as ``join --p2p --p2p-jobs``: snapshots and the signed calls (results included) over libp2p,
through the coordinator's p2p role, with HTTP as the fallback the client falls back on by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tests.integration.helpers import Proc


def start_acking_client(url: str, home: Path, *extra: str) -> Proc:
    """The client in a process of its own; its journal is ``journal(home)``, its output ``home``.log."""
    return Proc([sys.executable, "-m", "tests.faults.acking_client", str(journal(home)), url, "--home", str(home),
                 *extra], home.with_suffix(".log"))


def journal(home: Path) -> Path:
    return home / "acks.jsonl"


def read_acks(path: Path) -> list[dict[str, Any]]:
    """The journal's lines (a line cut short by a kill of the client itself is not an acknowledgement yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def main(argv: list[str]) -> int:
    from shared import safe_text
    from swarm_client.config import build
    from swarm_client.runner import Runner

    ap = argparse.ArgumentParser(prog="acking_client")
    ap.add_argument("acks", type=Path)
    ap.add_argument("url")
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--p2p", action="store_true")
    args = ap.parse_args(argv)
    cfg = build({"url": args.url, "home": args.home, "backend": "torch", "threads": 1, "exit_when_finished": True, "panel": False,
                 "p2p": args.p2p, "p2p_jobs": args.p2p})
    safe_text.configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")  # as swarm_client.runner.run
    runner = Runner(cfg)
    args.acks.parent.mkdir(parents=True, exist_ok=True)
    journal = open(args.acks, "a")  # noqa: SIM115 — open for the whole run, closed below

    def acknowledged(_now: float, job: Any, _tokens: int) -> None:
        journal.write(json.dumps({"job": job.job_id, "lease": job.lease_id, "version": job.version}) + "\n")
        journal.flush()
        os.fsync(journal.fileno())

    runner.submissions.on_result = acknowledged  # called once the coordinator's reply said accepted, before anything else
    try:
        return asyncio.run(runner.run())
    finally:
        journal.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
