"""Coordinator egress when one policy version reaches N volunteers, with and without p2p (issue 14).

A real coordinator (one-process layout, in a thread of this process, its libp2p peer in its own p2pd) publishes
version 0 of a random Qwen2-shaped model whose weights file is ``--mib`` MiB; then ``--clients`` volunteer
processes (swarm_client.peer_probe: the snapshot path of `join`, no generation backend) start at once and fetch
it, over HTTP only or with `--p2p` (peers first, HTTP fallback). Optionally one of them is a corrupting peer.

Reported per mode: coordinator egress (HTTP + libp2p, from its own counters), bytes peers served, the largest
share one client served, time until every client is ready (p50 / max, from the start of the fetch), HTTP fallbacks,
bytes wasted on bad pieces, and CPU seconds per GiB delivered (all client processes with their p2pd, plus this
process and its p2pd, during the distribution; process start-up excluded).

    python bench/egress.py --clients 20 --mib 64            # writes the table into docs/benchmarks.md
    python bench/egress.py --clients 4 --mib 16 --no-doc     # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
MARK = "<!-- bench/egress.py -->"


def build_model(out: Path, mib: int) -> Path:
    """A Qwen2-shaped random model whose model.safetensors is about ``mib`` MiB (f32), with the tiny byte tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from coordinator.engine.tiny_model import build_tokenizer

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    hidden = 512
    per_layer = 4 * hidden * hidden + 3 * hidden * 1408  # attention (q, k, v, o at most) + MLP
    layers = max(1, math.ceil(mib * 2**20 / 4 / per_layer))  # at least --mib
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=1408, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id, use_sliding_window=False)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


class Coordinator:
    """The real coordinator app on 127.0.0.1 in a background event loop."""

    def __init__(self, run_dir: Path, model: Path, p2p: bool, seed_peers: int, piece_kib: int) -> None:
        from aiohttp import web

        from coordinator.api.service import Coordinator as Service
        from coordinator.config import load_config
        from coordinator.launch.one_process import create_app

        cfg = load_config(None, {"run_dir": str(run_dir), "model.path": str(model), "layout": "one-process",
                                 # one held-out prompt: the first evaluation of version 0 runs in this process and
                                 # would otherwise land in the measured CPU (it did: ~35 CPU s per run)
                                 "learner.max_steps": 1, "learner.eval_every": 0, "learner.eval_size": 1,
                                 "learner.threads": 1,
                                 "snapshots.gguf": "off", "snapshots.piece_kib": piece_kib, "p2p.enabled": p2p, "p2p.seed_peers": seed_peers,
                                 "limits.per_address_rps": 0.0, "limits.per_identity_rps": 0.0})
        self.service = Service(cfg, model_dir=model)
        self.runner = web.AppRunner(create_app(cfg, self.service), handle_signals=False)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(600)
        self.url = f"http://127.0.0.1:{port}"

    def egress(self) -> dict[str, Any]:
        """The coordinator's snapshot egress so far: HTTP bytes already flushed to the store plus the rest."""
        from coordinator.api.egress import EGRESS_COUNTER

        return dict(self.service.egress.view(self.service.store.counter(EGRESS_COUNTER)))

    def p2pd_pid(self) -> int | None:
        peer = self.service.egress.peer
        node = peer.node if peer is not None else None
        child = getattr(node.p2p, "_child", None) if node is not None and node.p2p is not None else None
        return child.pid if child is not None else None

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def proc_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a live process (Linux /proc), 0 if gone."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mode(coord: Coordinator, tmp: Path, clients: int, p2p: bool, corrupt: bool, timeout_s: float,
             size: int, deadline_s: float) -> dict[str, Any]:
    mode = "p2p" if p2p else "http"
    before = coord.egress()
    homes = [tmp / f"{mode}-{i}" for i in range(clients)]
    procs = []
    for i, home in enumerate(homes):
        bad = corrupt and i == 0  # fetches at once (so it holds the files when the others start), then lies
        argv = [sys.executable, "-m", "swarm_client.peer_probe", coord.url, "--home", str(home), "--version", "0"]
        argv += ["--corrupt-piece", "1"] if bad else ["--wait-go", str(tmp / f"go-{mode}")]
        if p2p:
            argv += ["--p2p", "--serve-s", str(timeout_s), "--deadline-s", str(deadline_s)]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}))
    # every client is up (torch imported, p2pd started, DHT joined) before any fetch starts: start-up is not measured
    deadline = time.monotonic() + timeout_s
    bad_report = None
    if corrupt:
        assert procs[0].stdout is not None
        bad_report = json.loads(procs[0].stdout.readline())
    while sum((tmp / f"{mode}-{i}" / "waiting").exists() for i in range(clients)) < clients - corrupt:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit(f"{mode}: not every client started")
        time.sleep(0.2)
    self_cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    self_p2pd = proc_cpu_s(coord.p2pd_pid())
    (tmp / f"go-{mode}").write_text("")
    reports: list[dict[str, Any]] = []
    for p in procs:
        assert p.stdout is not None
        reports.append(bad_report if p is procs[0] and bad_report is not None else json.loads(p.stdout.readline()))
    after_ready = coord.egress()
    for p in procs:
        p.send_signal(2)
    served, client_py, client_p2pd = [], 0.0, 0.0
    for p, r in zip(procs, reports, strict=True):
        assert p.stdout is not None
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:  # a loaded machine: its served count is then missing, not wrong
            p.kill()
            out, _ = p.communicate(timeout=30)
        ends = [json.loads(x) for x in out.splitlines() if '"served"' in x]
        served.extend(e["served_bytes"] for e in ends)
        r["end"] = ends[0] if ends else None
        last = ends[0] if ends else r
        client_py += last["cpu_python_s"]
        client_p2pd += last["cpu_p2pd_s"]
    (tmp / "reports.json").write_text(json.dumps(reports, indent=1))  # every client's own figures, to look into
    self_cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - self_cpu
    self_p2pd = proc_cpu_s(coord.p2pd_pid()) - self_p2pd
    times = sorted(r["ready_s"] for r in reports if r.get("corrupt") is None)
    honest = [r for r in reports if r.get("corrupt") is None]
    coordinator_bytes = after_ready["coordinator_bytes"] - before["coordinator_bytes"]
    delivered = size * clients
    return {
        "mode": mode + (" + 1 corrupting peer" if corrupt else ""), "clients": clients,
        "coordinator_mib": coordinator_bytes / 2**20, "copies": coordinator_bytes / size,
        "peer_mib": (sum(r["peer_bytes"] for r in reports) - (after_ready["p2p_bytes"] - before["p2p_bytes"])) / 2**20,
        "max_served_mib": max(served, default=0) / 2**20,
        "ready_p50_s": statistics.median(times), "ready_max_s": times[-1],
        "fallbacks": sum(r["fallbacks"] for r in honest), "wasted_mib": sum(r["wasted_bytes"] for r in reports) / 2**20,
        "cpu_s_per_gib": (client_py + client_p2pd + self_cpu + self_p2pd) / (delivered / 2**30),
        # where the CPU went, in seconds per GiB delivered: clients' Python / their p2pd, coordinator / its p2pd
        "cpu_split": [round(x / (delivered / 2**30), 1) for x in (client_py, client_p2pd, self_cpu, self_p2pd)],
        "lookups": sum(r.get("lookups", 0) for r in reports), "refused": sum(r.get("refused", 0) for r in reports),
    }


def table(rows: list[dict[str, Any]], size: int, argv: str) -> str:
    lines = [f"`{argv}`: one version ({size / 2**20:.1f} MiB of files) to {rows[0]['clients']} client processes at "
             f"once on loopback, 2 shared cores. Egress counts HTTP and libp2p bytes out of the coordinator; 'served "
             f"by peers' excludes the coordinator's own libp2p bytes.", "",
             "| mode | coordinator egress | full copies | served by peers | most one client served | ready p50 / max "
             "| HTTP fallbacks | wasted on bad pieces | CPU s per GiB delivered | of which clients' Python / p2pd, "
             "coordinator / p2pd |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['coordinator_mib']:.0f} MiB | {r['copies']:.1f} | {r['peer_mib']:.0f} MiB | "
                     f"{r['max_served_mib']:.0f} MiB | {r['ready_p50_s']:.1f} / {r['ready_max_s']:.1f} s | "
                     f"{r['fallbacks']} | {r['wasted_mib']:.1f} MiB | {r['cpu_s_per_gib']:.1f} | "
                     f"{' / '.join(str(x) for x in r['cpu_split'][:2])}, "
                     f"{' / '.join(str(x) for x in r['cpu_split'][2:])} |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    block = f"{MARK}\n{text}\n{MARK}"
    if MARK in doc:
        doc = re.sub(re.escape(MARK) + r".*?" + re.escape(MARK), lambda _: block, doc, flags=re.S)
    else:
        doc += ("\n## Snapshot egress with peers (p2p, bench/egress.py)\n\nThe coordinator's libp2p peer seeds each "
                "file to `p2p.seed_peers` peers (here 2); clients then fetch from each other, every piece checked "
                "against the signed manifest (docs/protocol.md §6a). The corrupting peer fetches "
                "first, then serves every file with piece 1 altered; whoever asks it first bans it after that piece and resumes elsewhere. Times are "
                "CPU-bound on this machine (every client runs a Python process and a p2pd) and say nothing about a "
                "WAN; what carries over is the egress.\n\n" + block + "\n")
    DOC.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--mib", type=int, default=64, help="size of the weights file")
    ap.add_argument("--seed-peers", type=int, default=2)
    ap.add_argument("--piece-kib", type=int, default=16384, help="snapshots.piece_kib (the coordinator's default)")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--deadline-s", type=float, default=20.0, help="a client's p2p deadline (join --p2p: "
                    "p2p_deadline_s) before it takes the rest over HTTP")
    ap.add_argument("--modes", default="http,p2p,corrupt", help="comma-separated subset of http, p2p, corrupt")
    ap.add_argument("--no-corrupt", action="store_true", help="skip the run with a corrupting peer")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (each mode's reports.json)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="echo-egress-"))
    model = build_model(Path(tempfile.gettempdir()) / f"echo-egress-model-{args.mib}", args.mib)
    rows = []
    modes = {"http": (False, False), "p2p": (True, False), "corrupt": (True, True)}
    wanted = [modes[m] for m in args.modes.split(",") if not (m == "corrupt" and args.no_corrupt)]
    try:
        for p2p, corrupt in wanted:
            coord = Coordinator(tmp / f"run-{p2p}-{corrupt}", model, p2p, args.seed_peers, args.piece_kib)
            try:
                size = sum(p.stat().st_size for p in (tmp / f"run-{p2p}-{corrupt}" / "snapshots" / "v000000").iterdir()
                           if p.name != "manifest.msgpack")
                rows.append(run_mode(coord, tmp / f"c-{p2p}-{corrupt}", args.clients, p2p, corrupt, args.timeout_s,
                                     size, args.deadline_s))
                print(json.dumps(rows[-1]), flush=True)
            finally:
                coord.close()
    finally:
        if args.keep:
            print(f"kept {tmp}", flush=True)
        else:  # 20 clients × 3 modes leave gigabytes of snapshot copies
            shutil.rmtree(tmp, ignore_errors=True)
    argv = "python bench/egress.py " + " ".join(sys.argv[1:])
    text = table(rows, size, argv.strip())
    print(text)
    if not args.no_doc:
        write_doc(text)


if __name__ == "__main__":
    main()
