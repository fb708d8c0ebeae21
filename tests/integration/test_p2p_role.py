"""The coordinator's libp2p peer in the process layout (issues 12 and 14): hivemind imports torch, so the peer runs
as a role process of its own (``p2p``), never inside the API process. A volunteer still fetches version 0 from it
over libp2p, and the API reports the peer (GET /v1/p2p) and its egress from what the role writes in the store; the
role relays the signed calls of a `--p2p-jobs` volunteer to the API process."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from shared import wire
from shared.messages import P2PInfo
from swarm_client.peer_fetch import P2P_MIN_BYTES
from tests.integration.helpers import (
    Proc,
    db_rows,
    get_status,
    start_coordinator,
    stop_all,
    wait_until,
    write_config,
)

pytestmark = pytest.mark.slow

PIECE = 256 * 1024


def _roles(url: str) -> dict[str, Any]:
    status = get_status(url)
    return status["roles"] if status else {}


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_the_peer_runs_beside_a_torch_free_api_and_serves_a_volunteer(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", run_dir, tiny_model_dir, top={"layout": "processes"},
                       learner={"max_steps": 1}, p2p={"enabled": True, "seed_peers": 1},
                       snapshots={"gguf": "off", "piece_kib": PIECE // 1024})
    coord, url = start_coordinator(cfg, tmp_path / "coord.log")
    probe: Proc | None = None
    try:
        roles = wait_until(lambda: (r := _roles(url)) and r.get("api", {}).get("pid")
                           and r.get("p2p", {}).get("peer_id") and r, 180, "the p2p role to report its peer")
        api_pid, p2p_pid = int(roles["api"]["pid"]), int(roles["p2p"]["pid"])
        assert len({api_pid, p2p_pid, coord.pid}) == 3  # a process of its own
        with urllib.request.urlopen(f"{url}/v1/p2p", timeout=10) as resp:
            info = wire.decode(resp.read(), P2PInfo)
        assert info.enabled and info.peer_id == roles["p2p"]["peer_id"] and info.maddrs

        probe = Proc([sys.executable, "-m", "swarm_client.peer_probe", url, "--home", str(tmp_path / "a"),
                      "--version", "0", "--p2p"], tmp_path / "a.log", ready='"event": "ready"')
        wait_until(lambda: probe is not None and (probe.ready.is_set() or probe.proc.poll() is not None), 180,
                   "the volunteer's download")
        assert probe.ready.is_set(), probe.output()[-3000:]
        report = next(json.loads(line) for line in probe.lines if line.startswith("{") and '"ready"' in line)
        folder = run_dir / "snapshots" / "v000000"
        sizes = [p.stat().st_size for p in folder.iterdir() if p.name != "manifest.msgpack"]
        size = sum(n for n in sizes if n >= P2P_MIN_BYTES)
        small = sum(n for n in sizes if n < P2P_MIN_BYTES)  # config and tokenizer files: over HTTP by design
        assert report["p2p"] and report["peer_bytes"] == size and report["http_bytes"] == small, report
        # the API shows the role's counters (reported every 2 s): the coordinator's egress of the weights went
        # over libp2p
        egress = wait_until(lambda: (s := get_status(url)) and s["snapshot_egress"]["p2p_bytes"] == size
                            and s["snapshot_egress"], 30, "the p2p role's egress on the status page")
        assert egress["p2p"] and egress["http_bytes"] == small

        # the role relays the signed calls to the API process (its port from endpoint.json, the token both derive
        # from the run's key): the API counts them against the IP the volunteer's libp2p connection comes from
        calls = Proc([sys.executable, "-m", "tests.integration.p2p_call_probe", url, "--home", str(tmp_path / "b"),
                      "--p2p", "--jobs"], tmp_path / "b.log")
        calls.proc.wait(120)
        calls.stop()
        out = next(json.loads(line) for line in calls.lines if line.startswith("{") and '"done"' in line)
        assert out.get("registered") and out["calls"] >= 2 and out["fallbacks"] == 0, out
        assert db_rows(run_dir, "SELECT address FROM clients WHERE client_id=?", (out["client_id"],)) == [
            ("127.0.0.1",)]
        assert out["replay"]["p2p"] == [409, "replayed_nonce"] and out["oversize"] == [413, "body_too_large"]

        assert "libtorch" not in _maps(api_pid)  # the API process never loaded torch
        assert "libtorch" in _maps(p2p_pid)  # hivemind's torch went to the p2p role (the check can fail)
    finally:
        stop_all(*[p for p in (probe, coord) if p is not None])
