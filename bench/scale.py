"""Real model size: where a learner step's time goes, with the real coordinator and a real client.

Builds a Qwen2.5-0.5B-shaped model locally (``Qwen2Config``: hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, rope theta 1e6, vocab 151,936; random init, f32, the tiny model's
byte-level tokenizer) in a temporary folder, then for each mode runs ``echo-swarm coordinator`` and one
``echo-swarm join`` torch client as separate processes on 127.0.0.1, and reads back:

- the per-step breakdown from the coordinator's step metrics (``steps.metrics``): optimisation (``train_s``
  less any wait for a checkpoint write), the hand-over copy, waiting for results, waiting for the previous
  publication; publication and checkpoint (background, publisher thread); verification (verifier thread) and
  evaluation (evaluator thread);
- learner duty = optimisation ÷ (learner wall − waiting for results), over the steady steps (the first is
  excluded: it allocates the optimizer state);
- disk: bytes per version (this version's own snapshot folder), the run directory's steady and peak size;
- peak RSS (VmHWM) of each coordinator role process (API, learner, verifier; the supervisor is negligible) and of
  the client — in the one-process layout all roles share one process;
- request latency while the learner steps: a side prober sends ``GET /healthz`` and a signed
  ``POST /v1/release`` (authentication, nonce write, a job lookup: the lease path without taking a job,
  which would steal the only client's work) every 0.2 s, and reports p50/p99.

A real gradient at any size (``--reward even``, the default): with random weights a task's reward is always 0,
every advantage 0 and the policy never moves, so the bench trains on a dataset task of fixed prompts scored by the
plug-in ``bench/rewards.py:even_token_ids`` (the share of even token ids in a completion; the 0.5 B shape's
tokenizer spells every id the model can sample, see ``widened_vocab``), which gives non-zero
advantages from the first step: versions differ by training, weight decay is off. ``--reward addition`` keeps the
old arithmetic task with ``learner.weight_decay = 0.01`` (every gradient 0; only the decay makes versions
differ). ``--model tiny`` runs the same harness on the 1 M-parameter tiny model in a minute (a smoke check).

Delta snapshots (issue 23): for every version the bench reads its signed manifest while it is served and records
the whole weight files' and their patches' sizes; the client's log gives each patch it applied and how long the
apply took (rebuilding the file, plus its sha256 check). Printed as bytes per version, delta and full.

A mode may name a layout: ``sequential@one-process`` runs every role in one process (the layout before the
split), ``sequential`` the default process layout, so one run measures both side by side; and options after a
space: ``lr=1e-6``, ``precision=bf16`` (``learner.precision``), so ``--modes "sequential,sequential precision=bf16"``
measures the float32 and the bf16 learner side by side. Peak RSS is also given per parameter for the learner
(bytes per parameter) and against the replica for each verifier (its bytes in ``model.dtype``, float32).

A verifier held busy (issue 37): ``--hold-verifier SECONDS`` holds the verifier at its first recompute of version 0
(the ``recompute-v0`` hold point, coordinator.holds) that long, while the client's uploads time out (its request
timeout is 30 s) and are resent; the mode's result then says how often results were recomputed and resends joined a
verification in flight (the API's /metrics), how many results were refused (the store), and the client's own count
of results it was told were accepted beside the store's.

    python bench/scale.py --model tiny --steps 4 --modes sequential,sequential@one-process
    nice -n 5 python bench/scale.py --model qwen0.5b --steps 5 --modes sequential,async \\
        --out bench-out/scale --plot docs/img/scale_breakdown.png
    python bench/scale.py --model qwen0.5b --steps 3 --modes sequential --client-backend llama --hold-verifier 130
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN05B: dict[str, Any] = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
           "vocab_size": 151_936, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6}
MODES: dict[str, dict[str, Any]] = {"sequential": {"sync_mode": "sequential-pull"},
         "async": {"sync_mode": "async-push-pull", "max_staleness": 1}}


def build_model(kind: str, into: Path) -> Path:
    """The model folder: the cached tiny model, or a freshly built random Qwen2.5-0.5B-shaped one."""
    from coordinator.engine.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model()
    if kind == "tiny":
        return tiny
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tiny))
    cfg = Qwen2Config(**QWEN05B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    t0 = time.monotonic()
    model = Qwen2ForCausalLM(cfg)
    folder = into / "qwen0.5b-shaped"
    model.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    # the byte tokenizer has 257 ids and the model samples from 151,936: without a spelling for the others nearly
    # every completion decodes to "" and every reward is equal (no advantage, no gradient)
    from bench.rewards import widened_vocab

    spec = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(widened_vocab(spec, cfg.vocab_size)))
    n = sum(p.numel() for p in model.parameters())
    print(f"built a {n / 1e6:.0f} M-parameter Qwen2 model in {time.monotonic() - t0:.1f}s at {folder}", flush=True)
    del model
    return folder


def parameter_count(folder: Path) -> int:
    """Parameters of the model in ``folder``, from its safetensors headers (a tied output layer counted once, as
    the model holds it)."""
    from shared.adapters import SafetensorsFile

    total = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with SafetensorsFile(shard) as fh:
            for entry in fh.entries.values():
                n = 1
                for d in entry["shape"]:
                    n *= int(d)
                total += n
    return total


EVEN_REWARD = f"{REPO / 'bench' / 'rewards.py'}:even_token_ids"


def write_prompts(into: Path, count: int = 256) -> Path:
    """Fixed short prompts for the ``even`` reward (empty reference answers: the reward reads none)."""
    path = into / "even-prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Q: {i}+{i % 7}= A:", "answer": ""}) + "\n" for i in range(count)))
    return path


def mode_options(mode: str) -> tuple[str, dict[str, str]]:
    """``"sequential@one-process lr=1e-6 precision=bf16"`` → ("sequential@one-process", {"lr": …, "precision": …})."""
    name, *pairs = mode.split()
    options = dict(p.split("=", 1) for p in pairs)
    unknown = set(options) - {"lr", "precision"}
    if unknown:
        raise SystemExit(f"mode {mode!r}: unknown options {sorted(unknown)} (lr=…, precision=float32|bf16)")
    return name, options


def write_config(path: Path, run_dir: Path, model: Path, mode: str, steps: int, args: argparse.Namespace) -> None:
    mode, options = mode_options(mode)
    lr = float(options.get("lr", args.lr.split(",")[0]))
    name, _, layout = mode.partition("@")
    top = dict(MODES[name]) | {"layout": layout or "processes"}
    keep = 2 if top["sync_mode"] == "sequential-pull" else top["max_staleness"] + 2
    sections: dict[str, dict[str, Any]] = {
        "model": {"path": str(model), "device": args.device},
        "server": {"host": "127.0.0.1", "port": 0},
        "learner": {"max_steps": steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                    "eval_every": args.eval_every,
                    "eval_size": 16, "weight_decay": 0.01 if args.reward == "addition" else 0.0, "lr": lr,
                    "checkpoint_every_steps": args.checkpoint_every, "lora_rank": args.lora_rank,
                    "world_size": args.learner_ranks, "mixed_precision": args.mixed_precision,
                    "precision": options.get("precision", "float32"),
                    **({"fsdp": True} if args.fsdp else {})},
        "jobs": {"prompts_per_job": args.prompts_per_job, "lease_timeout_s": 600.0, "long_poll_s": 10.0},
        "sampling": {"max_tokens": args.max_tokens},
        "snapshots": {"keep_last": keep, "gguf": args.gguf, "dtype": args.dtype,
                      **({"gguf_also": args.gguf_also.split(",")} if args.gguf_also else {}),
                      **({"lag_tolerance": args.lag_tolerance} if args.lag_tolerance is not None else {})},
    }
    if args.reward == "even":
        sections["task"] = {"type": "dataset", "train_path": str(write_prompts(path.parent)), "heldout_size": 16}

    def toml(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else str(v)

    lines = [f'run_dir = "{run_dir}"'] + [f"{k} = {toml(v)}" for k, v in top.items()]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {toml(v)}" for k, v in values.items())
    if args.reward == "even":
        lines += ["\n[[task.rewards]]", f"function = {toml(EVEN_REWARD)}"]
    path.write_text("\n".join(lines) + "\n")


class Child:
    """A child process with its output in a log file; remembers its PID's peak RSS while it lives."""

    def __init__(self, argv: list[str], log: Path, ready: str | None = None, env: dict[str, str] | None = None) -> None:
        self.log = open(log, "w")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))
        self.ready_line: str | None = None
        self._ready = threading.Event()
        self._text = ready
        self.peak_rss_kib = 0
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if self._text and self._text in line and self.ready_line is None:
                self.ready_line = line
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float) -> str:
        self._ready.wait(timeout)
        if self.ready_line is None:
            raise SystemExit(f"a child process did not start; see {self.log.name}")
        return self.ready_line

    def sample_rss(self) -> None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_kib = max(self.peak_rss_kib, int(line.split()[1]))
        except OSError:
            pass

    def stop(self) -> None:
        self.sample_rss()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # removed while we walked
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def status(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/v1/status", timeout=30) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out
    except OSError:
        return None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def probe(url: str, stop: threading.Event, out: dict[str, list[tuple[float, float]]]) -> None:
    """Every 0.2 s: GET /healthz, then a signed POST /v1/release of a job that does not exist."""
    import aiohttp

    from shared import crypto, wire
    from shared.messages import RegisterRequest, ReleaseRequest
    from swarm_client.hardware import profile

    key = crypto.generate_key()
    reg = wire.encode(RegisterRequest(public_key=crypto.public_bytes(key), profile=profile("torch", "cpu", "probe")))
    rel = wire.encode(ReleaseRequest(job_id="probe-none", lease_id="probe-none"))
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def signed(path: str, body: bytes) -> float:
            env = wire.encode(crypto.sign_request(key, path, body, timestamp=time.time()))
            t0 = time.perf_counter()
            async with session.post(url + path, data=env, headers={"Content-Type": "application/msgpack"}) as r:
                await r.read()
            return (time.perf_counter() - t0) * 1000

        await signed("/v1/register", reg)
        while not stop.is_set():
            t0 = time.perf_counter()
            async with session.get(url + "/healthz") as r:
                await r.read()
            out["healthz"].append((time.time(), (time.perf_counter() - t0) * 1000))
            out["signed"].append((time.time(), await signed("/v1/release", rel)))
            await asyncio.sleep(0.2)


def read_steps(run_dir: Path) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
    conn = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        steps = [json.loads(m) | {"at": at, "mean_reward": r}
                 for at, m, r in conn.execute("SELECT at, metrics, mean_reward FROM steps ORDER BY step")]
        versions = [(int(v), float(at)) for v, at in conn.execute("SELECT version, created_at FROM versions")]
    finally:
        conn.close()
    return steps, versions


def role_pids(url: str) -> dict[str, int]:
    s = status(url)
    roles = (s or {}).get("roles", {})
    return {name: int(r["pid"]) for name, r in roles.items() if r.get("pid")}


def vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def manifest_entries(url: str, version: int) -> dict[str, dict[str, Any]] | None:
    """The files of a served version's signed manifest (path → size, sha256, form, base), or None once pruned."""
    from shared import wire
    from shared.messages import Manifest, SignedManifest

    try:
        with urllib.request.urlopen(f"{url}/v1/snapshots/{version}", timeout=30) as resp:
            raw = resp.read()
    except OSError:
        return None
    manifest = wire.decode(wire.decode(raw, SignedManifest).manifest, Manifest)
    return {f.path: {"size": f.size, "sha256": f.sha256, "form": f.form, "base": f.base_sha256}
            for f in manifest.files}


REBUILT = re.compile(r"rebuilt (\S+) \((\d+) bytes\) from a (\d+)-byte patch in ([\d.]+)s")
REFUSED = re.compile(r"patch for (\S+) refused")  # a rebuilt file whose sha256 is not the published one, among others


def weight_files(manifests: dict[int, dict[str, dict[str, Any]]]) -> list[str]:
    """The whole-weight files the versions were published as: model.safetensors, model.gguf and each further
    precision's model.<precision>.gguf (``--gguf-also``)."""
    names = {p for m in manifests.values() for p, f in m.items()
             if f["form"] != "delta" and p.startswith("model.") and p.endswith((".safetensors", ".gguf"))}
    return sorted(names, key=lambda p: (not p.endswith(".safetensors"), p != "model.gguf", p))


def delta_figures(manifests: dict[int, dict[str, dict[str, Any]]], client_log: Path) -> dict[str, Any]:
    """Per weight file: the full file and its patch per version (median, max; versions that had one), and what the
    client applied (from its log)."""
    out: dict[str, Any] = {}
    for name in weight_files(manifests):
        full = [m[name]["size"] for m in manifests.values() if name in m]
        patches = [m[name + ".delta"]["size"] for m in manifests.values() if name + ".delta" in m]
        if full:
            out[name] = {"full": statistics.median(full), "versions": len(full), "patched_versions": len(patches),
                         "delta_median": statistics.median(patches) if patches else None,
                         "delta_max": max(patches) if patches else None}
    log = client_log.read_text() if client_log.exists() else ""
    out["client_applied"] = [{"file": f, "size": int(n), "patch": int(p), "apply_s": float(t)}
                             for f, n, p, t in REBUILT.findall(log)]
    out["client_refused"] = REFUSED.findall(log)  # a file enters the client's cache only if its sha256 is the manifest's
    return out


class VerifierHold:
    """Holds the verifier at ``recompute-v0`` for ``seconds`` once, then lets every later hold go at once (each
    recompute of version 0 reaches the hold point and would wait again)."""

    def __init__(self, marker: Path, seconds: float) -> None:
        self.marker, self.seconds = marker, seconds
        self.held_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.marker.exists():
            if self._stop.wait(0.1):
                return
        since = time.monotonic()
        self._stop.wait(self.seconds)
        self.held_s = time.monotonic() - since
        while True:
            self.marker.unlink(missing_ok=True)
            if self._stop.wait(0.05):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.marker.unlink(missing_ok=True)


def intake_counters(url: str) -> dict[str, float]:
    """The API's own counts (/metrics): recomputes asked for results, resends that joined one in flight."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    wanted = {"echo_swarm_result_recomputes_total": "recomputes", "echo_swarm_result_resends_joined_total": "joined"}
    return {wanted[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in wanted}


def busy_verifier_figures(run_dir: Path, client_home: Path, counters: dict[str, float], held_s: float
                          ) -> dict[str, Any]:
    """What the busy verifier cost: counters from /metrics, refusals and accepted results from the store, and the
    client's own tally of "accepted" replies (its lifetime ledger, swarm_client/lifetime.py)."""
    conn = sqlite3.connect(f"file:{run_dir / 'coordinator.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        stored = int(conn.execute("SELECT COUNT(*) FROM results").fetchone()[0])
        refused = [tuple(r) for r in conn.execute("SELECT reason, COUNT(*) FROM rejections GROUP BY reason")]
    finally:
        conn.close()
    from swarm_client.lifetime import Lifetime

    told = Lifetime(client_home, readonly=True).totals()
    return {"held_s": round(held_s, 1), "recomputes": counters.get("recomputes"), "resends_joined":
            counters.get("joined"), "refused": refused, "accepted_in_store": stored,
            "client_told_accepted": told["accepted"], "client_told_refused": told["rejected"]}


def run_mode(mode: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    safe = mode.replace("@", "-").replace(" ", "-").replace("=", "")
    run_dir = work / f"run-{safe}"
    cfg = work / f"{safe}.toml"
    write_config(cfg, run_dir, model, mode, args.steps, args)
    logs = Path(args.out)
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    marker = work / f"{safe}-verifier-held"
    hold = VerifierHold(marker, args.hold_verifier) if args.hold_verifier > 0 else None
    counters: dict[str, float] = {}
    coord = Child([sys.executable, "-m", "echo_swarm", "coordinator", "--config", str(cfg)],
                  logs / f"{safe}-coordinator.log", ready="listening on ",
                  env={"ECHO_SWARM_HOLD": f"recompute-v0={marker}"} if hold is not None else None)
    role_kib: dict[str, int] = {}
    client: Child | None = None
    stop_probe = threading.Event()
    lat: dict[str, list[tuple[float, float]]] = {"healthz": [], "signed": []}
    disk: list[int] = []
    manifests: dict[int, dict[str, dict[str, Any]]] = {}  # version → its files, read while it is served
    try:
        url = coord.wait_ready(1800).split("listening on ")[1].split()[0]
        listening_s = time.monotonic() - t_start
        client = Child([sys.executable, "-m", "echo_swarm", "join", url, "--home", str(work / f"client-{safe}"),
                        "--threads", str(args.client_threads), "--exit-when-finished", "--no-benchmark",
                        "--backend", args.client_backend, "--device", args.device],
                       logs / f"{safe}-client.log")
        prober = threading.Thread(target=lambda: asyncio.run(probe(url, stop_probe, lat)), daemon=True)
        prober.start()
        deadline = time.monotonic() + args.timeout
        final: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            coord.sample_rss()
            client.sample_rss()
            for name, pid in role_pids(url).items():
                role_kib[name] = max(role_kib.get(name, 0), vm_hwm_kib(pid))
            disk.append(dir_bytes(run_dir))
            s = status(url)
            for v in range(len(manifests), (s or {}).get("version", -1) + 1):
                entries = manifest_entries(url, v)
                if entries is None and v in manifests:
                    continue
                manifests[v] = entries or {}
            if s is not None and s["finished"] and any(e["version"] == s["version"] for e in s["evals"]):
                final = s
                break
            if coord.proc.poll() is not None:
                raise SystemExit(f"the coordinator exited; see {coord.log.name}")
            time.sleep(1.0)
        if final is None:
            raise SystemExit(f"mode {mode} did not finish within {args.timeout}s")
        steady_disk = dir_bytes(run_dir)
        if hold is not None:
            counters = intake_counters(url)
    finally:
        if hold is not None:
            hold.stop()
        stop_probe.set()
        for child in (client, coord):
            if child is not None:
                child.stop()
    steps, versions = read_steps(run_dir)
    if set(role_kib) <= {"api"}:  # one process: every role's memory is the API's process
        role_kib = {"all roles": max(role_kib.get("api", 0), coord.peak_rss_kib)}
    result = summarise(mode, steps, versions, lat, disk, steady_disk, listening_s, role_kib,
                       client.peak_rss_kib if client else 0, final)
    result["deltas"] = delta_figures(manifests, work / f"client-{safe}" / "logs" / "client.log")
    result["rewards"] = [round(float(st.get("mean_reward", float("nan"))), 3) for st in steps]
    result["grad_norms"] = [round(float(st.get("grad_norm", float("nan"))), 4) for st in steps]  # 0: no gradient
    if hold is not None:
        result["busy_verifier"] = busy_verifier_figures(run_dir, work / f"client-{safe}", counters, hold.held_s)
        print(f"{mode}: busy verifier {json.dumps(result['busy_verifier'])}", flush=True)
    if not args.keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)  # at 0.5 B a few GB: one mode's run at a time on disk
    return result


def summarise(mode: str, steps: list[dict[str, Any]], versions: list[tuple[int, float]],
              lat: dict[str, list[tuple[float, float]]], disk: list[int], steady_disk: int, listening_s: float,
              role_kib: dict[str, int], client_kib: int, final: dict[str, Any]) -> dict[str, Any]:
    steady = steps[1:] or steps

    def med(key: str, rows: list[dict[str, Any]] = steady) -> float:
        return statistics.median(float(s.get(key, 0.0)) for s in rows)

    opt = [s["train_s"] - s.get("checkpoint_gate_s", 0.0) - s.get("publish_gate_s", 0.0) for s in steady]
    busy = [s["learner_s"] - s["wait_s"] for s in steady]
    v0_at = min(at for v, at in versions if v == 0)
    first_step_at = steps[0]["at"] - steps[0]["step_s"]
    in_run = [ms for t, ms in lat["signed"] if first_step_at <= t <= steps[-1]["at"]]
    in_run_h = [ms for t, ms in lat["healthz"] if first_step_at <= t <= steps[-1]["at"]]
    gaps = [b - a for (_, a), (_, b) in zip(sorted(versions)[:-1], sorted(versions)[1:], strict=True)]
    return {
        "mode": mode,
        "steps": len(steps),
        "listening_s": listening_s,
        "first_step_s": steps[0]["step_s"],
        "first_train_s": steps[0]["train_s"],
        "version_interval_s": statistics.median(gaps[1:] or gaps),
        "optimisation_s": statistics.median(opt),
        "handover_s": med("handover_s"),
        "publish_wait_s": med("publish_wait_s"),
        "wait_s": med("wait_s"),
        "learner_s": med("learner_s"),
        "publish_s": med("publish_s"),
        "checkpoint_s": max(float(s.get("checkpoint_s", 0.0)) for s in steps),
        "checkpoint_gate_s": max(float(s.get("checkpoint_gate_s", 0.0)) for s in steps),
        "publish_gate_s": med("publish_gate_s"),
        "verify_s": med("verify_s"),
        "eval_s": max(float(s.get("eval_s", 0.0)) for s in steps),
        "step_to_leasable_s": med("step_s"),
        "duty": sum(opt) / sum(busy),
        "snapshot_bytes": med("snapshot_bytes"),
        "run_dir_peak_bytes": max(disk) if disk else 0,
        "run_dir_steady_bytes": steady_disk,
        "coordinator_peak_rss_gib": sum(role_kib.values()) / 2**20,
        "role_peak_rss_gib": {name: kib / 2**20 for name, kib in sorted(role_kib.items())},
        "client_peak_rss_gib": client_kib / 2**20,
        "signed_p50_ms": pct(in_run, 0.5),
        "signed_p99_ms": pct(in_run, 0.99),
        "healthz_p50_ms": pct(in_run_h, 0.5),
        "healthz_p99_ms": pct(in_run_h, 0.99),
        "probes": len(in_run),
        # the slowest signed requests, as seconds after the first step began: lined up with the coordinator's log
        # (publications, result intake, step commits) they say what a slow request waited behind
        "signed_slowest": [[round(t - first_step_at, 2), round(ms, 1)] for t, ms in sorted(
            ((t, ms) for t, ms in lat["signed"] if first_step_at <= t <= steps[-1]["at"]), key=lambda x: -x[1])[:8]],
        "run_s": steps[-1]["at"] - v0_at,
        "versions": final["version"],
    }


ROWS = [
    ("learner step: optimisation (fwd+bwd+AdamW), median", "optimisation_s", "s"),
    ("learner step: hand-over copy (publish dtype)", "handover_s", "s"),
    ("learner step: waiting for the previous publication", "publish_wait_s", "s"),
    ("learner: waiting for results", "wait_s", "s"),
    ("learner duty = optimisation ÷ (wall − waiting for results)", "duty", "f"),
    ("publication (background: safetensors, GGUF, sha256, fsync, manifest)", "publish_s", "s"),
    ("checkpoint write (background, max)", "checkpoint_s", "s"),
    ("optimizer step held for a checkpoint write (max)", "checkpoint_gate_s", "s"),
    ("optimizer step held while live weights are written (zero-copy hand-over), median", "publish_gate_s", "s"),
    ("verification per step (verifier thread)", "verify_s", "s"),
    ("held-out evaluation (evaluator thread, max)", "eval_s", "s"),
    ("train start → version leasable, median", "step_to_leasable_s", "s"),
    ("version interval (one client), median", "version_interval_s", "s"),
    ("first step, train start → leasable", "first_step_s", "s"),
    ("coordinator start → listening", "listening_s", "s"),
    ("bytes per version (own snapshot folder)", "snapshot_bytes", "GB"),
    ("run directory: peak / at the end", "run_dir_peak_bytes", "GB2"),
    ("peak RSS per role process, and the client", "role_peak_rss_gib", "RSS"),
    ("learner peak RSS per parameter; verifier peak ÷ its float32 replica", "role_peak_rss_gib", "per-param"),
    ("signed request (POST /v1/release) p50 / p99 while stepping", "signed_p50_ms", "ms"),
    ("GET /healthz p50 / p99 while stepping", "healthz_p50_ms", "msh"),
]


def fmt(r: dict[str, Any], key: str, kind: str) -> str:
    v = r[key]
    if kind == "s":
        return f"{v:.2f} s"
    if kind == "f":
        return f"{v:.2f}"
    if kind == "GB":
        return f"{v / 1e9:.3f} GB"
    if kind == "GB2":
        return f"{r['run_dir_peak_bytes'] / 1e9:.2f} / {r['run_dir_steady_bytes'] / 1e9:.2f} GB"
    if kind == "RSS":
        roles = ", ".join(f"{name} {gib:.2f}" for name, gib in r["role_peak_rss_gib"].items())
        return f"{roles}; client {r['client_peak_rss_gib']:.2f} GiB"
    if kind == "per-param":
        n = r.get("parameters") or 0
        if not n:
            return "–"
        parts = [f"{name} {gib * 2**30 / n:.1f} B/param" if not name.startswith("verifier")
                 else f"{name} {gib * 2**30 / (4 * n):.2f}×" for name, gib in r["role_peak_rss_gib"].items()
                 if name == "learner" or name.startswith("verifier")]
        return ", ".join(parts) or "–"
    if kind == "ms":
        return f"{r['signed_p50_ms']:.0f} / {r['signed_p99_ms']:.0f} ms"
    return f"{r['healthz_p50_ms']:.0f} / {r['healthz_p99_ms']:.0f} ms"


def table(results: list[dict[str, Any]]) -> str:
    head = "| per learner step (steady state) | " + " | ".join(r["mode"] for r in results) + " |"
    lines = [head, "|---|" + "---|" * len(results)]
    for label, key, kind in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(r, key, kind) for r in results) + " |")
    return "\n".join(lines)


def delta_table(results: list[dict[str, Any]]) -> str:
    """Bytes per version, patch against full file, per weight file; and the client's apply time."""
    lines = ["| mode | file | full file | patch per version, median (max) | patch ÷ full, median (max) | versions "
             "patched | client: patches applied (rebuilt = published), apply + sha256 median (max) | refused |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        d = r.get("deltas", {})
        for name in (k for k in d if k.startswith("model.")):
            f = d[name]
            applied = [a["apply_s"] for a in d.get("client_applied", []) if a["file"] == name]
            patch = (f"{f['delta_median'] / 1e6:.2f} MB ({f['delta_max'] / 1e6:.2f} MB)"
                     if f["delta_median"] is not None else "none")
            share = (f"{100 * f['delta_median'] / f['full']:.2f} % ({100 * f['delta_max'] / f['full']:.2f} %)"
                     if f["delta_median"] is not None else "–")
            apply_text = (f"{len(applied)}, {statistics.median(applied):.2f} s ({max(applied):.2f} s)" if applied
                          else "0")
            refused = sum(1 for x in d.get("client_refused", []) if x == name)
            lines.append(f"| {r['mode']} | {name} | {f['full'] / 1e6:.1f} MB | {patch} | {share} | "
                         f"{f['patched_versions']} of {f['versions']} | {apply_text} | {refused} |")
    return "\n".join(lines)


# The "before" learner step at 0.5 B, full weights, one torch client, sequential pull (../shared/notes/scale.md,
# measured 2026-11-30 at 3670130): everything below ran on the learner thread, every step (verification: two
# results of 4 × 16 tokens at 1.4–1.8 s each; held-out evaluation, 10–12 s every eval_every steps, not shown).
BEFORE_05B = {"optimisation": 13.7, "publication": 8.5, "optimizer save": 7.0, "verification": 3.2}


def plot(results: list[dict[str, Any]], path: Path, before: bool) -> None:
    """Seconds of learner time per step that are not spent waiting for results, stacked by what they are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"optimisation": "#2a7", "publication": "#c52", "optimizer save": "#e93", "verification": "#58c",
               "hand-over copy": "#9c6",
               "waiting for the previous publication": "#a4c", "other (batch preparation)": "#bbb"}
    bars: list[tuple[str, dict[str, float], float]] = []
    if before:
        total = sum(BEFORE_05B.values())
        bars.append(("before (sequential)", dict(BEFORE_05B), BEFORE_05B["optimisation"] / total))
    for r in results:
        other = max(0.0, r["learner_s"] - r["wait_s"] - r["optimisation_s"] - r["handover_s"] - r["publish_wait_s"])
        bars.append((f"after ({r['mode']})", {"optimisation": r["optimisation_s"], "hand-over copy": r["handover_s"],
                     "waiting for the previous publication": r["publish_wait_s"],
                     "other (batch preparation)": other}, r["duty"]))
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.6 * len(bars)))
    seen: set[str] = set()
    for i, (_, parts, duty) in enumerate(bars):
        left = 0.0
        for name, value in parts.items():
            ax.barh(i, value, left=left, color=colours[name], label=None if name in seen else name)
            seen.add(name)
            left += value
        ax.text(left * 1.01 + 0.1, i, f"duty {duty:.2f}", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("learner seconds per step, excluding waiting for results (median of steady steps)")
    ax.set_title("Learner time per step: before and after publication left the critical path", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "qwen0.5b"], default="tiny")
    ap.add_argument("--modes", default="sequential,async", help="comma-separated: sequential, async, each "
                    "optionally @one-process (all roles in one process) or @processes (the default)")
    ap.add_argument("--steps", type=int, default=5, help="learner steps (versions) per mode")
    ap.add_argument("--dtype", default="bfloat16", help="snapshots.dtype")
    ap.add_argument("--lora-rank", type=int, default=0, help="learner.lora_rank (0: full weights)")
    ap.add_argument("--learner-ranks", type=int, default=1, help="learner.world_size (FSDP ranks, one per GPU)")
    ap.add_argument("--fsdp", action="store_true", help="learner.fsdp: FSDP2 even on one rank (one device)")
    ap.add_argument("--mixed-precision", choices=["off", "bf16"], default="off", help="learner.mixed_precision "
                    "(needs --fsdp or --learner-ranks > 1)")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="learner.checkpoint_every_steps")
    ap.add_argument("--eval-every", type=int, default=3, help="learner.eval_every")
    ap.add_argument("--client-threads", type=int, default=1)
    ap.add_argument("--client-backend", choices=["torch", "llama"], default="torch")
    ap.add_argument("--prompts-per-step", type=int, default=2, help="learner.prompts_per_step (1 prompt per job)")
    ap.add_argument("--prompts-per-job", type=int, default=1, help="jobs.prompts_per_job")
    ap.add_argument("--group-size", type=int, default=4, help="learner.group_size")
    ap.add_argument("--max-tokens", type=int, default=16, help="sampling.max_tokens")
    ap.add_argument("--device", default="cpu", help="model.device of the coordinator and the client's --device "
                    "(e.g. cuda: learner, verifier, evaluator and client on one GPU)")
    ap.add_argument("--reward", choices=["even", "addition"], default="even", help="even: a dataset task scored "
                    "by bench/rewards.py:even_bytes (a real gradient on random weights); addition: the arithmetic "
                    "task with weight decay (gradient 0 on random weights)")
    ap.add_argument("--lr", default="1e-5", help="learner.lr; several, comma-separated, run every mode at each "
                    "(one after the other, each run directory deleted before the next)")
    ap.add_argument("--gguf", default="f16", help="snapshots.gguf (off, f32, f16, q8_0)")
    ap.add_argument("--gguf-also", default="", help="snapshots.gguf_also: further precisions published every version "
                    "(e.g. q8_0,q4_K_M: llama.cpp's quantiser), each with its own patch in the delta table")
    ap.add_argument("--lag-tolerance", type=float, default=None, help="snapshots.lag_tolerance (default: the "
                    "config's; 0 publishes every rounding)")
    ap.add_argument("--hold-verifier", type=float, default=0.0, help="hold the verifier this many seconds at its "
                    "first recompute of version 0 (0: not held) and report what the resends cost")
    ap.add_argument("--keep-run", action="store_true", help="keep each mode's run directory (deleted by default)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per mode")
    ap.add_argument("--out", default="bench-out/scale", help="logs and result.json")
    ap.add_argument("--plot", default=None, help="write the breakdown plot here (png)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="echo-swarm-scale-"))
    results = []
    try:
        model = build_model(args.model, work)
        lrs = args.lr.split(",")
        for mode in [m.strip() + (f" lr={lr}" if len(lrs) > 1 else "") for lr in lrs for m in args.modes.split(",")]:
            r = run_mode(mode, model, work, args) | {"parameters": parameter_count(model),
                                                              "precision": mode_options(mode)[1].get("precision",
                                                                                                     "float32"),
                                                              "lora_rank": args.lora_rank,
                                                              "client": args.client_backend,
                                                              "learner_ranks": args.learner_ranks,
                                                              "fsdp": args.fsdp or args.learner_ranks > 1,
                                                              "mixed_precision": args.mixed_precision}
            print(json.dumps(r, indent=1), flush=True)
            results.append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the 0.5 B model and run directories are ~2 GB each
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"model": args.model, "args": vars(args), "results": results},
                                                indent=1))
    print()
    print(table(results))
    print()
    print(delta_table(results))
    if args.plot:
        plot(results, Path(args.plot), before=args.model == "qwen0.5b" and args.lora_rank == 0)


if __name__ == "__main__":
    main()
